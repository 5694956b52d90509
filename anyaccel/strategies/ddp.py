"""DistributedDataParallel: every process holds the whole model; gradients are averaged in backward."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from .. import process_group
from .base import Strategy

__all__ = ["DDPStrategy"]


class DDPStrategy(Strategy):
    """``DistributedDataParallel`` over the default group, with the options of
    :class:`~anyaccel.kwargs.DistributedDataParallelKwargs`. Wrapping broadcasts rank 0's weights
    (collective); accumulation micro-steps run under ``no_sync``."""

    name = "ddp"

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from ..kwargs import DistributedDataParallelKwargs

        if isinstance(model, DistributedDataParallel):
            return model
        kwargs = self.handlers.get(DistributedDataParallelKwargs, DistributedDataParallelKwargs()).to_kwargs()
        device = self.backend.device
        if device is not None and device.index is not None:  # a single-device module on an accelerator
            kwargs.setdefault("device_ids", [device.index])
            kwargs.setdefault("output_device", device.index)
        wrapped = DistributedDataParallel(model, **kwargs)
        process_group.track_ddp(wrapped)
        return wrapped

    def sync_context(self, models: Sequence[torch.nn.Module], sync: bool) -> Any:
        if sync:
            return super().sync_context(models, sync)
        wrapped = [m for m in models if isinstance(m, DistributedDataParallel)]
        if len(wrapped) == 1:
            return wrapped[0].no_sync()
        return _all_no_sync(wrapped)


class _all_no_sync:
    """``no_sync`` of several DDP models at once (a plain class: cheap per micro-step)."""

    __slots__ = ("_models", "_stack")

    def __init__(self, models):
        self._models = models
        self._stack = None

    def __enter__(self):
        import contextlib

        self._stack = contextlib.ExitStack()
        for model in self._models:
            self._stack.enter_context(model.no_sync())
        return self

    def __exit__(self, *exc):
        stack, self._stack = self._stack, None
        return stack.__exit__(*exc)
