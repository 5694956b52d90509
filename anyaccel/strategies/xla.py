"""XLA replicas: every replica holds the whole model; gradients are averaged just before the
optimizer step (``xm.optimizer_step`` semantics), not during backward."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

from .base import Strategy

__all__ = ["XlaReplicaStrategy"]


class XlaReplicaStrategy(Strategy):
    """torch-xla owns the replicas (no torch.distributed group). The backend's ``move_model``
    already made every replica start from replica 0's weights; here, the prepared optimizer
    averages gradients over replicas before each real step, and clipping averages them first
    (the step then does not average twice). Both are collective over replicas and do nothing for
    one replica."""

    name = "xla"

    def before_optimizer_step(self) -> Optional[Callable[[torch.optim.Optimizer], None]]:
        from ..backends import xla

        return xla.reduce_gradients

    def before_clipping(self, optimizers: Iterable[Any]) -> None:
        from ..backends import xla

        for optimizer in optimizers:
            xla.reduce_gradients_early(optimizer)
