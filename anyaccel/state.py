"""Accelerate's ``accelerate.state`` module path: ``PartialState``, ``AcceleratorState``, ``GradientState``,
``is_initialized``.

The code lives in :mod:`anyaccel.compat.state` (the Accelerate compatibility layer); this file
exists so that ``from anyaccel.state import PartialState`` (``sed s/accelerate/anyaccel/``) keeps
working. No anyaccel module imports it.
"""

from .training.accumulation import GradientState
from .compat.state import AcceleratorState, PartialState, is_initialized
from .environment import DistributedType
from .process.job import JobView, resolve_job_environment

__all__ = ["PartialState", "AcceleratorState", "GradientState", "DistributedType", "JobView", "resolve_job_environment",
           "is_initialized"]
