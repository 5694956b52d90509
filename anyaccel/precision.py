"""Mixed precision: autocast for the forward pass and a gradient scaler for fp16.

Local to each process. ``"bf16"`` autocasts to bfloat16 and needs no scaler; ``"fp16"`` autocasts
to float16 and scales the loss with :class:`torch.amp.GradScaler`, whose overflow steps are
skipped by the optimizer wrapper (and the scheduler wrapper then does not step either).

fp16 on the CPU is a documented choice, never a silent one: it runs real fp16 autocast with
``torch.amp.GradScaler("cpu")`` (PyTorch supports both), and :func:`check_precision` warns each
time it is selected that CPUs are usually faster in bf16. Nothing is switched behind your back.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Optional

import torch

from .nested import map_tensors

__all__ = ["PRECISIONS", "check_precision", "autocast_dtype", "autocast", "make_scaler", "wrap_forward", "convert_to_fp32"]

PRECISIONS = ("no", "fp16", "bf16")


def check_precision(value: Optional[str], device_type: str, warn: bool = True) -> str:
    """Validate ``value`` for ``device_type``; return the canonical name. Raises ValueError naming
    the bad value and the allowed ones. ``warn=False`` silences the CPU-fp16 advice (the
    ``Accelerator`` warns on the local main process only)."""
    value = "no" if value in (None, "", "fp32", "none") else str(value).lower()
    if value not in PRECISIONS:
        raise ValueError(f"mixed_precision={value!r} is not supported; choose one of {', '.join(PRECISIONS)}")
    if value == "fp16" and device_type == "xla":
        raise ValueError("mixed_precision='fp16' is not supported on XLA devices; use 'bf16'")
    if value == "bf16" and device_type == "cuda" and torch.cuda.is_available():
        if not torch.cuda.is_bf16_supported():
            raise ValueError("this GPU does not support bf16; use mixed_precision='fp16'")
    if value == "fp16" and device_type == "cpu" and warn:
        warnings.warn(
            "mixed_precision='fp16' on the CPU runs real fp16 autocast with a gradient scaler, but CPUs "
            "are usually faster in 'bf16' (no scaler needed).",
            stacklevel=3,
        )
    return value


def autocast_dtype(precision: str) -> Optional[torch.dtype]:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)


def autocast(device_type: str, precision: str, enabled: bool = True):
    """The autocast context for ``precision`` on ``device_type`` (a null context for ``"no"``)."""
    dtype = autocast_dtype(precision)
    if dtype is None or not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def make_scaler(device_type: str, precision: str, **kwargs: Any):
    """A GradScaler for fp16 on CUDA/CPU, else None."""
    if precision != "fp16" or device_type not in ("cuda", "cpu"):
        return None
    return torch.amp.GradScaler(device_type, **kwargs)


def convert_to_fp32(data: Any) -> Any:
    """Cast half/bfloat16 tensors in ``data`` (nested) back to float32, so losses and metrics
    computed outside the model are full precision."""
    return map_tensors(lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t, data)


def wrap_forward(forward, device_type: str, precision: str, to_fp32: bool = True):
    """Return ``forward`` running under autocast, with floating outputs cast back to float32.
    The original is kept as ``__wrapped__`` (``unwrap_model`` restores it)."""
    dtype = autocast_dtype(precision)

    @functools.wraps(forward)
    def forward_with_autocast(*args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=dtype):
            out = forward(*args, **kwargs)
        return convert_to_fp32(out) if to_fp32 else out

    forward_with_autocast._anyaccel_autocast = True  # type: ignore[attr-defined]
    return forward_with_autocast
