"""Run a model larger than memory: layers on devices, in host memory and on disk, each brought to
its execution device for its own forward (``dispatch_model``, ``cpu_offload``, ``disk_offload``,
``load_checkpoint_and_dispatch``; Accelerate's names and semantics).

Where each layer's weights live during inference:

* a device in the map (GPU index, ``"cpu"`` when the main device is the CPU): the layer stays
  there; its inputs are moved to it;
* ``"cpu"`` while the main device is a GPU: host memory; copied to the GPU for the layer's forward;
* ``"disk"``: the offload folder (raw ``.dat`` files, or read in place from the checkpoint's
  safetensors files); read for the layer's forward, dropped after it.

The main device is the first device of the map that is neither ``"cpu"`` nor ``"disk"`` (the CPU
when there is none). Every function here is local to the calling process.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch

from ..backends import accelerator_available, device_types, indexed_device_type
from ..environment.devices import device_facts
from .forward_hooks import AlignDevicesHook, add_hook_to_module
from .loading import load_checkpoint_in_model
from .notices import no_effect
from .offload import OffloadedWeightsLoader, PrefixedDataset, check_writable, offload_state_dict
from .placement import named_module_tensors, set_module_tensor_to_device
from .sizes import get_balanced_memory, infer_auto_device_map

__all__ = ["dispatch_model", "cpu_offload", "disk_offload", "load_checkpoint_and_dispatch", "check_device_map"]

_AUTO = ("auto", "balanced", "balanced_low_0", "sequential")


def _norm(device: Any) -> Any:
    if isinstance(device, torch.device):
        indexed = device.type in device_types() and device_facts(device.type).indexed
        return device.index if indexed and device.index is not None else str(device)
    return device


def _exec_device(device: Any) -> torch.device:
    return torch.device(f"{indexed_device_type()}:{device}" if isinstance(device, int) else device)


def _default_exec_device(execution_device: Any) -> torch.device:
    return _exec_device(execution_device if execution_device is not None else (0 if accelerator_available() else "cpu"))


def check_device_map(model: torch.nn.Module, device_map: Dict[str, Any]) -> None:
    """Raise ValueError naming the parameters ``device_map`` does not place."""
    names = [n for n, _ in model.named_parameters()]
    keys = list(device_map)
    if "" in keys:
        return
    missing = [n for n in names if not any(n == k or n.startswith(k + ".") for k in keys)]
    if missing:
        raise ValueError(f"the device_map does not place {len(missing)} parameters: {missing[:5]}; "
                         "map them (or one of their parent modules) to a device, 'cpu' or 'disk'")


def _main_device(device_map: Dict[str, Any]) -> Any:
    devices = [d for d in device_map.values() if d not in ("cpu", "disk")]
    return devices[0] if devices else "cpu"


def _offload_tree(module: torch.nn.Module, prefix: str, device: Any, weights: Any, offload_buffers: bool,
                  skip_keys: Optional[List[str]]) -> None:
    """An offloading hook on every submodule of ``module`` that holds tensors of its own."""
    for sub_name, sub in module.named_modules():
        own = list(named_module_tensors(sub, include_buffers=offload_buffers))
        if not own:
            if sub_name == "":
                add_hook_to_module(sub, AlignDevicesHook(execution_device=device, skip_keys=skip_keys), append=True)
            continue
        full = ".".join(p for p in (prefix, sub_name) if p)
        hook = AlignDevicesHook(execution_device=device, offload=True, offload_buffers=offload_buffers,
                                weights_map=PrefixedDataset(weights, f"{full}.") if weights is not None else None,
                                skip_keys=skip_keys)
        add_hook_to_module(sub, hook, append=True)


def dispatch_model(model: torch.nn.Module, device_map: Dict[str, Any], main_device: Any = None,
                   state_dict: Optional[Dict[str, torch.Tensor]] = None, offload_dir: Optional[str] = None,
                   offload_index: Optional[Dict[str, Any]] = None, offload_buffers: bool = False,
                   skip_keys: Optional[List[str]] = None, preload_module_classes: Optional[List[str]] = None,
                   force_hooks: bool = False) -> torch.nn.Module:
    """Place ``model`` by ``device_map`` (module name → GPU index, ``"cpu"``, ``"disk"``) and add
    the hooks that run each layer on its execution device. Weights mapped to ``"disk"`` come from
    ``offload_dir`` (written there by :func:`load_checkpoint_in_model`, or now from the model's own
    tensors). Returns the model; ``model.hf_device_map`` records the map.
    ``preload_module_classes`` is accepted and has no effect (each module loads its own tensors;
    a warning says so). Local (one process; no communication)."""
    if preload_module_classes:
        no_effect("dispatch_model", "preload_module_classes")
    device_map = {k: _norm(v) for k, v in device_map.items()}
    check_device_map(model, device_map)
    main = _norm(main_device) if main_device is not None else _main_device(device_map)
    disk = [n for n, d in device_map.items() if d == "disk"]
    if len(set(map(str, device_map.values()))) == 1 and not disk and not force_hooks:
        device = next(iter(device_map.values()))
        model.to(_exec_device(device))
        model.hf_device_map = dict(device_map)
        return model
    weights: Optional[OffloadedWeightsLoader] = None
    if disk:
        if offload_dir is None and offload_index is None:
            raise ValueError("the device_map sends modules to 'disk'; pass offload_dir= (a writable directory)")
        if offload_dir is not None:
            check_writable(offload_dir)
            kept = set() if offload_buffers else {n for n, _ in model.named_buffers()}  # buffers stay in memory
            still_here = {k: v for k, v in model.state_dict().items() if not v.is_meta and k not in kept
                          and any(k.startswith(n + ".") or n == "" for n in disk)}
            index_file = os.path.join(offload_dir, "index.json")
            if still_here and not (os.path.isfile(index_file) and set(still_here) <= set(_read_index(index_file))):
                offload_state_dict(offload_dir, still_here)
        weights = OffloadedWeightsLoader(state_dict=state_dict, save_folder=offload_dir, index=offload_index)
    cpu_offloaded = [n for n, d in device_map.items() if d == "cpu" and main != "cpu"]
    if cpu_offloaded and weights is None:
        host = {k: v.detach().to("cpu") for k, v in model.state_dict().items()
                if not v.is_meta and any(k.startswith(n + ".") or n == "" for n in cpu_offloaded)}
        weights = OffloadedWeightsLoader(state_dict={**(state_dict or {}), **host})
    elif cpu_offloaded:
        weights.state_dict.update({k: v.detach().to("cpu") for k, v in model.state_dict().items()
                                   if not v.is_meta and any(k.startswith(n + ".") for n in cpu_offloaded)})
        weights.all_keys = list(weights.state_dict) + [k for k in weights.index if k not in weights.state_dict]
    for name, device in device_map.items():
        if _is_tensor(model, name):  # a tensor split off its module by the map: kept on its execution device
            where = _exec_device(main if device == "disk" or name in cpu_offloaded else device)
            current = model.get_parameter(name) if name in dict(model.named_parameters()) else model.get_buffer(name)
            value = weights[name] if current.is_meta and weights is not None else None
            set_module_tensor_to_device(model, name, where, value=value)
            continue
        module = model.get_submodule(name) if name else model
        if device == "disk" or name in cpu_offloaded:
            _offload_tree(module, name, _exec_device(main), weights, offload_buffers, skip_keys)
        else:
            add_hook_to_module(module, AlignDevicesHook(execution_device=_exec_device(device), place_submodules=True,
                                                        skip_keys=skip_keys), append=True)
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True, skip_keys=skip_keys), append=True)
    model.hf_device_map = dict(device_map)
    return model


def _is_tensor(model: torch.nn.Module, name: str) -> bool:
    if not name:
        return False
    owner, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(owner) if owner else model
    except AttributeError:
        return False
    return leaf in module._parameters or leaf in module._buffers


def _read_index(path: str) -> Dict[str, Any]:
    import json

    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def cpu_offload(model: torch.nn.Module, execution_device: Any = None, offload_buffers: bool = False,
                state_dict: Optional[Dict[str, torch.Tensor]] = None,
                preload_module_classes: Optional[List[str]] = None) -> torch.nn.Module:
    """Keep every weight in host memory; each layer's weights go to ``execution_device`` (the
    first GPU, else the CPU) for its forward only. ``preload_module_classes`` has no effect (a
    warning says so). Local."""
    if preload_module_classes:
        no_effect("cpu_offload", "preload_module_classes")
    device = _default_exec_device(execution_device)
    weights = state_dict if state_dict is not None else {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    _offload_tree(model, "", device, weights, offload_buffers, None)
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    return model


def disk_offload(model: torch.nn.Module, offload_dir: str, execution_device: Any = None, offload_buffers: bool = False,
                 preload_module_classes: Optional[List[str]] = None) -> torch.nn.Module:
    """Write every weight to ``offload_dir`` (unless it already holds an offload index) and run
    each layer with its weights read from there for its forward only. ``preload_module_classes``
    has no effect (a warning says so). Local."""
    if preload_module_classes:
        no_effect("disk_offload", "preload_module_classes")
    check_writable(offload_dir)
    if not os.path.isfile(os.path.join(offload_dir, "index.json")):
        offload_state_dict(offload_dir, model.state_dict())
    device = _default_exec_device(execution_device)
    _offload_tree(model, "", device, OffloadedWeightsLoader(save_folder=offload_dir), offload_buffers, None)
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    return model


def load_checkpoint_and_dispatch(model: torch.nn.Module, checkpoint: Any, device_map: Any = None,
                                 max_memory: Optional[Dict[Any, Any]] = None,
                                 no_split_module_classes: Optional[List[str]] = None,
                                 offload_folder: Optional[str] = None, offload_buffers: bool = False, dtype: Any = None,
                                 offload_state_dict: Optional[bool] = None, skip_keys: Optional[List[str]] = None,
                                 preload_module_classes: Optional[List[str]] = None, force_hooks: bool = False,
                                 strict: bool = False, full_state_dict: bool = True,
                                 broadcast_from_rank0: bool = False) -> torch.nn.Module:
    """Load ``checkpoint`` into ``model`` (typically built under ``init_empty_weights``) one tensor
    at a time and dispatch it: ``device_map="auto"`` (or ``"balanced"``, ``"balanced_low_0"``,
    ``"sequential"``) fills the GPUs in order, then host memory, then ``offload_folder`` on disk,
    within ``max_memory``; a dict places modules yourself. Returns the model.
    ``offload_state_dict`` and ``preload_module_classes`` have no effect (a warning says so).
    Local (one process; no communication)."""
    if offload_state_dict:
        no_effect("load_checkpoint_and_dispatch", "offload_state_dict")
    if isinstance(device_map, str):
        if device_map not in _AUTO:
            raise ValueError(f"device_map={device_map!r}; use one of {list(_AUTO)} or a dict {{module name: device}}")
        if device_map != "sequential":
            max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split_module_classes,
                                             dtype=dtype, low_zero=device_map == "balanced_low_0")
        device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split_module_classes,
                                           dtype=dtype, offload_buffers=offload_buffers)
    load_checkpoint_in_model(model, checkpoint, device_map=device_map, offload_folder=offload_folder, dtype=dtype,
                             offload_buffers=offload_buffers, strict=strict, full_state_dict=full_state_dict,
                             broadcast_from_rank0=broadcast_from_rank0)
    if device_map is None:
        return model
    return dispatch_model(model, device_map=device_map, offload_dir=offload_folder, offload_buffers=offload_buffers,
                          skip_keys=skip_keys, preload_module_classes=preload_module_classes, force_hooks=force_hooks)
