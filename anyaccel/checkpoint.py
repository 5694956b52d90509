"""Checkpoints: atomic single-file saves, model export, and the full training state.

Layout of a ``save_state`` directory (names follow Hugging Face Accelerate where it has one)::

    model.safetensors, model_1.safetensors, ...   unwrapped model state dicts (safetensors;
                                                  ``pytorch_model*.bin`` with safe_serialization=False;
                                                  non-tensor entries in ``model*_extra.bin``)
    optimizer.bin, optimizer_1.bin, ...           optimizer state dicts
    scheduler.bin, ...                            LR scheduler state dicts
    scaler.pt                                     fp16 gradient scaler
    dataloader.json, dataloader_1.json, ...       loader position: epoch, batches seen, seed
    custom_checkpoint_0.pkl, ...                  objects given to register_for_checkpointing
    random_states_<rank>.pkl                      python/numpy/torch/cuda RNG states, one per process
    anyaccel_checkpoint.json                      manifest: counts, world size, versions, file sizes

Atomicity. Every process writes into a hidden sibling ``.<name>.anyaccel-tmp``; once all have
finished, the main process writes the manifest *last*, moves the previous checkpoint (if any) to
``.<name>.anyaccel-old``, renames the new one into place and deletes the old one. A process killed
at any point leaves a directory that :func:`load_state` can load: the target when it has a
manifest, otherwise the complete sibling (the previous checkpoint, or the finished new one). A
directory without a manifest never passes for a checkpoint. Multi-machine jobs need
``output_dir`` on a filesystem every process sees (checked: every process must see the temporary
directory the main process created, else every process raises).

Who does what: :func:`save_state` and :func:`load_state` are called by every process; the main
process writes the shared files, each process writes its own RNG file, and failures on any
process are reported on all of them (nobody is left waiting in a barrier). :func:`save_model`
and :func:`atomic_save` write from the calling (main) process only and contain no barrier.

Loading uses ``torch.load(weights_only=True)``; only a file whose content needs full unpickling
(e.g. a custom object's state) falls back to ``weights_only=False``, with a warning naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import re
import shutil
import sys
import tempfile
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

__all__ = [
    "ProjectConfiguration",
    "CheckpointError",
    "atomic_save",
    "save_state",
    "load_state",
    "save_model",
    "resolve_checkpoint",
    "parse_size",
    "get_rng_state",
    "set_rng_state",
    "MANIFEST",
]

MANIFEST = "anyaccel_checkpoint.json"
FORMAT = "anyaccel-checkpoint"
FORMAT_VERSION = 1
_TMP_SUFFIX = ".anyaccel-tmp"
_OLD_SUFFIX = ".anyaccel-old"
_CHECKPOINT_RE = re.compile(r"^\.?checkpoint_(\d+)(?:\.anyaccel-(?:tmp|old))?$")
# Files save_state writes itself; anything else in a replaced checkpoint is carried over.
_OWN_FILE_RE = re.compile(
    r"^(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin|model(_\d+)?_extra\.bin|optimizer(_\d+)?\.bin|"
    r"scheduler(_\d+)?\.bin|scaler\.pt|dataloader(_\d+)?\.json|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl|"
    + re.escape(MANIFEST) + r")$"
)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the directory and what is
    missing or wrong."""


@dataclasses.dataclass
class ProjectConfiguration:
    """Where a project writes (``project_dir``), and automatic checkpoint naming:
    with ``automatic_checkpoint_naming=True``, :meth:`Accelerator.save_state` called without a
    directory writes ``project_dir/checkpoints/checkpoint_<n>`` (``n`` = ``iteration``, or one past
    the highest existing checkpoint) and then keeps the newest ``total_limit`` of them;
    :meth:`Accelerator.load_state` without a directory loads the newest complete one."""

    project_dir: Optional[str] = None
    logging_dir: Optional[str] = None
    automatic_checkpoint_naming: bool = False
    total_limit: Optional[int] = None
    iteration: int = 0

    def set_directories(self, project_dir: Optional[str] = None) -> None:
        """Set ``project_dir`` (and ``logging_dir`` when unset) — Accelerate's method name."""
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir


# ------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------


def _fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: str, write: Callable[[str], None]) -> int:
    """Create ``path`` with ``write(path)``, fsync it; return its size. Not atomic by itself:
    used only inside a temporary checkpoint directory (whose manifest is written last)."""
    write(path)
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())
    return os.path.getsize(path)


def _write_bytes(data: bytes) -> Callable[[str], None]:
    def write(path: str) -> None:
        with open(path, "wb") as fh:
            fh.write(data)

    return write


def _torch_save(obj: Any) -> Callable[[str], None]:
    def write(path: str) -> None:
        with open(path, "wb") as fh:  # a file object: torch derives no archive name from the path
            torch.save(obj, fh)

    return write


def _atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` for a temporary file next to ``path``, fsync it, rename it over
    ``path``. A crash leaves either the old file or the new one, never a truncated one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(directory)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_save(obj: Any, path: Any, safe_serialization: bool = False) -> None:
    """Write ``obj`` to ``path`` through a temporary file in the same directory, fsync, rename
    (``torch.save``; a safetensors file of a dict of tensors with ``safe_serialization``).
    Local to the calling process."""
    path = os.fspath(path)

    def write(tmp: str) -> None:
        if safe_serialization:
            from safetensors.torch import save_file

            tensors, aliases, extra = _split_state_dict(obj)
            if extra:
                raise TypeError(f"safe_serialization=True stores tensors only; these entries are not tensors: "
                                f"{sorted(extra)[:5]}")
            save_file(tensors, tmp, metadata=_metadata(aliases))
        else:
            _torch_save(obj)(tmp)

    _atomic_write(path, write)


def _rmtree(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _torch_load(path: str) -> Any:
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


# ------------------------------------------------------------------------------------------
# State dicts <-> safetensors
# ------------------------------------------------------------------------------------------


# Devices whose tensors expose no storage pointer: tied weights there are saved twice (harmless).
_NO_STORAGE = ("meta", "xla")


def _split_state_dict(state_dict: Dict[str, Any]) -> Tuple[Dict[str, torch.Tensor], Dict[str, str], Dict[str, Any]]:
    """Split into (tensors on the CPU, each storage saved once; aliases {dropped name: kept
    name} for tied weights; non-tensor entries)."""
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
        if value.numel() > 0 and value.device.type not in _NO_STORAGE:
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
        shared = False
        if value.numel() > 0 and value.device.type not in _NO_STORAGE:
            shared = storages.get((value.device.type, value.device.index, value.untyped_storage().data_ptr()), 0) > 1
        cpu = value.to("cpu").contiguous()
        if shared or (value.device.type == "cpu" and cpu.untyped_storage().nbytes() != cpu.numel() * cpu.element_size()):
            cpu = cpu.clone()
        out[name] = cpu
    return out, aliases, extra


def _metadata(aliases: Dict[str, str]) -> Dict[str, str]:
    meta = {"format": "pt"}
    if aliases:
        meta["anyaccel_aliases"] = json.dumps(aliases, sort_keys=True)
    return meta


def _save_model_file(directory: str, index: int, state_dict: Dict[str, Any], safe: bool) -> Dict[str, int]:
    stem = "model" if safe else "pytorch_model"
    suffix = "" if index == 0 else f"_{index}"
    files: Dict[str, int] = {}
    tensors, aliases, extra = _split_state_dict(state_dict)
    if safe:
        from safetensors.torch import save_file

        name = f"model{suffix}.safetensors"
        files[name] = _write_file(os.path.join(directory, name),
                                  lambda path: save_file(tensors, path, metadata=_metadata(aliases)))
        if extra:
            extra_name = f"model{suffix}_extra.bin"
            files[extra_name] = _write_file(os.path.join(directory, extra_name), _torch_save(extra))
    else:
        name = f"{stem}{suffix}.bin"
        cpu = {k: v.to("cpu") if isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}
        files[name] = _write_file(os.path.join(directory, name), _torch_save(cpu))
    return files


def _load_model_file(directory: str, index: int, manifest: dict) -> Dict[str, Any]:
    suffix = "" if index == 0 else f"_{index}"
    safe_path = os.path.join(directory, f"model{suffix}.safetensors")
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
        extra_path = os.path.join(directory, f"model{suffix}_extra.bin")
        if os.path.exists(extra_path):
            state.update(_torch_load(extra_path))
        return state
    bin_path = os.path.join(directory, f"pytorch_model{suffix}.bin")
    if os.path.exists(bin_path):
        return _torch_load(bin_path)
    raise CheckpointError(f"{directory} has no weights for model {index} (model{suffix}.safetensors or "
                          f"pytorch_model{suffix}.bin)")


# ------------------------------------------------------------------------------------------
# RNG states (kept in plain types and tensors so that weights_only loading accepts them)
# ------------------------------------------------------------------------------------------


def get_rng_state() -> Dict[str, Any]:
    """This process's RNG states: Python ``random``, NumPy (if imported), torch CPU, every CUDA
    device (if CUDA is initialised) and XLA (if torch_xla is loaded). Local."""
    version, internal, gauss = random.getstate()
    state: Dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "torch_xla" in sys.modules:  # pragma: no cover - XLA
        import torch_xla.core.xla_model as xm

        state["xla"] = int(xm.get_rng_state())
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned (parts this process cannot use are skipped)."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"],
                             s["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        elif cuda_states:
            torch.cuda.set_rng_state(cuda_states[min(torch.cuda.current_device(), len(cuda_states) - 1)])
    if "xla" in state and "torch_xla" in sys.modules:  # pragma: no cover - XLA
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(state["xla"])


# ------------------------------------------------------------------------------------------
# Finding checkpoints
# ------------------------------------------------------------------------------------------


def _sibling(final: str, suffix: str) -> str:
    parent, base = os.path.split(final)
    return os.path.join(parent, f".{base}{suffix}")


def _read_manifest(directory: str) -> Optional[dict]:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, "r", encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def _problems(directory: str, manifest: dict) -> List[str]:
    """What is missing or truncated in ``directory`` compared with its manifest."""
    problems = []
    for name, size in sorted(manifest.get("files", {}).items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            problems.append(f"{name} is missing")
        elif os.path.getsize(path) != size:
            problems.append(f"{name} has {os.path.getsize(path)} bytes, the manifest says {size}")
    return problems


def resolve_checkpoint(path: Any) -> Tuple[str, dict]:
    """Return ``(directory, manifest)`` of the complete checkpoint saved at ``path``.

    If a save to ``path`` was killed, the complete sibling it left is used instead (with a
    warning). Raises ``FileNotFoundError`` when nothing is there, and :class:`CheckpointError`
    naming the path and what is missing when the checkpoint is incomplete or damaged. Local,
    read-only."""
    final = os.path.abspath(os.fspath(path))
    manifest = _read_manifest(final)
    if manifest is not None:
        problems = _problems(final, manifest)
        if problems:
            raise CheckpointError(f"checkpoint {final} is damaged: " + "; ".join(problems))
        return final, manifest
    for candidate, what in ((_sibling(final, _OLD_SUFFIX), "the previous checkpoint"),
                            (_sibling(final, _TMP_SUFFIX), "the new checkpoint, complete but not yet renamed")):
        manifest = _read_manifest(candidate)
        if manifest is not None and not _problems(candidate, manifest):
            warnings.warn(f"{final} is not a complete checkpoint (a save_state was interrupted); loading {what} "
                          f"from {candidate}", stacklevel=3)
            return candidate, manifest
    if not os.path.exists(final):
        raise FileNotFoundError(f"no checkpoint at {final}: the directory does not exist")
    if not os.path.isdir(final):
        raise CheckpointError(f"{final} is a file, not a checkpoint directory")
    content = sorted(os.listdir(final))
    listing = ", ".join(content[:10]) + (" ..." if len(content) > 10 else "") if content else "nothing"
    raise CheckpointError(
        f"{final} is not a complete anyaccel checkpoint: {MANIFEST} is missing (save_state writes it last, so "
        f"the save that made this directory did not finish, or it was not made by save_state). It contains: {listing}"
    )


def _checkpoint_root(config: ProjectConfiguration) -> str:
    if not config.project_dir:
        raise ValueError("automatic_checkpoint_naming needs a project directory: "
                         "ProjectConfiguration(project_dir=...) or Accelerator(project_dir=...)")
    return os.path.join(os.path.abspath(config.project_dir), "checkpoints")


def _checkpoint_indices(root: str) -> List[int]:
    """Indices n of ``checkpoint_<n>`` under ``root`` (siblings of interrupted saves included)."""
    if not os.path.isdir(root):
        return []
    found = set()
    for entry in os.listdir(root):
        match = _CHECKPOINT_RE.match(entry)
        if match:
            found.add(int(match.group(1)))
    return sorted(found)


# ------------------------------------------------------------------------------------------
# save_state
# ------------------------------------------------------------------------------------------


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _agree(accelerator: Any, error: Optional[BaseException], payload: Any, what: str, directory: str) -> List[Any]:
    """Exchange (error, payload) between all processes; raise on every process if any failed.
    Collective (one object all-gather) in a multi-process job."""
    from . import ops

    mine = (None if error is None else _error_text(error), payload)
    results = ops.gather_object([mine]) if accelerator.num_processes > 1 else [mine]
    failed = [(rank, err) for rank, (err, _) in enumerate(results) if err]
    if failed:
        details = "; ".join(f"process {rank}: {err}" for rank, err in failed)
        raise CheckpointError(f"save_state({directory}) failed while {what}: {details}") from error
    return [p for _, p in results]


def _prepare_tmp(final: str, tmp: str) -> None:
    """Main process: check the target, start an empty temporary directory next to it."""
    if os.path.exists(final) and not os.path.isdir(final):
        raise CheckpointError(f"{final} exists and is a file; save_state needs a directory path")
    if os.path.isdir(final) and os.listdir(final) and _read_manifest(final) is None \
            and _read_manifest(_sibling(final, _OLD_SUFFIX)) is None:
        raise CheckpointError(
            f"{final} exists, is not empty and is not an anyaccel checkpoint (no {MANIFEST}); save_state replaces "
            "the checkpoint directory as a whole, so give it a new or empty directory"
        )
    cwd = os.path.abspath(os.getcwd())
    if cwd == final or cwd.startswith(final + os.sep):
        raise CheckpointError(f"save_state({final}) would replace the current working directory; choose another path")
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    _rmtree(tmp)  # left over from an interrupted save
    os.makedirs(tmp)


def _write_shared_files(accelerator: Any, tmp: str, weights: List[Dict[str, Any]], safe: bool) -> Dict[str, int]:
    """Main process: models, optimizers, schedulers, scaler, loader positions, custom objects."""
    files: Dict[str, int] = {}
    for i, state_dict in enumerate(weights):
        files.update(_save_model_file(tmp, i, state_dict, safe))
    for kind, objects in (("optimizer", accelerator._optimizers), ("scheduler", accelerator._schedulers)):
        for i, obj in enumerate(objects):
            name = f"{kind}{'' if i == 0 else f'_{i}'}.bin"
            files[name] = _write_file(os.path.join(tmp, name), _torch_save(_to_cpu(obj.state_dict())))
    if accelerator.scaler is not None:
        files["scaler.pt"] = _write_file(os.path.join(tmp, "scaler.pt"), _torch_save(accelerator.scaler.state_dict()))
    for i, loader in enumerate(accelerator._dataloaders):
        name = f"dataloader{'' if i == 0 else f'_{i}'}.json"
        state = loader.state_dict() if hasattr(loader, "state_dict") else {}
        files[name] = _write_file(os.path.join(tmp, name), _write_bytes(json.dumps(state, sort_keys=True).encode()))
    for i, obj in enumerate(accelerator._custom_objects):
        name = f"custom_checkpoint_{i}.pkl"
        files[name] = _write_file(os.path.join(tmp, name), _torch_save(_to_cpu(obj.state_dict())))
    return files


def _to_cpu(state: Any) -> Any:
    """Device tensors (CUDA, XLA, ...) in a nested state dict moved to the CPU for saving."""
    from .nested import map_tensors

    return map_tensors(lambda t: t if t.device.type == "cpu" else t.detach().to("cpu"), state)


def _carry_over(final: str, tmp: str) -> None:
    """Main process: hard-link (or copy) entries of the checkpoint being replaced that
    save_state does not write itself (e.g. a tokenizer saved next to it) into the new one."""
    source = final if _read_manifest(final) is not None else _sibling(final, _OLD_SUFFIX)
    if not os.path.isdir(source) or _read_manifest(source) is None:
        return
    for entry in os.listdir(source):
        if _OWN_FILE_RE.match(entry) or os.path.lexists(os.path.join(tmp, entry)):
            continue
        src, dst = os.path.join(source, entry), os.path.join(tmp, entry)
        if os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, dst, copy_function=_link_or_copy, symlinks=True)
        else:
            _link_or_copy(src, dst)


def _commit(tmp: str, final: str) -> None:
    """Main process: put the complete ``tmp`` in place of ``final``. At every instant either
    ``final`` or one of its siblings is a complete checkpoint."""
    old = _sibling(final, _OLD_SUFFIX)
    if os.path.lexists(old):
        if _read_manifest(final) is not None:
            _rmtree(old)  # an earlier save finished renaming but not cleaning up
        elif os.path.lexists(final):
            _rmtree(final)  # broken: the complete previous checkpoint is `old`
    if os.path.lexists(final):
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))
    _rmtree(old)


def _apply_total_limit(root: str, limit: Optional[int]) -> None:
    """Main process: delete the oldest ``checkpoint_<n>`` (and leftovers of interrupted saves of
    them) until ``limit`` remain; the newest is always kept."""
    if limit is None:
        return
    keep = max(1, int(limit))
    indices = [i for i in _checkpoint_indices(root) if os.path.isdir(os.path.join(root, f"checkpoint_{i}"))]
    for i in indices[: max(0, len(indices) - keep)]:
        final = os.path.join(root, f"checkpoint_{i}")
        for path in (final, _sibling(final, _OLD_SUFFIX), _sibling(final, _TMP_SUFFIX)):
            _rmtree(path)


def save_state(accelerator: Any, output_dir: Any = None, safe_serialization: bool = True) -> str:
    """Write the whole training state of ``accelerator`` to ``output_dir`` atomically; return the
    directory. Collective: every process calls it (see the module docstring for who writes what).

    Without ``output_dir``, ``ProjectConfiguration(automatic_checkpoint_naming=True)`` picks
    ``project_dir/checkpoints/checkpoint_<n>`` and applies ``total_limit`` once the new checkpoint
    is in place.
    """
    from . import ops

    rng = get_rng_state()  # first, before anything could draw a random number
    config = accelerator.project_config
    main = accelerator.is_main_process
    automatic = output_dir is None
    if automatic:
        if not config.automatic_checkpoint_naming:
            raise ValueError("save_state() needs output_dir, or ProjectConfiguration(automatic_checkpoint_naming=True, "
                             "project_dir=...) to name checkpoints automatically")
        root = _checkpoint_root(config)
        index = max([int(config.iteration)] + [i + 1 for i in _checkpoint_indices(root)])
        if accelerator.num_processes > 1:
            index = int(ops.broadcast_object_list([index], from_process=0)[0])
        output_dir = os.path.join(root, f"checkpoint_{index}")
    final = os.path.abspath(os.fspath(output_dir))
    tmp = _sibling(final, _TMP_SUFFIX)
    if accelerator.gradient_state.micro_step != 0:
        warnings.warn("save_state is called in the middle of a gradient-accumulation group: the gradients "
                      "accumulated so far are not saved, so a run resumed from it differs; save after a sync step "
                      "(when accelerator.sync_gradients is True)", stacklevel=3)

    error: Optional[BaseException] = None
    if main:
        try:
            _prepare_tmp(final, tmp)
        except Exception as exc:  # noqa: BLE001 - reported on every process by _agree
            error = exc
    _agree(accelerator, error, None, "preparing the directory", final)

    files: Dict[str, int] = {}
    error = None
    try:
        if not os.path.isdir(tmp):
            raise CheckpointError(f"process {accelerator.process_index} cannot see {tmp}, which the main process "
                                  "created: output_dir must be on a filesystem shared by every process")
        models = list(accelerator._models)
        weights = [accelerator.get_state_dict(m) for m in models]
        for hook in accelerator._save_hooks:
            hook(models, weights, tmp)
        rank_file = f"random_states_{accelerator.process_index}.pkl"
        files[rank_file] = _write_file(os.path.join(tmp, rank_file), _torch_save(rng))
        if main:
            files.update(_write_shared_files(accelerator, tmp, weights, safe_serialization))
            num_models = len(weights)
    except Exception as exc:  # noqa: BLE001
        error = exc
    try:
        per_rank = _agree(accelerator, error, files, "writing files", final)
    except CheckpointError:
        if main:
            _rmtree(tmp)
        raise

    error = None
    if main:
        try:
            all_files: Dict[str, int] = {}
            for part in per_rank:
                all_files.update(part)
            manifest = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "anyaccel_version": _anyaccel_version(),
                "torch_version": torch.__version__,
                "world_size": accelerator.num_processes,
                "mixed_precision": accelerator.mixed_precision,
                "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
                "step": int(getattr(accelerator, "step", 0) or 0),
                "models": num_models,
                "optimizers": len(accelerator._optimizers),
                "schedulers": len(accelerator._schedulers),
                "dataloaders": len(accelerator._dataloaders),
                "custom_objects": len(accelerator._custom_objects),
                "scaler": accelerator.scaler is not None,
                "safe_serialization": bool(safe_serialization),
                "files": all_files,
            }
            _carry_over(final, tmp)
            data = json.dumps(manifest, indent=1, sort_keys=True).encode()
            _write_file(os.path.join(tmp, MANIFEST), _write_bytes(data))  # last: marks tmp complete
            _fsync_dir(tmp)
            _commit(tmp, final)
            if automatic:
                _apply_total_limit(os.path.dirname(final), config.total_limit)
        except Exception as exc:  # noqa: BLE001
            error = exc
    _agree(accelerator, error, None, "committing the checkpoint", final)
    if automatic:
        config.iteration = int(os.path.basename(final).rsplit("_", 1)[1]) + 1
    return final


def _anyaccel_version() -> str:
    try:
        from . import __version__

        return __version__
    except ImportError:  # pragma: no cover
        return "unknown"


# ------------------------------------------------------------------------------------------
# load_state
# ------------------------------------------------------------------------------------------


def _latest_checkpoint(config: ProjectConfiguration) -> Tuple[str, int]:
    root = _checkpoint_root(config)
    skipped = []
    for index in reversed(_checkpoint_indices(root)):
        path = os.path.join(root, f"checkpoint_{index}")
        try:
            resolve_checkpoint(path)
        except (CheckpointError, FileNotFoundError) as exc:
            skipped.append(str(exc))
            continue
        if skipped:
            warnings.warn("skipping incomplete checkpoints: " + " | ".join(skipped), stacklevel=4)
        return path, index
    raise FileNotFoundError(f"no complete checkpoint under {root}" + (": " + " | ".join(skipped) if skipped else ""))


def _check_counts(directory: str, manifest: dict, accelerator: Any, models: List[Any]) -> None:
    wanted = {
        "models": len(models),
        "optimizers": len(accelerator._optimizers),
        "schedulers": len(accelerator._schedulers),
        "dataloaders": len(accelerator._dataloaders),
        "custom_objects": len(accelerator._custom_objects),
    }
    wrong = [f"{kind}: checkpoint has {manifest.get(kind, 0)}, this Accelerator has {n}"
             for kind, n in wanted.items() if int(manifest.get(kind, 0)) != n]
    if wrong:
        raise CheckpointError(
            f"checkpoint {directory} does not match what was prepared ({'; '.join(wrong)}). Prepare (and "
            "register_for_checkpointing) the same objects in the same order as in the run that saved it, "
            "then call load_state"
        )


def load_state(accelerator: Any, input_dir: Any = None, strict: bool = True) -> str:
    """Restore what :func:`save_state` wrote into every prepared object, the RNG states of this
    process and the registered objects; return the directory loaded. Every process calls it (it
    only reads: no communication). Without ``input_dir``, loads the newest complete automatic
    checkpoint. Raises ``FileNotFoundError``/:class:`CheckpointError` naming the path and what is
    missing or does not match."""
    config = accelerator.project_config
    index = None
    if input_dir is None:
        if not config.automatic_checkpoint_naming:
            raise ValueError("load_state() needs input_dir, or ProjectConfiguration(automatic_checkpoint_naming=True, "
                             "project_dir=...) to find the newest checkpoint")
        input_dir, index = _latest_checkpoint(config)
    directory, manifest = resolve_checkpoint(input_dir)

    models = list(accelerator._models)
    for hook in accelerator._load_hooks:
        hook(models, directory)
    _check_counts(directory, manifest, accelerator, models)
    world = int(manifest.get("world_size", 1))
    if world != accelerator.num_processes:
        warnings.warn(f"checkpoint {directory} was saved by {world} processes and is loaded by "
                      f"{accelerator.num_processes}: loader positions are converted, RNG states of processes "
                      "without a saved state are left as they are; the run will not be bitwise identical",
                      stacklevel=3)

    for i, model in enumerate(models):
        state = _load_model_file(directory, i, manifest)
        try:
            accelerator.unwrap_model(model).load_state_dict(state, strict=strict)
        except RuntimeError as exc:
            raise CheckpointError(f"model {i} in {directory} does not fit the prepared model: {exc}") from exc
    for kind, objects in (("optimizer", accelerator._optimizers), ("scheduler", accelerator._schedulers)):
        for i, obj in enumerate(objects):
            path = os.path.join(directory, f"{kind}{'' if i == 0 else f'_{i}'}.bin")
            try:
                obj.load_state_dict(_torch_load(path))
            except (ValueError, KeyError) as exc:
                raise CheckpointError(f"{path} does not fit {kind} {i}: {exc}") from exc
    scaler_path = os.path.join(directory, "scaler.pt")
    if accelerator.scaler is not None:
        if os.path.exists(scaler_path):
            accelerator.scaler.load_state_dict(_torch_load(scaler_path))
        else:
            warnings.warn(f"{directory} has no gradient scaler state (saved without fp16); the scaler starts afresh",
                          stacklevel=3)
    for i, loader in enumerate(accelerator._dataloaders):
        path = os.path.join(directory, f"dataloader{'' if i == 0 else f'_{i}'}.json")
        with open(path, "r", encoding="utf-8") as fh:
            state = json.load(fh)
        if state and hasattr(loader, "load_state_dict"):
            loader.load_state_dict(state)
    for i, obj in enumerate(accelerator._custom_objects):
        obj.load_state_dict(_torch_load(os.path.join(directory, f"custom_checkpoint_{i}.pkl")))
    rng_path = os.path.join(directory, f"random_states_{accelerator.process_index}.pkl")
    if os.path.exists(rng_path):
        set_rng_state(_torch_load(rng_path))
    else:
        warnings.warn(f"{directory} has no RNG state for process {accelerator.process_index}; RNG states unchanged",
                      stacklevel=3)
    accelerator.step = int(manifest.get("step", 0))
    accelerator.gradient_state.reset()
    if index is not None:
        config.iteration = index + 1
    elif config.automatic_checkpoint_naming:
        match = _CHECKPOINT_RE.match(os.path.basename(os.path.abspath(os.fspath(input_dir))))
        if match:
            config.iteration = int(match.group(1)) + 1
    return directory


# ------------------------------------------------------------------------------------------
# save_model
# ------------------------------------------------------------------------------------------

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: Any) -> int:
    """Bytes in ``size``: an int, or a string like ``"10GB"`` (10**9) or ``"500MiB"`` (2**20)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(size))
    if not match or (match.group(2).upper() or "B") not in _UNITS:
        raise ValueError(f"max_shard_size={size!r} is not a size; use an int (bytes) or e.g. '10GB', '500MB', '2GiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper() or "B"])


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


def save_model(accelerator: Any, model: torch.nn.Module, save_directory: Any, max_shard_size: Any = "10GB",
               safe_serialization: bool = True) -> None:
    """Write the unwrapped model's weights to ``save_directory`` from the main process (other
    processes return at once; no barrier inside). Layout as Hugging Face's ``save_pretrained``:
    ``model.safetensors``, or above ``max_shard_size`` ``model-00001-of-0000N.safetensors`` plus
    ``model.safetensors.index.json`` (``pytorch_model*.bin`` with ``safe_serialization=False``).
    Each file is written atomically, the index after the shards; stale shards of an earlier save
    are removed last. Tied weights are stored once."""
    if not accelerator.is_main_process:
        return
    directory = os.path.abspath(os.fspath(save_directory))
    if os.path.isfile(directory):
        raise ValueError(f"save_model needs a directory; {directory} is a file")
    os.makedirs(directory, exist_ok=True)
    limit = parse_size(max_shard_size)
    tensors, aliases, extra = _split_state_dict(accelerator.get_state_dict(model))
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
        data = json.dumps(index, indent=2, sort_keys=True).encode()

        def write_index(tmp: str) -> None:
            with open(tmp, "wb") as fh:
                fh.write(data)

        _atomic_write(os.path.join(directory, index_name), write_index)
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

            save_file(shard, tmp, metadata=_metadata(aliases))
        else:
            _torch_save(shard)(tmp)

    _atomic_write(path, write)
