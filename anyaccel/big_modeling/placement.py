"""Move one named tensor of a module between devices (meta included): the primitive under
loading, dispatch and the offload hooks. Local to the calling process."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Union

import torch

__all__ = ["set_module_tensor_to_device", "named_module_tensors", "find_device", "lookup_device"]

Device = Union[int, str, torch.device]


def _owner(module: torch.nn.Module, name: str) -> Tuple[torch.nn.Module, str]:
    if "." in name:
        path, leaf = name.rsplit(".", 1)
        try:
            return module.get_submodule(path), leaf
        except AttributeError:
            raise ValueError(f"{module.__class__.__name__} has no submodule {path!r} (for tensor {name!r})") from None
    return module, name


def set_module_tensor_to_device(module: torch.nn.Module, tensor_name: str, device: Device, value: Optional[torch.Tensor] = None,
                                dtype: Optional[torch.dtype] = None, fp16_statistics: Any = None,
                                tied_params_map: Optional[Dict[int, Dict[Any, torch.Tensor]]] = None,
                                non_blocking: bool = False, clear_cache: bool = True) -> None:
    """Put parameter or buffer ``tensor_name`` of ``module`` on ``device``, with the data of
    ``value`` when given (converted to ``dtype``, or to the current dtype for floating tensors),
    keeping the parameter's class and ``requires_grad``. Accelerate's function and arguments:
    ``non_blocking`` is passed to the copy; ``clear_cache`` (Accelerate empties the device cache
    after each move) has nothing to do here, as no temporary device copy is made; ``tied_params_map``
    is a cache Accelerate fills for tied weights (anyaccel moves each tensor once, so it is not
    needed); ``fp16_statistics`` (bitsandbytes 8-bit weights) is refused. Local."""
    if fp16_statistics is not None:
        raise NotImplementedError("set_module_tensor_to_device: fp16_statistics is for bitsandbytes 8-bit weights, "
                                  "which anyaccel does not load; quantize with bitsandbytes or torchao directly")
    owner, leaf = _owner(module, tensor_name)
    if leaf not in owner._parameters and leaf not in owner._buffers:
        raise ValueError(f"{module.__class__.__name__} has no parameter or buffer {tensor_name!r}")
    is_buffer = leaf in owner._buffers
    old = owner._buffers[leaf] if is_buffer else owner._parameters[leaf]
    if old is None:
        return
    if value is None and old.is_meta and str(device) != "meta":
        raise ValueError(f"{tensor_name} is on the meta device (it has no data); pass value= to give it one")
    if value is not None and tuple(value.shape) != tuple(old.shape):
        raise ValueError(f"{tensor_name}: value of shape {list(value.shape)} for a tensor of shape {list(old.shape)}")
    source = old if value is None else value
    if dtype is not None and source.is_floating_point():
        target_dtype = dtype
    elif value is not None and value.is_floating_point() and old.is_floating_point():
        target_dtype = old.dtype
    else:
        target_dtype = source.dtype
    device = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    with torch.no_grad():
        new = source.to(device=device, dtype=target_dtype, non_blocking=non_blocking)
        if is_buffer:
            owner._buffers[leaf] = new
        else:
            kwargs = {k: v for k, v in old.__dict__.items() if k != "_is_hf_initialized"}
            param = type(old)(new, requires_grad=old.requires_grad) if type(old) is torch.nn.Parameter \
                else type(old)(new, requires_grad=old.requires_grad, **kwargs)
            owner._parameters[leaf] = param


def named_module_tensors(module: torch.nn.Module, include_buffers: bool = True, recurse: bool = False,
                         remove_non_persistent: bool = False):
    """``(name, tensor)`` for the parameters (and buffers) of ``module``. Local."""
    yield from module.named_parameters(recurse=recurse)
    if include_buffers:
        skip = set()
        if remove_non_persistent:
            for prefix, m in (module.named_modules() if recurse else [("", module)]):
                skip |= {f"{prefix}.{n}" if prefix else n for n in m._non_persistent_buffers_set}
        for name, buf in module.named_buffers(recurse=recurse):
            if name not in skip:
                yield name, buf


def find_device(data: Any) -> Optional[torch.device]:
    """The device of the first tensor in nested ``data``. Local."""
    if isinstance(data, torch.Tensor):
        return data.device
    if isinstance(data, dict):
        data = list(data.values())
    if isinstance(data, (list, tuple)):
        for item in data:
            found = find_device(item)
            if found is not None:
                return found
    return None


def lookup_device(device_map: Dict[str, Any], name: str) -> Any:
    """The device ``device_map`` gives tensor or module ``name`` (the longest matching prefix)."""
    probe = name
    while True:
        if probe in device_map:
            return device_map[probe]
        if not probe:
            raise ValueError(f"the device_map does not place {name!r}; give it (or one of its parents) a device")
        probe = probe.rsplit(".", 1)[0] if "." in probe else ""
