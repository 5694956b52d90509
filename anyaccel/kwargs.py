"""Keyword-argument holders accepted by ``Accelerator(kwargs_handlers=[...])`` (Accelerate names)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Optional

__all__ = ["DistributedDataParallelKwargs", "GradScalerKwargs", "InitProcessGroupKwargs"]


@dataclasses.dataclass
class DistributedDataParallelKwargs:
    """Passed to ``torch.nn.parallel.DistributedDataParallel`` when a model is prepared."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False

    def to_kwargs(self) -> dict:
        """Only the values that differ from DDP's defaults (so deprecated names are not passed)."""
        default = type(self)()
        return {k: v for k, v in dataclasses.asdict(self).items() if getattr(default, k) != v}


@dataclasses.dataclass
class GradScalerKwargs:
    """Passed to ``torch.amp.GradScaler`` under ``mixed_precision="fp16"``."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    def to_kwargs(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class InitProcessGroupKwargs:
    """Process-group options: ``backend`` (``"gloo"``/``"nccl"``) and ``timeout``."""

    backend: Optional[str] = None
    timeout: Optional[timedelta] = None

    def to_kwargs(self) -> dict:
        return dataclasses.asdict(self)
