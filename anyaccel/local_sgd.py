"""Local SGD (``from anyaccel.local_sgd import LocalSGD``): Accelerate's helper, same semantics.

Each process takes ``local_sgd_steps`` optimizer steps on its own gradients (DDP's all-reduce is
switched off with ``no_sync``), then the processes average their parameters; they average once
more when the ``with`` block ends::

    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=8) as local_sgd:
        for batch in loader:
            ...
            optimizer.step()
            optimizer.zero_grad()
            local_sgd.step()

Averaging is ``all_reduce(sum) / world_size`` of every parameter, in place (the optimizer's
references stay valid), as Accelerate's ``accelerator.reduce(param, "mean")``; buffers (batch-norm
statistics) are not averaged, as in Accelerate (DDP broadcasts rank 0's at each forward). With one
process (``distributed_type`` ``NO``) the helper is disabled and only counts steps.

Supported where DDP wraps the model (CPU or GPU processes, ``strategy="ddp"``, Accelerate's
``MULTI_CPU``/``MULTI_GPU``/...); FSDP, N-D parallelism and XLA are refused with
``NotImplementedError``, as Accelerate refuses DeepSpeed and Megatron-LM.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Optional, Type

import torch

from . import ops
from .environment import DistributedType

__all__ = ["LocalSGD"]

# Accelerate's list: the data-parallel types where every process holds the whole model
_SUPPORTED = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.MULTI_XPU,
              DistributedType.MULTI_MLU, DistributedType.MULTI_HPU, DistributedType.MULTI_SDAA,
              DistributedType.MULTI_MUSA, DistributedType.MULTI_NPU, DistributedType.MULTI_NEURON}


class LocalSGD:
    """Run ``local_sgd_steps`` steps independently on each process, then average the parameters of
    ``model`` (a model returned by ``accelerator.prepare``) across processes.

    Args:
        accelerator: the :class:`~anyaccel.Accelerator` that prepared ``model``.
        model: the prepared model (``DistributedDataParallel`` in a multi-process job).
        local_sgd_steps: calls of :meth:`step` between two averagings (>= 1).
        enabled: ``False`` turns the helper into a step counter (gradients are all-reduced by DDP
            as usual). Always ``False`` with one process.

    Entering the ``with`` block enters ``model.no_sync()`` (local); :meth:`step` and leaving the
    block are collective when enabled: every process calls them the same number of times.
    """

    def __init__(self, accelerator: Any, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True):
        distributed_type = accelerator.distributed_type
        if distributed_type not in _SUPPORTED:
            raise NotImplementedError(
                f"LocalSGD averages whole models kept by every process; this job's distributed_type is "
                f"{getattr(distributed_type, 'value', distributed_type)} (strategy "
                f"{getattr(accelerator.strategy, 'name', '?')!r}). Use it with strategy='ddp' (the default for "
                "several CPU or GPU processes), or train without LocalSGD")
        self.enabled = bool(enabled) and distributed_type != DistributedType.NO
        self.num_steps = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        if self.enabled:
            if isinstance(local_sgd_steps, bool) or not isinstance(local_sgd_steps, int) or local_sgd_steps < 1:
                raise ValueError(f"LocalSGD(local_sgd_steps={local_sgd_steps!r}): must be an integer >= 1 (steps "
                                 "between two averagings)")
            if not callable(getattr(model, "no_sync", None)):
                raise NotImplementedError(
                    f"LocalSGD needs a model wrapped by DistributedDataParallel (it switches DDP's gradient "
                    f"all-reduce off with no_sync); got {type(model).__name__}. Pass the model returned by "
                    "accelerator.prepare in a job of several processes with strategy='ddp'")
        self._no_sync: Optional[Any] = None

    def __enter__(self) -> "LocalSGD":
        """Switch DDP's gradient all-reduce off for the block (when enabled). Local."""
        if self.enabled:
            self._no_sync = self.model.no_sync()  # type: ignore[operator]
            self._no_sync.__enter__()
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> Optional[bool]:
        """Average the parameters one last time (collective, when enabled), then leave ``no_sync``."""
        if not self.enabled:
            return None
        no_sync, self._no_sync = self._no_sync, None
        try:
            if exc_type is None:  # a failing block is not averaged: its peers may not be here to meet
                self._sync_and_avg_model_params()
        finally:
            if no_sync is not None:
                no_sync.__exit__(exc_type, exc, tb)
        return None

    def step(self) -> None:
        """Count one step; every ``local_sgd_steps``-th averages the parameters across processes
        (collective then, when enabled)."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._sync_and_avg_model_params()

    @torch.no_grad()
    def _sync_and_avg_model_params(self) -> None:
        """Every parameter becomes the mean over processes, in place. Collective."""
        params = [p for p in self.model.parameters()]
        if not params:
            return
        averaged = ops.reduce([p.detach() for p in params], "mean")
        for param, mean in zip(params, averaged):
            param.copy_(mean)
