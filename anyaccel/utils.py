"""Small helpers with no better home."""

from __future__ import annotations

import os
import random

import torch

__all__ = ["set_seed"]


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's ``random``, NumPy (when installed), torch (CPU and every CUDA device) on the
    calling process. Call it on every process with the same ``seed`` for identical model
    initialisation everywhere; ``device_specific=True`` adds the process rank so that each rank
    draws different numbers (e.g. for augmentation). ``deterministic=True`` also asks torch for
    deterministic algorithms."""
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
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
    import sys

    if "torch_xla" in sys.modules:  # torch.manual_seed does not reach torch-xla's RNG
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
