"""``anyaccel.optimizer``: Accelerate's ``accelerate.optimizer`` module path
(``AcceleratedOptimizer``, re-exported from :mod:`anyaccel.optim`, its home)."""

from __future__ import annotations

from .optim import AcceleratedOptimizer

__all__ = ["AcceleratedOptimizer"]
