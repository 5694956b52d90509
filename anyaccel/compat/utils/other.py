"""``anyaccel.utils.other``: Accelerate's ``accelerate.utils.other`` names (saving, loading,
unwrapping and small helpers)."""

from __future__ import annotations

import functools
import platform
import re
import socket
import warnings
from typing import Any, List, Optional

import torch

from ... import ops
from ...precision import remove_autocast
from ._refuse import refused_names

__all__ = ["extract_model_from_parallel", "save", "load", "wait_for_everyone", "is_compiled_module",
           "has_compiled_regions", "model_has_dtensor", "get_module_children_bottom_up", "convert_bytes",
           "get_pretty_name", "merge_dicts", "recursive_getattr", "is_port_in_use", "check_os_kernel",
           "compile_regions", "compile_regions_deepspeed", "compile_regions_fsdp2", "write_basic_config",
           "get_model_tp_size", "clean_state_dict_for_safetensors"]


def extract_model_from_parallel(model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                                keep_torch_compile: bool = True, recursive: bool = False) -> torch.nn.Module:
    """The user's module inside DDP (and ``torch.compile``'s wrapper unless ``keep_torch_compile``).
    With ``keep_torch_compile=False`` a model compiled in place (by ``prepare``, or
    ``model.compile()``) comes back as a shallow copy that is not compiled and shares every
    parameter and buffer with ``model`` (which stays compiled), as ``_orig_mod`` does for
    ``torch.compile(model)``: ``torch.jit.trace`` and export work on it.
    ``keep_fp32_wrapper=False`` also removes the autocast forward that ``prepare`` added under
    mixed precision; ``recursive=True`` also replaces wrapped submodules by their inner module,
    in place. Local. Same as ``Accelerator.unwrap_model``.
    """
    from ...strategies.base import unwrap_module
    from ...strategies.compile import without_compile

    if not keep_fp32_wrapper:
        remove_autocast(model)
    model = unwrap_module(model, keep_torch_compile=keep_torch_compile)
    if recursive:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                inner = unwrap_module(child, keep_torch_compile=keep_torch_compile)
                if inner is not child:
                    setattr(parent, name, inner)
    return model if keep_torch_compile else without_compile(model)


def _local_rank() -> int:
    from ...environment import resolve_environment

    return resolve_environment().local_rank


def save(obj: Any, f: Any, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
    """Save ``obj`` to ``f`` atomically (temporary file + rename; safetensors with
    ``safe_serialization``) from the main process only — from each node's local main process with
    ``save_on_each_node``. The other ranks return at once (no barrier inside)."""
    from ...checkpoint import atomic_save

    if (_local_rank() if save_on_each_node else ops.rank()) == 0:
        atomic_save(obj, f, safe_serialization=safe_serialization)


def load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """``torch.load(f, map_location=..., weights_only=True)`` unless ``weights_only`` is given
    (Accelerate's default: only tensors and plain containers are unpickled). Local."""
    kwargs.setdefault("weights_only", True)
    return torch.load(f, map_location=map_location, **kwargs)


def wait_for_everyone() -> None:
    """Barrier: returns on each rank once every rank has called it. Collective."""
    ops.barrier()


def is_compiled_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper (``OptimizedModule``). Local."""
    dynamo = getattr(torch, "_dynamo", None)
    return dynamo is not None and isinstance(module, dynamo.eval_frame.OptimizedModule)


def has_compiled_regions(module: torch.nn.Module) -> bool:
    """Whether a submodule of ``module`` (itself included, when it has children) is compiled. Local."""
    return bool(module._modules) and any(is_compiled_module(m) for m in module.modules())


def model_has_dtensor(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is a ``DTensor`` (sharded by FSDP2 or TP). Local."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def get_module_children_bottom_up(model: torch.nn.Module, return_fqns: bool = False) -> List[Any]:
    """Every submodule of ``model`` (itself last), children before their parents, as Accelerate
    orders them; ``(qualified_name, module)`` pairs with ``return_fqns``. Local."""
    stack, ordered = [("", model)], []
    while stack:
        name, module = stack.pop()
        for child_name, child in module.named_children():
            stack.append((f"{name}.{child_name}" if name else child_name, child))
        ordered.append((name, module) if return_fqns else module)
    return ordered[::-1]


def convert_bytes(size: float) -> str:
    """``size`` bytes in the largest unit below 1024 (``"1.5 MB"``). Local."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def get_pretty_name(obj: Any) -> str:
    """``obj``'s qualified name (its class's, for an instance). Local."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or str(obj)


def merge_dicts(source: dict, destination: dict) -> dict:
    """Merge ``source`` into ``destination`` recursively (nested dicts merged, other values
    replaced) and return ``destination``. Local."""
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def recursive_getattr(obj: Any, attr: str) -> Any:
    """``getattr`` along a dotted path: ``recursive_getattr(model, "encoder.layer")``. Local."""
    return functools.reduce(getattr, [obj] + attr.split("."))


def is_port_in_use(port: Optional[int] = None) -> bool:
    """Whether something accepts connections on ``localhost:port`` (default 29500). Local."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("localhost", 29500 if port is None else port)) == 0


def check_os_kernel() -> None:
    """Warn when this Linux kernel is older than 5.5.0, where distributed jobs can hang
    (accelerate#1929). Local."""
    info = platform.uname()
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", info.release) if info.system == "Linux" else None
    if match and tuple(int(x) for x in match.groups()) < (5, 5, 0):
        warnings.warn(f"Detected kernel version {match.group(0)}, which is below the recommended minimum of 5.5.0; "
                      "this can cause the process to hang. Upgrade the kernel to 5.5.0 or higher.", stacklevel=2)


globals().update(refused_names("compile_regions", ["compile_regions", "compile_regions_fsdp2"]))
globals().update(refused_names("deepspeed", ["compile_regions_deepspeed"]))
globals().update(refused_names("write_basic_config", ["write_basic_config"]))
globals().update(refused_names("tp", ["get_model_tp_size"]))
globals().update(refused_names("big_model", ["clean_state_dict_for_safetensors"]))
