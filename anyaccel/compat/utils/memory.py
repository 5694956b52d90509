"""``anyaccel.utils.memory``: Accelerate's ``accelerate.utils.memory`` names, re-exported from
:mod:`anyaccel.memory` (their home)."""

from __future__ import annotations

from ...training.memory import find_executable_batch_size, release_memory, should_reduce_batch_size

__all__ = ["find_executable_batch_size", "release_memory", "should_reduce_batch_size"]
