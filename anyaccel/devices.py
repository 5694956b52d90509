"""Which devices exist, asked without side effects, and moving nested data onto a device.

The probes here never create a CUDA context: ``torch.cuda.device_count()`` asks NVML when it can
and does not poison a later ``fork`` (the notebook launcher forks). ``CUDA_VISIBLE_DEVICES`` is
honoured because it is what ``device_count`` sees. They are the *detection* half of a device: the
environment uses them to choose the device type, and the backend registry
(:mod:`anyaccel.backends`) to know whose runtime is started.
"""

from __future__ import annotations

from typing import Any

import torch

from .tree import map_tensors

__all__ = ["cuda_device_count", "mps_available", "cuda_initialized", "send_to_device"]


def cuda_device_count() -> int:
    """Number of visible CUDA devices (0 on CPU-only builds). Does not initialise CUDA."""
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def cuda_initialized() -> bool:
    """True when this process already created a CUDA context (a fork would then be unsafe)."""
    return bool(getattr(torch.cuda, "is_initialized", lambda: False)())


def mps_available() -> bool:
    """True on Apple silicon with a PyTorch build that supports the MPS device."""
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def send_to_device(data: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor inside ``data`` (tensors, lists, tuples, namedtuples, dicts) to ``device``;
    objects with their own ``.to`` (e.g. Hugging Face ``BatchEncoding``) are moved with it. Local
    to the calling process; other objects are returned untouched."""
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=non_blocking)
    to = getattr(data, "to", None)
    if callable(to) and not isinstance(data, (dict, list, tuple, type)):
        try:
            return to(device)
        except TypeError:
            return data
    return map_tensors(lambda t: t.to(device, non_blocking=non_blocking), data)
