"""``load_checkpoint_in_model``: a checkpoint into a model, one tensor at a time, wherever its
layers live (a device, host memory, the offload folder on disk) or, for a sharded (FSDP2) model,
into each process's shards (:mod:`.sharded_load`).

Peak host memory is the largest tensor (plus the model's own resident tensors): the checkpoint is
never read whole. Weights mapped to disk that already sit in a safetensors file are not copied: the
offload index points at the file.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from .checkpoints import CheckpointReader, check_checkpoint, open_checkpoint
from .notices import no_effect
from .offload import check_writable, offload_weight, save_offload_index
from .placement import lookup_device, set_module_tensor_to_device
from .sharded_load import PENDING_ATTR, is_sharded, load_into_sharded

__all__ = ["load_checkpoint_in_model"]


def load_checkpoint_in_model(model: torch.nn.Module, checkpoint: Any, device_map: Optional[Dict[str, Any]] = None,
                             offload_folder: Optional[str] = None, dtype: Any = None, offload_state_dict: bool = False,
                             offload_buffers: bool = False, keep_in_fp32_modules: Optional[List[str]] = None,
                             offload_8bit_bnb: bool = False, strict: bool = False, full_state_dict: bool = True,
                             broadcast_from_rank0: bool = False) -> None:
    """Load ``checkpoint`` (a safetensors file, a Hugging Face directory with or without
    ``model.safetensors.index.json``, ``pytorch_model*.bin``, an anyaccel ``save_model``/
    ``save_state`` directory, a torch.distributed.checkpoint directory) into ``model``.

    * A model sharded by FSDP2 (after ``prepare``): Collective — every rank calls it and fills
      only its own shards, reading only their slices (``broadcast_from_rank0=True``: rank 0 reads
      each tensor and broadcasts it). ``device_map`` must be None.
    * Otherwise Local: each tensor goes to the device ``device_map`` gives its module (``"disk"``:
      into ``offload_folder``'s index), or stays where the model has it (a meta tensor goes to the
      CPU). ``dtype`` converts floating tensors, except in ``keep_in_fp32_modules``.

    Keys and shapes are checked before anything is loaded: wrong shapes always raise
    :class:`~anyaccel.errors.CheckpointError` naming them; missing keys raise when ``strict`` or
    when the tensor has no value yet (meta), else warn. ``offload_state_dict`` and
    ``full_state_dict=False`` are accepted and have no effect (loading is always one tensor, or one
    slice, at a time; a warning says so); ``offload_8bit_bnb`` is refused."""
    if offload_state_dict:
        no_effect("load_checkpoint_in_model", "offload_state_dict")
    if not full_state_dict:
        no_effect("load_checkpoint_in_model", "full_state_dict")
    if offload_8bit_bnb:
        raise ValueError("offload_8bit_bnb=True: anyaccel does not support bitsandbytes quantisation")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""))
    if is_sharded(model):
        if device_map is not None:
            raise ValueError("device_map is for a model placed by layers; this model is sharded (FSDP2): "
                             "call load_checkpoint_in_model(model, checkpoint) on every process")
        load_into_sharded(model, checkpoint, strict=strict, method="broadcast" if broadcast_from_rank0 else "slices")
        return
    _load_placed(model, checkpoint, dict(device_map or {}), offload_folder, dtype, offload_buffers,
                 tuple(keep_in_fp32_modules or ()), strict)


def _load_placed(model: torch.nn.Module, checkpoint: Any, devices: Dict[str, Any], offload_folder: Optional[str],
                 dtype: Any, offload_buffers: bool, fp32: Tuple[str, ...], strict: bool) -> None:
    """:func:`load_checkpoint_in_model` for a model placed by layers (not sharded): each tensor
    to its ``devices`` entry (``"disk"``: into ``offload_folder``'s index) or where it is. Local."""
    reader = checkpoint if isinstance(checkpoint, CheckpointReader) else open_checkpoint(checkpoint)
    if "disk" in devices.values():
        if offload_folder is None:
            raise ValueError("the device_map sends some weights to 'disk'; pass offload_folder= (a writable directory)")
        check_writable(offload_folder)
    on_meta = [k for k, v in model.state_dict(keep_vars=True).items() if v.is_meta
               and (not devices or lookup_device(devices, k) != "disk")]
    plan = check_checkpoint(model, reader, strict=strict, must_load=on_meta)
    index: Dict[str, Any] = {}
    buffers = {name for name, _ in model.named_buffers()}
    for key, src in plan.items():
        target = lookup_device(devices, key) if devices else None
        if target == "disk" and key in buffers and not offload_buffers:
            target = "cpu"  # buffers stay in memory unless offload_buffers (Accelerate's rule)
        want = torch.float32 if dtype is not None and _in_modules(key, fp32) else dtype
        if target == "disk":
            _to_disk(model, reader, key, src, want, offload_folder, index)
            continue
        if target is None:
            current = _current(model, key)
            target = "cpu" if current.is_meta else current.device
        set_module_tensor_to_device(model, key, target, value=reader.read(src), dtype=want)
    if index:
        save_offload_index(index, offload_folder)
    pending = model.__dict__.get(PENDING_ATTR)
    if pending:
        pending.difference_update(plan)


def _in_modules(key: str, prefixes: tuple) -> bool:
    return any(key == p or key.startswith(p + ".") or f".{p}." in f".{key}" for p in prefixes)


def _current(model: torch.nn.Module, key: str) -> torch.Tensor:
    owner, _, leaf = key.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    return module._parameters.get(leaf) if leaf in module._parameters else module._buffers[leaf]


def _to_disk(model: torch.nn.Module, reader: CheckpointReader, key: str, src: str, dtype: Any, folder: str,
             index: Dict[str, Any]) -> None:
    """Record where ``key`` lives on disk; the module's tensor goes to meta."""
    stored = reader.dtype(src)
    file = reader.file_of(src)
    if file is not None and (dtype is None or not stored.is_floating_point or dtype == stored):
        index[key] = {"safetensors_file": file, "weight_name": src, "dtype": str(stored).replace("torch.", ""),
                      "shape": list(reader.shape(src))}
    else:
        value = reader.read(src)
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        offload_weight(value, key, folder, index=index)
    set_module_tensor_to_device(model, key, "meta")
    os.makedirs(folder, exist_ok=True)
