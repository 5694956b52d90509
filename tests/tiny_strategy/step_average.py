"""Every process holds the whole model; gradients are averaged once per optimizer step, just
before it (no hooks in backward, so accumulation micro-steps never communicate).

The whole of a strategy outside anyaccel: its options, its class, and (in the package's metadata
or with ``register_strategy``) one registration line.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from anyaccel.strategies.base import Strategy
from anyaccel.strategies.options import StrategyOptions

#: the one line ``register_strategy(..., summary=SUMMARY)`` shows in --help and ``anyaccel config``
SUMMARY = "a full copy per process, gradients averaged before each optimizer step"


@dataclasses.dataclass(frozen=True)
class StepAverageOptions(StrategyOptions):
    """``average``: divide the summed gradients by the number of processes (else keep the sum)."""

    strategy = "stepavg"
    average: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.average, bool):
            raise ValueError(f"StepAverageOptions(average={self.average!r}): must be True or False")


class StepAverageStrategy(Strategy):
    """Whole model per process; gradients all-reduced before each optimizer step (collective)."""

    name = "stepavg"
    options_type = StepAverageOptions

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Every rank starts from rank 0's weights (collective); no wrapper module, so the
        state dict keeps the user's names."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            with torch.no_grad():
                for tensor in list(model.parameters()) + list(model.buffers()):
                    dist.broadcast(tensor.data, src=0)
        return model

    def before_optimizer_step(self) -> Optional[Callable[[torch.optim.Optimizer], None]]:
        return self._reduce

    def before_clipping(self, optimizers: Iterable[Any]) -> None:
        for optimizer in optimizers:  # clip the averaged gradients; the step then does not reduce again
            self._reduce(optimizer)
            optimizer._stepavg_reduced = True

    def _reduce(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer.__dict__.pop("_stepavg_reduced", False) or not dist.is_initialized():
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    if self.options.average:
                        p.grad /= dist.get_world_size()
