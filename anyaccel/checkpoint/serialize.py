"""State dicts to files and back: safetensors with tied weights stored once, ``torch.save`` for
the rest, and loading that refuses to unpickle arbitrary objects unless it must.

Local to the calling process; no communication.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..backends import has_storage
from ..errors import CheckpointError
from ..fileio import write_synced
from ..tree import map_tensors

__all__ = ["torch_writer", "bytes_writer", "torch_load", "split_state_dict", "safetensors_metadata",
           "model_file_writers", "save_model_file", "load_model_file", "to_cpu", "snapshot", "Stage", "host_copy"]


def torch_writer(obj: Any) -> Callable[[str], None]:
    """A writer for :func:`anyaccel.fileio.write_synced`/``atomic_write``: ``torch.save(obj)``."""

    def write(path: str) -> None:
        with open(path, "wb") as fh:  # a file object: torch derives no archive name from the path
            torch.save(obj, fh)

    return write


def bytes_writer(data: bytes) -> Callable[[str], None]:
    def write(path: str) -> None:
        with open(path, "wb") as fh:
            fh.write(data)

    return write


def torch_load(path: str) -> Any:
    """``torch.load`` with ``weights_only=True``; falls back to full unpickling (with a warning)
    only when the content needs it. Corrupt files raise :class:`CheckpointError`."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights_only" not in str(exc).lower() and "weights only" not in str(exc).lower():
            raise CheckpointError(f"{path} is corrupt: {exc}") from exc
        warnings.warn(f"{path} holds objects that weights_only loading refuses; loading it with full unpickling "
                      "(load only checkpoints you trust)", stacklevel=3)
    except (EOFError, RuntimeError, ValueError, OSError) as exc:
        raise CheckpointError(f"{path} is corrupt or truncated: {exc}") from exc
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"{path} cannot be loaded: {exc}") from exc


def to_cpu(state: Any) -> Any:
    """Device tensors (CUDA, XLA, ...) in a nested state dict copied to the CPU for saving."""
    return map_tensors(lambda t: t if t.device.type == "cpu" else t.detach().to("cpu"), state)


Stage = Callable[[torch.Tensor], torch.Tensor]


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A new host (CPU) copy of ``tensor``: the default :data:`Stage`."""
    return tensor.detach().to("cpu", copy=True)


def snapshot(state: Any, stage: Stage = host_copy) -> Any:
    """A copy of a nested state in host memory that training cannot change any more: every tensor
    copied to the CPU by ``stage`` (default: a new tensor each; an asynchronous save passes one
    that reuses its buffers), containers rebuilt. For asynchronous saves."""
    return map_tensors(lambda t: stage(t.detach()), state)


def _storage_known(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` exposes a storage pointer (not on XLA or meta: tied weights there are
    saved twice, which is harmless). The device's facts say (:func:`anyaccel.backends.has_storage`)."""
    return tensor.numel() > 0 and has_storage(tensor.device.type)


def split_state_dict(state_dict: Dict[str, Any], stage: Optional[Stage] = None
                     ) -> Tuple[Dict[str, torch.Tensor], Dict[str, str], Dict[str, Any]]:
    """Split into (tensors on the CPU, each storage saved once; aliases {dropped name: kept
    name} for tied weights; non-tensor entries). With ``stage``, every tensor kept is a copy made
    by it (else CPU tensors are returned as they are, when contiguous and unshared)."""
    tensors: Dict[str, torch.Tensor] = {}
    aliases: Dict[str, str] = {}
    extra: Dict[str, Any] = {}
    seen: Dict[tuple, str] = {}
    storages: Dict[tuple, int] = {}
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            extra[name] = value
            continue
        value = value.detach()
        if _storage_known(value):
            ptr = (value.device.type, value.device.index, value.untyped_storage().data_ptr())
            key = ptr + (value.storage_offset(), tuple(value.shape), tuple(value.stride()), value.dtype)
            if key in seen:
                aliases[name] = seen[key]
                continue
            seen[key] = name
            storages[ptr] = storages.get(ptr, 0) + 1
        tensors[name] = value
    out: Dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        if stage is not None:
            out[name] = stage(value.contiguous() if value.device.type == "cpu" else value)
            continue
        shared = False
        if _storage_known(value):
            shared = storages.get((value.device.type, value.device.index, value.untyped_storage().data_ptr()), 0) > 1
        cpu = value.to("cpu").contiguous()
        if shared or (value.device.type == "cpu" and cpu.untyped_storage().nbytes() != cpu.numel() * cpu.element_size()):
            cpu = cpu.clone()
        out[name] = cpu
    return out, aliases, extra


def safetensors_metadata(aliases: Dict[str, str]) -> Dict[str, str]:
    meta = {"format": "pt"}
    if aliases:
        meta["anyaccel_aliases"] = json.dumps(aliases, sort_keys=True)
    return meta


def model_file_writers(stem: str, state_dict: Dict[str, Any], safe: bool,
                       copy: Optional[Stage] = None) -> Dict[str, Callable[[str], None]]:
    """``{file name: writer}`` for one model's full state dict: ``<stem>.safetensors`` (+
    ``<stem>_extra.bin`` for entries that are not tensors), or ``pytorch_<stem>.bin`` without
    ``safe``. With ``copy`` (a :data:`Stage`) the writers hold their own host copy of every tensor,
    made by it (training may go on before they run). Local."""
    if not safe:
        if copy is not None:
            return {f"pytorch_{stem}.bin": torch_writer(snapshot(state_dict, copy))}
        cpu = {k: v.to("cpu") if isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}
        return {f"pytorch_{stem}.bin": torch_writer(cpu)}
    from safetensors.torch import save_file

    if copy is not None:  # the copy first: split_state_dict would bring device tensors to the host twice
        tensors, aliases, extra = split_state_dict(state_dict, copy)
        extra = snapshot(extra, copy)
    else:
        tensors, aliases, extra = split_state_dict(state_dict)
    writers: Dict[str, Callable[[str], None]] = {
        f"{stem}.safetensors": lambda path: save_file(tensors, path, metadata=safetensors_metadata(aliases))}
    if extra:
        writers[f"{stem}_extra.bin"] = torch_writer(extra)
    return writers


def save_model_file(directory: str, stem: str, state_dict: Dict[str, Any], safe: bool) -> Dict[str, int]:
    """Write one model's full state dict (see :func:`model_file_writers`); return ``{file name:
    size}``. For a directory completed by a manifest (not atomic by itself)."""
    return {name: write_synced(os.path.join(directory, name), writer)
            for name, writer in model_file_writers(stem, state_dict, safe).items()}


def load_model_file(directory: str, stem: str) -> Dict[str, Any]:
    """Read what :func:`save_model_file` wrote (either format). Raises :class:`CheckpointError`
    naming the files looked for."""
    safe_path = os.path.join(directory, f"{stem}.safetensors")
    if os.path.exists(safe_path):
        from safetensors import safe_open

        try:
            with safe_open(safe_path, framework="pt", device="cpu") as fh:
                meta = fh.metadata() or {}
                state = {k: fh.get_tensor(k) for k in fh.keys()}
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"{safe_path} is corrupt or truncated: {exc}") from exc
        for alias, kept in json.loads(meta.get("anyaccel_aliases", "{}")).items():
            state[alias] = state[kept]
        extra_path = os.path.join(directory, f"{stem}_extra.bin")
        if os.path.exists(extra_path):
            state.update(torch_load(extra_path))
        return state
    bin_path = os.path.join(directory, f"pytorch_{stem}.bin")
    if os.path.exists(bin_path):
        return torch_load(bin_path)
    raise CheckpointError(f"{directory} has no weights for {stem} ({stem}.safetensors or pytorch_{stem}.bin)")
