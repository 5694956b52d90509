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

from ..errors import CheckpointError
from .export import atomic_save, parse_size, save_model
from .layout import MANIFEST, ProjectConfiguration, resolve_checkpoint
from .rng import get_rng_state, set_rng_state
from .training_state import TrainingState, load_state, save_state

__all__ = ["ProjectConfiguration", "CheckpointError", "TrainingState", "atomic_save", "save_state", "load_state",
           "save_model", "resolve_checkpoint", "parse_size", "get_rng_state", "set_rng_state", "MANIFEST"]
