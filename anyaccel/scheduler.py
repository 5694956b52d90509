"""``anyaccel.scheduler``: Accelerate's ``accelerate.scheduler`` module path
(``AcceleratedScheduler``, re-exported from :mod:`anyaccel.stepping`, its home)."""

from __future__ import annotations

from .training.stepping import AcceleratedScheduler

__all__ = ["AcceleratedScheduler"]
