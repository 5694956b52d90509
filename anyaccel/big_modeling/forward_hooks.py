"""Forward hooks that run a layer whose weights live elsewhere: Accelerate's ``ModelHook`` API
(``add_hook_to_module`` replaces ``module.forward`` with one that calls the hook around the
original, keeping ``_hf_hook``/``_old_forward`` so transformers and diffusers recognise it) and
``AlignDevicesHook``, which moves the inputs to the layer's execution device and, for an
offloaded layer, brings its weights from host memory or disk just before its forward and drops
them (back to meta) just after. All local to the calling process.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..environment.devices import send_to_device
from .placement import find_device, named_module_tensors, set_module_tensor_to_device

__all__ = ["ModelHook", "SequentialHook", "AlignDevicesHook", "add_hook_to_module", "remove_hook_from_module",
           "remove_hook_from_submodules"]


class ModelHook:
    """Callbacks around a module's forward. ``no_grad``: run the forward under ``torch.no_grad``."""

    no_grad = False

    def init_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Tuple[Any, Dict[str, Any]]:
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        return output

    def detach_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        return module


class SequentialHook(ModelHook):
    """Several hooks, applied in order (post_forward too)."""

    def __init__(self, *hooks: ModelHook):
        self.hooks = hooks

    def init_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Tuple[Any, Dict[str, Any]]:
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module


def add_hook_to_module(module: torch.nn.Module, hook: ModelHook, append: bool = False) -> torch.nn.Module:
    """Run ``hook`` around ``module``'s forward (replacing an existing hook, or chained after it
    with ``append``). Returns the module."""
    if append and getattr(module, "_hf_hook", None) is not None:
        old = module._hf_hook
        remove_hook_from_module(module)
        hook = SequentialHook(old, hook)
    if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward"):
        old_forward = module._old_forward
    else:
        old_forward = module.forward
        module._old_forward = old_forward
    module = hook.init_hook(module)
    module._hf_hook = hook

    def new_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = module._hf_hook.pre_forward(module, *args, **kwargs)
        if module._hf_hook.no_grad:
            with torch.no_grad():
                output = module._old_forward(*args, **kwargs)
        else:
            output = module._old_forward(*args, **kwargs)
        return module._hf_hook.post_forward(module, output)

    forward = functools.update_wrapper(functools.partial(new_forward, module), old_forward)
    if "GraphModuleImpl" in str(type(module)):
        module.__class__.forward = forward
    else:
        module.forward = forward
    return module


def remove_hook_from_module(module: torch.nn.Module, recurse: bool = False) -> torch.nn.Module:
    """Undo :func:`add_hook_to_module` (on every submodule too with ``recurse``)."""
    if hasattr(module, "_hf_hook"):
        module._hf_hook.detach_hook(module)
        delattr(module, "_hf_hook")
    if hasattr(module, "_old_forward"):
        if "GraphModuleImpl" in str(type(module)):
            module.__class__.forward = module._old_forward
        else:
            module.forward = module._old_forward
        delattr(module, "_old_forward")
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse)
    return module


def remove_hook_from_submodules(module: torch.nn.Module) -> None:
    """Remove the hooks of ``module`` and all its submodules."""
    remove_hook_from_module(module, recurse=True)


def _send(data: Any, device: Any, skip_keys: Optional[List[str]]) -> Any:
    if skip_keys and isinstance(data, dict):
        return {k: v if k in skip_keys else send_to_device(v, device) for k, v in data.items()}
    return send_to_device(data, device)


class AlignDevicesHook(ModelHook):
    """Inputs to ``execution_device`` before the forward (outputs back to the input's device with
    ``io_same_device``). With ``offload``: the module's tensors (its own, or its whole subtree with
    ``place_submodules``; buffers too with ``offload_buffers``) are kept in ``weights_map`` (the
    current values in host memory when not given) and put on meta; each forward loads them onto
    ``execution_device`` and drops them afterwards."""

    def __init__(self, execution_device: Any = None, offload: bool = False, io_same_device: bool = False,
                 weights_map: Optional[Mapping] = None, offload_buffers: bool = False, place_submodules: bool = False,
                 skip_keys: Optional[List[str]] = None, tied_params_map: Any = None):
        self.execution_device = execution_device
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = skip_keys
        self.input_device = None
        self._offloaded: List[str] = []

    def __repr__(self) -> str:
        return (f"AlignDevicesHook(execution_device={self.execution_device}, offload={self.offload}, "
                f"io_same_device={self.io_same_device}, offload_buffers={self.offload_buffers}, "
                f"place_submodules={self.place_submodules})")

    def _tensors(self, module: torch.nn.Module, buffers: bool) -> List[Tuple[str, torch.Tensor]]:
        return list(named_module_tensors(module, include_buffers=buffers, recurse=self.place_submodules))

    def init_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        if not self.offload:
            if self.execution_device is not None:
                for name, tensor in self._tensors(module, True):
                    if not tensor.is_meta:
                        set_module_tensor_to_device(module, name, self.execution_device)
            return module
        tensors = self._tensors(module, self.offload_buffers)
        if self.weights_map is None:
            self.weights_map = {name: t.detach().to("cpu") for name, t in tensors if not t.is_meta}
        missing = [name for name, t in tensors if t.is_meta and name not in self.weights_map]
        if missing:
            raise ValueError(f"{module.__class__.__name__}: tensors {missing[:5]} are on meta and not in the offloaded "
                             "weights; load the checkpoint first (load_checkpoint_and_dispatch)")
        self._offloaded = [name for name, _ in tensors if name in self.weights_map]
        for name in self._offloaded:
            set_module_tensor_to_device(module, name, "meta")
        if not self.offload_buffers and self.execution_device is not None:
            for name, buf in module.named_buffers(recurse=self.place_submodules):
                if not buf.is_meta:
                    set_module_tensor_to_device(module, name, self.execution_device)
        return module

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Tuple[Any, Dict[str, Any]]:
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        if self.offload:
            device = self.execution_device if self.execution_device is not None else "cpu"
            for name in self._offloaded:
                set_module_tensor_to_device(module, name, device, value=self.weights_map[name])
        if self.execution_device is None:
            return args, kwargs
        return _send(args, self.execution_device, None), _send(kwargs, self.execution_device, self.skip_keys)

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        if self.offload:
            for name in self._offloaded:
                set_module_tensor_to_device(module, name, "meta")
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device)
        return output

    def detach_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.offload and self.weights_map is not None:
            for name in self._offloaded:  # the weights come back into the module, where they were
                set_module_tensor_to_device(module, name, "cpu", value=self.weights_map[name])
        return module
