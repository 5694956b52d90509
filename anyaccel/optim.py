"""Thin wrappers that keep the torch optimizer / LR-scheduler API and add what distribution needs.

* :class:`AcceleratedOptimizer` — ``step`` and ``zero_grad`` do nothing on the non-sync micro-steps
  of gradient accumulation; under fp16 ``step`` goes through the gradient scaler and records
  whether the scaler skipped it (overflow); on XLA the gradients are all-reduced across replicas
  first (``xm.optimizer_step`` semantics).
* :class:`AcceleratedScheduler` — steps only when every prepared optimizer really stepped: not on
  accumulation micro-steps, not after a skipped fp16 step. One scheduler step per optimizer step,
  as in plain PyTorch.

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
    def _syncing(self) -> bool:
        return self.grad_state is None or self.grad_state.sync_gradients

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients — except on accumulation micro-steps, where they must add up."""
        if self._syncing():
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def unscale_(self) -> None:
        """Divide the gradients by the fp16 loss scale (once per step; used before clipping)."""
        if self.scaler is not None and not self._unscaled:
            self.scaler.unscale_(self.optimizer)
            self._unscaled = True

    def step(self, closure: Optional[Callable] = None) -> Any:
        """Update the parameters on sync steps; a no-op on accumulation micro-steps."""
        if not self._syncing():
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
            self.step_was_skipped = False
        self._unscaled = False
        return result


class AcceleratedScheduler:
    """Wraps an LR scheduler so that it steps once per *real* optimizer step."""

    def __init__(self, scheduler: Any, optimizers: List[AcceleratedOptimizer], grad_state: Any = None,
                 step_with_optimizer: bool = True):
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.grad_state = grad_state
        self.step_with_optimizer = step_with_optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the wrapped scheduler unless this was an accumulation micro-step or a skipped
        (fp16 overflow) optimizer step."""
        if self.step_with_optimizer:
            if self.grad_state is not None and not self.grad_state.sync_gradients:
                return
            if any(opt.step_was_skipped for opt in self.optimizers):
                return
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
