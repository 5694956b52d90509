"""Apple silicon GPUs through torch.mps (one process: MPS has no multi-process backend)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from .base import Backend

__all__ = ["MpsBackend"]


class MpsBackend(Backend):
    device_type = "mps"
    autocast_device_type = "mps"

    @classmethod
    def get_rng_state(cls) -> Optional[Any]:
        return torch.mps.get_rng_state()

    @classmethod
    def set_rng_state(cls, state: Any) -> None:
        torch.mps.set_rng_state(state)

    @classmethod
    def manual_seed(cls, seed: int) -> None:
        torch.mps.manual_seed(seed)

    @classmethod
    def empty_cache(cls) -> None:
        torch.mps.empty_cache()

    def make_scaler(self, precision: str, **kwargs: Any) -> Optional[torch.amp.GradScaler]:
        try:
            return super().make_scaler(precision, **kwargs)
        except (RuntimeError, ValueError):  # a torch without an MPS gradient scaler: fp16 runs unscaled
            return None

    def synchronize(self) -> None:
        torch.mps.synchronize()

    def memory_stats(self) -> Dict[str, int]:
        return {"allocated": torch.mps.current_allocated_memory(),
                "reserved": torch.mps.driver_allocated_memory()}
