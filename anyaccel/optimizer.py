"""``anyaccel.optimizer``: Accelerate's ``accelerate.optimizer`` module path
(``AcceleratedOptimizer``, re-exported from :mod:`anyaccel.stepping`, its home)."""

from __future__ import annotations

from .training.stepping import AcceleratedOptimizer

__all__ = ["AcceleratedOptimizer"]
