"""Gradient accumulation and the "which loader is running" bookkeeping, per ``Accelerator``.

State is held by one :class:`GradientState` object per ``Accelerator`` (not a process-wide
singleton), so an evaluation loop run in the middle of a training epoch, or a second
``Accelerator``, cannot change what the training loop sees. Prepared data loaders push themselves
on its stack while they are being iterated; the innermost one answers ``end_of_dataloader``.
Everything here is local to a process; all ranks make the same decisions because they run the
same number of steps.
"""

from __future__ import annotations

import contextlib
from typing import Any, List, Optional

__all__ = ["GradientState", "sync_context"]


class GradientState:
    """Whether this micro-step synchronises gradients, and which loaders are being iterated."""

    def __init__(self, accumulation_steps: int = 1):
        if int(accumulation_steps) < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {accumulation_steps}")
        self.accumulation_steps = int(accumulation_steps)
        self.sync_gradients = True
        self.micro_step = 0
        self._loaders: List[Any] = []

    # ---- loaders --------------------------------------------------------------------------
    def push(self, loader: Any) -> None:
        self._loaders.append(loader)

    def pop(self, loader: Any) -> None:
        if loader in self._loaders:
            # remove the innermost occurrence
            idx = len(self._loaders) - 1 - self._loaders[::-1].index(loader)
            del self._loaders[idx]

    @property
    def active_loader(self) -> Optional[Any]:
        return self._loaders[-1] if self._loaders else None

    @property
    def end_of_dataloader(self) -> bool:
        loader = self.active_loader
        return bool(loader is not None and loader.end_of_dataloader)

    # ---- accumulation --------------------------------------------------------------------
    def next_micro_step(self) -> bool:
        """Advance one micro-step; return whether gradients synchronise on it (every
        ``accumulation_steps``-th micro-step, and always on a loader's last batch)."""
        if self.end_of_dataloader:
            self.micro_step = 0
            self.sync_gradients = True
        else:
            self.micro_step += 1
            self.sync_gradients = self.micro_step % self.accumulation_steps == 0
            if self.sync_gradients:
                self.micro_step = 0
        return self.sync_gradients


def sync_context(models, sync: bool):
    """``model.no_sync()`` for every DDP model when ``sync`` is False, else a null context."""
    if sync:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for model in models:
        no_sync = getattr(model, "no_sync", None)
        if no_sync is not None:
            stack.enter_context(no_sync())
    return stack
