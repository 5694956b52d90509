"""When the optimizer and the LR schedule really step: thin wrappers that keep the torch optimizer /
LR-scheduler API and add what distribution needs (the home of the classes that Accelerate's
module paths :mod:`anyaccel.optimizer` and :mod:`anyaccel.scheduler` re-export).

* :class:`AcceleratedOptimizer` — ``step`` and ``zero_grad`` do nothing on the non-sync micro-steps
  of gradient accumulation; under fp16 ``step`` goes through the gradient scaler and records
  whether the scaler skipped it (overflow); on XLA the gradients are all-reduced across replicas
  first (``xm.optimizer_step`` semantics).
* :class:`AcceleratedScheduler` — steps only when every prepared optimizer really stepped: not on
  accumulation micro-steps, not after a skipped fp16 step. Then, as Accelerate's does, it steps
  the wrapped scheduler ``num_processes`` times (once with ``split_batches``): a script builds its
  schedule for the single-process step count (``len(loader) * epochs`` before ``prepare``), and
  with ``N`` processes each optimizer step consumes ``N`` of those batches, so the schedule ends
  where the single-process run ends. ``steps_per_optimizer_step=1`` gives one step per optimizer
  step instead (a schedule written for the steps really taken).

Local to each process; ranks stay in step because they all run the same loop.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch

__all__ = ["AcceleratedOptimizer", "AcceleratedScheduler"]


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer``; every attribute not defined here is the wrapped optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, grad_state: Any = None, scaler: Any = None,
                 before_step: Optional[Callable[[torch.optim.Optimizer], None]] = None):
        # Deliberately no super().__init__: the wrapped optimizer owns params and state.
        self.optimizer = optimizer
        self.grad_state = grad_state
        self.scaler = scaler
        self.before_step = before_step
        self.step_was_skipped = False
        self._unscaled = False
        # an engine's optimizer that may skip a step itself (DeepSpeed's fp16 overflow) says so
        self._reports_skips = hasattr(type(optimizer), "step_was_skipped")

    # ---- the torch API, forwarded -------------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    def __getstate__(self):
        return self.__dict__

    def __setstate__(self, state):
        self.__dict__.update(state)

    # ---- behaviour ----------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients — except on accumulation micro-steps, where they must add up."""
        state = self.grad_state  # (inline: this runs every step)
        if state is None or state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def unscale_(self) -> None:
        """Divide the gradients by the fp16 loss scale (once per step; used before clipping)."""
        if self.scaler is not None and not self._unscaled:
            self.scaler.unscale_(self.optimizer)
            self._unscaled = True

    def step(self, closure: Optional[Callable] = None) -> Any:
        """Update the parameters on sync steps; a no-op on accumulation micro-steps."""
        state = self.grad_state  # (inline: this runs every step)
        if state is not None and not state.sync_gradients:
            return None
        if self.before_step is not None:
            self.before_step(self.optimizer)
        result = None
        if self.scaler is not None:
            scale_before = self.scaler.get_scale()
            result = self.scaler.step(self.optimizer, closure) if closure is not None else self.scaler.step(self.optimizer)
            self.scaler.update()
            self.step_was_skipped = self.scaler.get_scale() < scale_before
        else:
            result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
            self.step_was_skipped = self._reports_skips and bool(self.optimizer.step_was_skipped)
        self._unscaled = False
        return result


class AcceleratedScheduler:
    """Wraps an LR scheduler so that it follows the optimizer steps really taken (see the module
    docstring). Local to each process.

    Args:
        steps_per_optimizer_step: wrapped-scheduler steps per real optimizer step:
            ``num_processes`` without ``split_batches`` (Accelerate's rule), else 1.
        step_with_optimizer: ``False`` steps the wrapped scheduler on every call, once
            (``Accelerator(step_scheduler_with_optimizer=False)``).
    """

    def __init__(self, scheduler: Any, optimizers: List[AcceleratedOptimizer], grad_state: Any = None,
                 step_with_optimizer: bool = True, steps_per_optimizer_step: int = 1):
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.grad_state = grad_state
        self.step_with_optimizer = step_with_optimizer
        if int(steps_per_optimizer_step) < 1:
            raise ValueError(f"steps_per_optimizer_step must be >= 1, got {steps_per_optimizer_step}")
        self.steps_per_optimizer_step = int(steps_per_optimizer_step)

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the wrapped scheduler ``steps_per_optimizer_step`` times, unless this was an
        accumulation micro-step or a skipped (fp16 overflow) optimizer step. A scheduler with
        ``total_steps`` (``OneCycleLR``) is not stepped past it."""
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if self.grad_state is not None and not self.grad_state.sync_gradients:
            return  # (Accelerate's adjust_scheduler branch here never runs: see GradientAccumulationPlugin)
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        total = getattr(self.scheduler, "total_steps", None)
        for _ in range(self.steps_per_optimizer_step):
            if total is not None and self.scheduler._step_count > total:
                break
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"AcceleratedScheduler({self.scheduler!r})"
