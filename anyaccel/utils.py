"""Small helpers with no better home."""

from __future__ import annotations

import os
import random

import torch

__all__ = ["set_seed"]


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's ``random``, NumPy (when installed), torch's CPU generator and the generator
    of every device whose runtime is started in the calling process (CUDA, MPS, XLA). Call it on
    every process with the same ``seed`` for identical model initialisation everywhere;
    ``device_specific=True`` adds the process rank so that each rank draws different numbers
    (e.g. for augmentation). ``deterministic=True`` also asks torch for deterministic
    algorithms. Local (reads the rank, no communication)."""
    from .backends import started_backends

    if device_specific:
        from . import ops

        seed += ops.rank()
    random.seed(seed)
    os.environ.setdefault("PYTHONHASHSEED", str(seed))
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:  # pragma: no cover
        pass
    torch.manual_seed(seed)
    for backend in started_backends():
        backend.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
