"""NVIDIA GPUs through torch.cuda: one device per process (``local_rank`` modulo the visible
count), NCCL between them (gloo when several processes share one GPU)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

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
        """Every visible GPU's generator, and which of them is this process's own."""
        return {"device": torch.cuda.current_device(), "states": torch.cuda.get_rng_state_all()}

    @classmethod
    def set_rng_state(cls, state: Any) -> None:
        """This process's GPU takes the saving process's own GPU's state, whichever index each had:
        a checkpoint restored by the same rank puts every generator back, and rank 0's state
        adopted by rank r (``synchronize_rng_state("cuda")``) lands on ``cuda:r``, the one rank r
        draws from. The other GPUs' generators are set too when as many GPUs are visible."""
        if isinstance(state, dict):
            states, own = state["states"], state["device"]
        else:  # a list, from a checkpoint of an earlier version: whose device it was is not known
            states, own = state, min(torch.cuda.current_device(), len(state) - 1)
        if not states:
            return
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
        torch.cuda.set_rng_state(states[own])

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
        if precision in ("bf16", "fp8") and not torch.cuda.is_bf16_supported():  # fp8 autocasts the rest to bf16
            raise ValueError(f"mixed_precision={precision!r}: {torch.cuda.get_device_name(self.device)} does not "
                             "support bfloat16; use mixed_precision='fp16'")
        return precision

    def fp8_support(self) -> Tuple[str, str]:
        """fp8 matmuls (``torch._scaled_mm``) need compute capability 8.9+: L4, RTX 4090, H100, H200,
        B200 (and ROCm's MI300, which reports 9.4)."""
        major, minor = torch.cuda.get_device_capability(self.device)
        name = torch.cuda.get_device_name(self.device)
        if (major, minor) >= (8, 9):
            return "matmul", f"{name} (compute capability {major}.{minor})"
        return "none", f"{name} has compute capability {major}.{minor}; fp8 matmuls need 8.9 or newer (L4, H100, ...)"

    def memory_stats(self) -> Dict[str, int]:
        return {"allocated": torch.cuda.memory_allocated(self.device),
                "peak_allocated": torch.cuda.max_memory_allocated(self.device),
                "reserved": torch.cuda.memory_reserved(self.device)}

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)
