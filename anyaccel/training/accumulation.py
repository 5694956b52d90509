"""Gradient accumulation and the "which loader is running" bookkeeping, per ``Accelerator``.

State is held by one :class:`GradientState` object per ``Accelerator`` (not a process-wide
singleton), so an evaluation loop run in the middle of a training epoch, or a second
``Accelerator``, cannot change what the training loop sees. Prepared data loaders push themselves
on its stack while they are being iterated; the innermost one answers ``end_of_dataloader``.

Accumulation groups: with ``accumulation_steps = k`` the micro-steps of an epoch are cut into
groups of ``k``; the last micro-step of a group synchronises gradients (DDP all-reduce, optimizer
and scheduler step). The last batch of a loader always closes its group, so a group never spans
two epochs. When the loader's length is known, a short final group (say 2 micro-batches with
``k = 4``) divides the loss by its real size (2), not by ``k``: every optimizer step then sees the
*mean* gradient of the batches it covers, exactly as one large batch would.

Everything here is local to a process; all ranks make the same decisions because they run the
same number of steps.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

from .. import lazyclass

__all__ = ["AccumulationOptions", "GradientState", "AccumulateContext"]


@lazyclass.dataclass(frozen=True, kw_only=True)
class AccumulationOptions:
    """How an ``Accelerator`` accumulates gradients, besides how many micro-steps
    (``AcceleratorOptions.gradient_accumulation_steps``): ``sync_with_dataloader`` (a loader's last
    batch closes the group), ``sync_each_batch`` (all-reduce on every micro-batch, no ``no_sync``)
    and ``divide_by_group_size`` (``backward`` divides the loss by the current group's real size,
    else by the number of steps). Accelerate's ``GradientAccumulationPlugin`` converts into it
    (``to_options()``). Local; frozen."""

    sync_with_dataloader: bool = True
    sync_each_batch: bool = False
    divide_by_group_size: bool = True


class GradientState:
    """Whether this micro-step synchronises gradients, and which loaders are being iterated."""

    def __init__(self, accumulation_steps: int = 1, sync_with_dataloader: bool = True, sync_each_batch: bool = False):
        if int(accumulation_steps) < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {accumulation_steps}")
        self.accumulation_steps = int(accumulation_steps)
        self.sync_with_dataloader = bool(sync_with_dataloader)  # a loader's last batch closes its group
        self.sync_each_batch = bool(sync_each_batch)  # all-reduce on every micro-step (optimizer still every k)
        self.sync_gradients = True
        self.micro_step = 0  # micro-steps already taken in the current group
        self._group_size: Optional[int] = None  # size of the current group, fixed at its first micro-step
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
    def active_dataloader(self) -> Optional[Any]:
        """The prepared loader being iterated (innermost), or None (Accelerate's name)."""
        return self.active_loader

    @property
    def in_dataloader(self) -> bool:
        return bool(self._loaders)

    @property
    def num_steps(self) -> int:
        return self.accumulation_steps

    @property
    def adjust_scheduler(self) -> bool:
        """Always False, whatever ``GradientAccumulationPlugin(adjust_scheduler=...)`` says: what
        Accelerate 1.15's ``GradientState.adjust_scheduler`` answers too, because it reads the flag
        from the plugin's ``to_kwargs()``, which leaves out the default ``True``, and falls back to
        ``False`` (see :class:`~anyaccel.utils.GradientAccumulationPlugin`). Local."""
        return False

    @classmethod
    def _reset_state(cls) -> None:
        """Nothing to reset: each ``Accelerator`` has its own state (Accelerate's scripts call this
        to clear its process-wide singleton between runs)."""

    @property
    def end_of_dataloader(self) -> bool:
        loader = self.active_loader
        return bool(loader is not None and loader.end_of_dataloader)

    # ---- accumulation --------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        """How many micro-batches the current accumulation group holds: ``accumulation_steps``,
        or fewer for the last group of a loader whose length is known. :meth:`Accelerator.backward`
        divides the loss by it."""
        return self._group_size or self.accumulation_steps

    def _remaining_batches(self) -> Optional[int]:
        """Batches left in the active loader, the one just yielded included (None if unknown)."""
        loader = self.active_loader
        if loader is None:
            return None
        try:
            total = len(loader)
            position = int(loader.position)
        except (TypeError, AttributeError, NotImplementedError):
            return None
        return max(1, total - position + 1)

    def next_micro_step(self) -> bool:
        """Advance one micro-step; return whether gradients synchronise on it: the last
        micro-step of each group of ``accumulation_steps``, and always a loader's last batch."""
        k = self.accumulation_steps
        if self.micro_step == 0:
            remaining = self._remaining_batches() if k > 1 and self.sync_with_dataloader else None
            self._group_size = min(k, remaining) if remaining is not None else k
        self.micro_step += 1
        self.sync_gradients = self.micro_step >= self._group_size or (self.sync_with_dataloader and self.end_of_dataloader)
        if self.sync_gradients:
            self.micro_step = 0
        return self.sync_gradients

    def reset(self) -> None:
        """Forget a partly accumulated group (the next micro-step starts a new one)."""
        self.micro_step = 0
        self._group_size = None
        self.sync_gradients = True


class AccumulateContext:
    """What ``Accelerator.accumulate`` returns: decides the micro-step's sync on entry and holds
    the strategy's gradient-sync context (DDP's ``no_sync``) for the block on non-sync steps (a
    plain class: cheaper per step than a generator-based context manager)."""

    __slots__ = ("_state", "_models", "_sync_context", "_inner")

    def __init__(self, state: GradientState, models, sync_context: Callable[[Any, bool], Any]):
        self._state = state
        self._models = models
        self._sync_context = sync_context
        self._inner = None

    def __enter__(self):
        sync = self._state.next_micro_step()
        self._inner = self._sync_context(self._models, sync or self._state.sync_each_batch)
        return self._inner.__enter__()

    def __exit__(self, *exc):
        inner, self._inner = self._inner, None
        return inner.__exit__(*exc)
