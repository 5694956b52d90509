"""Checkpoints: the training-state protocol, its layout on disk, and exported models.

* :mod:`.training_state` — ``save_state``/``load_state`` over an explicit :class:`TrainingState`
  (collective; who writes what);
* :mod:`.agreement` — which checkpoint every process loads, decided once by the main process;
* :mod:`.layout` — directory layout, manifest, automatic naming, atomic replacement;
* :mod:`.serialize` — state dicts to safetensors / ``torch.save`` files and back;
* :mod:`.rng` — every RNG state of a process;
* :mod:`.export` — ``Accelerator.save`` (one file) and ``save_model`` (sharded safetensors).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from .layout import MANIFEST, ProjectConfiguration, resolve_checkpoint

if TYPE_CHECKING:  # loaded on first use (_LAZY)
    from .export import atomic_save, parse_size, save_model
    from .rng import get_rng_state, set_rng_state
    from .training_state import TrainingState, load_state, save_state

__all__ = ["ProjectConfiguration", "CheckpointError", "TrainingState", "atomic_save", "save_state", "load_state",
           "save_model", "resolve_checkpoint", "parse_size", "get_rng_state", "set_rng_state", "MANIFEST"]

#: names loaded on first use: a script that never saves does not pay for the saving code (the
#: import budget, tests/project/test_import_budget.py); ``ProjectConfiguration`` is the façade's
_LAZY = {"TrainingState": ".training_state", "save_state": ".training_state", "load_state": ".training_state",
         "atomic_save": ".export", "save_model": ".export", "parse_size": ".export",
         "get_rng_state": ".rng", "set_rng_state": ".rng"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
