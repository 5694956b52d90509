"""NVIDIA GPUs through torch.cuda: one device per process (``local_rank`` modulo the visible
count), NCCL between them (gloo when several processes share one GPU)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from .base import Backend

__all__ = ["CudaBackend"]


class CudaBackend(Backend):
    """``set_device`` once at setup, so that NCCL, ``torch.cuda.*`` calls without an index and
    ``.cuda()`` in user code all use this process's GPU."""

    device_type = "cuda"
    autocast_device_type = "cuda"

    @classmethod
    def get_rng_state(cls) -> Optional[Any]:
        return torch.cuda.get_rng_state_all()

    @classmethod
    def set_rng_state(cls, state: Any) -> None:
        if len(state) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state)
        elif state:  # saved with another number of visible GPUs: this process's own device
            torch.cuda.set_rng_state(state[min(torch.cuda.current_device(), len(state) - 1)])

    @classmethod
    def manual_seed(cls, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    @classmethod
    def empty_cache(cls) -> None:
        torch.cuda.empty_cache()

    def setup(self) -> torch.device:
        index = self.env.device_index or 0
        torch.cuda.set_device(index)
        self.device = torch.device("cuda", index)
        return self.device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def check_precision(self, precision: str, warn: bool = True) -> str:
        precision = super().check_precision(precision, warn)
        if precision == "bf16" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"mixed_precision='bf16': {torch.cuda.get_device_name(self.device)} does not support "
                             "bfloat16; use mixed_precision='fp16'")
        return precision

    def memory_stats(self) -> Dict[str, int]:
        return {"allocated": torch.cuda.memory_allocated(self.device),
                "peak_allocated": torch.cuda.max_memory_allocated(self.device),
                "reserved": torch.cuda.memory_reserved(self.device)}

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)
