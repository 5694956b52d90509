"""Single files and exported models: ``Accelerator.save`` and ``save_model``.

Both write from the calling process only (the façade calls them on the main process) and hold no
barrier, so calling them under ``if accelerator.is_main_process:`` is safe. Every file is written
atomically (:func:`anyaccel.fileio.atomic_write`).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any, Dict, List

import torch

from ..fileio import atomic_write, atomic_write_bytes
from .serialize import safetensors_metadata, split_state_dict, torch_writer

__all__ = ["atomic_save", "save_model", "parse_size"]


def atomic_save(obj: Any, path: Any, safe_serialization: bool = False) -> None:
    """Write ``obj`` to ``path`` through a temporary file in the same directory, fsync, rename
    (``torch.save``; a safetensors file of a dict of tensors with ``safe_serialization``).
    Local to the calling process."""

    def write(tmp: str) -> None:
        if safe_serialization:
            from safetensors.torch import save_file

            tensors, aliases, extra = split_state_dict(obj)
            if extra:
                raise TypeError(f"safe_serialization=True stores tensors only; these entries are not tensors: "
                                f"{sorted(extra)[:5]}")
            save_file(tensors, tmp, metadata=safetensors_metadata(aliases))
        else:
            torch_writer(obj)(tmp)

    atomic_write(os.fspath(path), write)


def parse_size(size: Any) -> int:
    """Bytes in ``max_shard_size``: an int, or a string like ``"10GB"`` (10**9) or ``"500MiB"``
    (2**20). One rule with Accelerate's ``convert_file_size_to_int`` (its home). Local."""
    from ..big_modeling.sizes import convert_file_size_to_int

    return convert_file_size_to_int(size, what="max_shard_size")


def _shard(tensors: Dict[str, torch.Tensor], limit: int) -> List[Dict[str, torch.Tensor]]:
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def save_model(state_dict: Dict[str, Any], save_directory: Any, max_shard_size: Any = "10GB",
               safe_serialization: bool = True) -> None:
    """Write a model's full ``state_dict`` to ``save_directory``. Layout as Hugging Face's
    ``save_pretrained``: ``model.safetensors``, or above ``max_shard_size``
    ``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json``
    (``pytorch_model*.bin`` with ``safe_serialization=False``). Each file is written atomically,
    the index after the shards; stale shards of an earlier save are removed last. Tied weights
    are stored once. Local to the calling process (no barrier)."""
    directory = os.path.abspath(os.fspath(save_directory))
    if os.path.isfile(directory):
        raise ValueError(f"save_model needs a directory; {directory} is a file")
    os.makedirs(directory, exist_ok=True)
    limit = parse_size(max_shard_size)
    tensors, aliases, extra = split_state_dict(state_dict)
    if extra:
        if safe_serialization:
            warnings.warn(f"save_model: entries that are not tensors are not stored in safetensors files: "
                          f"{sorted(extra)[:5]}", stacklevel=3)
        else:
            tensors = {**tensors, **extra}
    base, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    shards = _shard(tensors, limit) if safe_serialization else _shard_any(tensors, limit)
    n = len(shards)
    names = [f"{base}.{ext}"] if n == 1 else [f"{base}-{i + 1:05d}-of-{n:05d}.{ext}" for i in range(n)]
    for name, shard in zip(names, shards):
        shard_aliases = {a: k for a, k in aliases.items() if k in shard}
        _write_weights(os.path.join(directory, name), shard, shard_aliases, safe_serialization)
    index_name = f"{base}.{ext}.index.json"
    written = set(names)
    if n > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values()
                                           if isinstance(t, torch.Tensor))},
            "weight_map": {k: name for name, shard in zip(names, shards) for k in shard},
        }
        atomic_write_bytes(os.path.join(directory, index_name), json.dumps(index, indent=2, sort_keys=True).encode())
        written.add(index_name)
    stale = re.compile(rf"^{re.escape(base)}(-\d{{5}}-of-\d{{5}})?\.{ext}(\.index\.json)?$")
    for entry in os.listdir(directory):
        if stale.match(entry) and entry not in written:
            os.unlink(os.path.join(directory, entry))


def _shard_any(entries: Dict[str, Any], limit: int) -> List[Dict[str, Any]]:
    tensors = {k: v for k, v in entries.items() if isinstance(v, torch.Tensor)}
    shards = _shard(tensors, limit)
    shards[-1].update({k: v for k, v in entries.items() if not isinstance(v, torch.Tensor)})
    return shards


def _write_weights(path: str, shard: Dict[str, Any], aliases: Dict[str, str], safe: bool) -> None:
    def write(tmp: str) -> None:
        if safe:
            from safetensors.torch import save_file

            save_file(shard, tmp, metadata=safetensors_metadata(aliases))
        else:
            torch_writer(shard)(tmp)

    atomic_write(path, write)
