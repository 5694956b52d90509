"""Accelerate's kwargs handlers and ``GradientAccumulationPlugin``, at the path anyaccel has always had.

The code lives in :mod:`anyaccel.compat.kwargs` (the Accelerate compatibility layer); this file
exists so that ``from anyaccel.kwargs import DistributedDataParallelKwargs`` keeps working. No
anyaccel module imports it.
"""

from .compat.kwargs import (AutocastKwargs, DistributedDataParallelKwargs, GradientAccumulationPlugin,
                            GradScalerKwargs, InitProcessGroupKwargs, ProfileKwargs)

__all__ = ["DistributedDataParallelKwargs", "GradScalerKwargs", "InitProcessGroupKwargs", "AutocastKwargs",
           "ProfileKwargs", "GradientAccumulationPlugin"]
