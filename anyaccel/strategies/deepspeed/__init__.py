"""DeepSpeed ZeRO (the ``deepspeed`` strategy): its options, its engine and its checkpoint code.

===================  ================================================================================
``config.py``        :class:`~.config.DeepSpeedOptions` and the DeepSpeed config with its ``"auto"``
                     values filled (no torch: the launcher checks ``deepspeed_config`` with it)
``strategy.py``      :class:`~.strategy.DeepSpeedStrategy`: prepare, backward and step through the engine
                     (the :class:`~anyaccel.strategies.capabilities.EngineTraining` capability)
``engine.py``        what stands for the optimizer and scheduler the engine owns
``checkpoint.py``    DeepSpeed's own checkpoints inside anyaccel's atomic protocol
``convert.py``       other formats (full, sharded) as full states, and DeepSpeed's as full states
===================  ================================================================================

It stands on the strategy base alone (no other strategy's package). The names below load on
first use (importing the package imports no torch).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["DeepSpeedStrategy", "DeepSpeedOptions", "import_deepspeed", "cpu_optimizer_for"]

_HOMES = {"DeepSpeedStrategy": "strategy", "import_deepspeed": "strategy", "cpu_optimizer_for": "strategy",
          "DeepSpeedOptions": "config"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
