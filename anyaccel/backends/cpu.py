"""The CPU: every machine has one; collectives over gloo."""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Tuple

from .base import Backend

__all__ = ["CpuBackend"]


class CpuBackend(Backend):
    """Batches are used where the loader made them (no copy); fp16 runs real fp16 autocast with a
    gradient scaler, with a warning that bf16 is usually faster on CPUs (nothing is switched
    behind the user's back)."""

    device_type = "cpu"
    autocast_device_type = "cpu"

    def feed(self, batches: Iterable[Any]) -> Iterable[Any]:
        return batches

    def fp8_support(self) -> Tuple[str, str]:
        """The CPU has no fp8 matmul: fp8 is torchao's emulation, for testing."""
        return "emulate", "the CPU has no fp8 matmul"

    def check_precision(self, precision: str, warn: bool = True) -> str:
        precision = super().check_precision(precision, warn)
        if precision == "fp16" and warn:
            warnings.warn(
                "mixed_precision='fp16' on the CPU runs real fp16 autocast with a gradient scaler, but CPUs "
                "are usually faster in 'bf16' (no scaler needed).",
                stacklevel=4,
            )
        return precision
