"""``anyaccel.parallelism_config``: Accelerate's module path for :class:`ParallelismConfig`, whose
one home is :mod:`anyaccel.strategies.nd.options` (the ``nd`` strategy's options). Local."""

from __future__ import annotations

from .strategies.nd.options import ParallelismConfig

__all__ = ["ParallelismConfig"]
