"""``anyaccel.scheduler``: Accelerate's ``accelerate.scheduler`` module path
(``AcceleratedScheduler``, re-exported from :mod:`anyaccel.optim`, its home)."""

from __future__ import annotations

from .optim import AcceleratedScheduler

__all__ = ["AcceleratedScheduler"]
