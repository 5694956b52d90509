"""Mixed precision: autocast for the forward pass; the fp16 gradient scaler comes from the backend.

Local to each process. ``"bf16"`` autocasts to bfloat16 and needs no scaler; ``"fp16"`` autocasts
to float16 and scales the loss with the backend's gradient scaler, whose overflow steps are
skipped by the optimizer wrapper (and the scheduler wrapper then does not step either). ``"fp8"``
autocasts to bfloat16 like ``"bf16"`` (Accelerate's rule) around linear layers converted to compute
in fp8 before the model is wrapped (:mod:`anyaccel.precision_fp8`). What a
device can run is the backend's call (:meth:`anyaccel.backends.base.Backend.check_precision`):
fp16 is refused on XLA, bf16 on GPUs without it, and fp16 on the CPU runs for real with a warning
that bf16 is usually faster there — nothing is switched behind the user's back.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, ContextManager, Optional

import torch

from . import optionspec
from .tree import map_tensors

__all__ = ["PRECISIONS", "normalize", "autocast_dtype", "autocast", "add_autocast", "remove_autocast", "AutocastForward", "convert_to_fp32"]

PRECISIONS = optionspec.PRECISIONS  # the choice list's one home: the option table


def normalize(value: Optional[str]) -> str:
    """The canonical name of a mixed-precision setting (``None``/``""``/``"fp32"`` → ``"no"``):
    the ``mixed_precision`` option's check. Raises ``ValueError`` naming the bad value and the
    allowed ones."""
    row = optionspec.option("mixed_precision")
    return str(optionspec.check(row, row.default if value is None else value, "mixed_precision"))


# the one map from a setting to a dtype; fp8's autocast (and FSDP2's compute dtype) is bf16, as Accelerate's
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


def autocast_dtype(precision: str) -> Optional[torch.dtype]:
    """The dtype layers compute in under ``precision`` (``None`` for ``"no"``: full precision;
    bfloat16 for ``"fp8"``, whose converted linear layers cast to fp8 themselves).
    The one home of that mapping (autocast, FSDP2's ``MixedPrecisionPolicy``, ``anyaccel test``)."""
    return _DTYPES.get(precision)


def autocast(device_type: str, precision: str, enabled: bool = True,
             cache_enabled: Optional[bool] = None) -> ContextManager[Any]:
    """The autocast context for ``precision`` on ``device_type`` (a null context for ``"no"``);
    ``enabled=False`` runs the block in full precision even inside another autocast block."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    kwargs = {} if cache_enabled is None else {"cache_enabled": cache_enabled}
    return torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled, **kwargs)


def convert_to_fp32(data: Any) -> Any:
    """Cast half/bfloat16 tensors in ``data`` (nested) back to float32, so losses and metrics
    computed outside the model are full precision."""
    return map_tensors(lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t, data)


def add_autocast(model: torch.nn.Module, device_type: str, precision: str) -> None:
    """Make ``model``'s forward run under autocast, with floating outputs cast back to float32
    (an :class:`AutocastForward` set on the instance; :func:`remove_autocast` undoes it). Local."""
    model.forward = AutocastForward(model.forward, device_type, precision)


def remove_autocast(model: torch.nn.Module) -> None:
    """Give ``model`` back the forward it had before :func:`add_autocast` (nothing to do for a
    model without one). Local."""
    forward = model.__dict__.get("forward")
    if isinstance(forward, AutocastForward):
        model.forward = forward.__wrapped__


class AutocastForward:
    """A model's ``forward`` run under autocast (what :func:`add_autocast` installs; the original
    stays reachable as ``__wrapped__``).

    A class rather than a closure so that a prepared model, and an ``Accelerator`` holding one,
    still pickle: it pickles as the original ``forward`` plus the settings (a bound ``forward``
    pickles as ``getattr(model, "forward")``, which on loading finds the class's method, since the
    model's own attributes are restored after it)."""

    def __init__(self, forward, device_type: str, precision: str, to_fp32: bool = True):
        functools.update_wrapper(self, forward)
        self.device_type, self.precision, self.to_fp32 = device_type, precision, to_fp32
        self._dtype = autocast_dtype(precision)

    def __call__(self, *args, **kwargs):
        with torch.autocast(device_type=self.device_type, dtype=self._dtype):
            out = self.__wrapped__(*args, **kwargs)
        return convert_to_fp32(out) if self.to_fp32 else out

    def __reduce__(self):
        return AutocastForward, (self.__wrapped__, self.device_type, self.precision, self.to_fp32)
