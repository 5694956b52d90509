"""``anyaccel.utils.random``: Accelerate's ``accelerate.utils.random`` names (seeding and RNG
synchronisation)."""

from __future__ import annotations

import random
from typing import Iterable, Optional

import torch

from ... import ops

__all__ = ["set_seed", "synchronize_rng_state", "synchronize_rng_states"]


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's ``random``, NumPy (when installed), torch's CPU generator and the generator
    of every device whose runtime is started in the calling process (CUDA, MPS, XLA). Call it on
    every process with the same ``seed`` for identical model initialisation everywhere;
    ``device_specific=True`` adds the process rank so that each rank draws different numbers
    (e.g. for augmentation). ``deterministic=True`` also asks torch for deterministic
    algorithms. Local (reads the rank, no communication): before an ``Accelerator`` exists the
    rank is the launcher's (as Accelerate's ``AcceleratorState().process_index``). Like
    Accelerate's, it does not set ``PYTHONHASHSEED``."""
    from ...backends import started_backends

    if device_specific:
        seed += _process_index()
    random.seed(seed)
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


def _process_index() -> int:
    """This process's rank: the group's when one is running, else the launcher's (read from the
    environment once more; no group needed)."""
    if ops.world_size() > 1:
        return ops.rank()
    from ...environment import resolve_environment

    return resolve_environment().rank


def synchronize_rng_state(rng_type: Optional[str] = None, generator: Optional[torch.Generator] = None) -> None:
    """Every rank's ``rng_type`` generator (``"torch"``, the default; a device type such as
    ``"cuda"``; or ``"generator"`` with ``generator=``) is set to rank 0's state. Collective."""
    get, put = _rng_access(str(getattr(rng_type, "value", rng_type or "torch")), generator)
    state = [get() if ops.rank() == 0 else None]
    ops.broadcast_object_list(state, from_process=0)
    put(state[0])


def synchronize_rng_states(rng_types: Iterable[str], generator: Optional[torch.Generator] = None) -> None:
    """:func:`synchronize_rng_state` for each of ``rng_types``. Collective. (Prepared loaders do
    not need it: their order comes from one seed shared by every rank.)"""
    for rng_type in rng_types:
        synchronize_rng_state(str(getattr(rng_type, "value", rng_type)), generator=generator)


def _rng_access(rng_type: str, generator: Optional[torch.Generator]):
    if rng_type == "torch":
        return torch.get_rng_state, torch.set_rng_state
    if rng_type == "generator":
        if generator is None:
            raise ValueError("synchronize_rng_state('generator') needs generator=<torch.Generator>")
        return generator.get_state, generator.set_state
    from ...backends import backend_class

    try:
        device = backend_class(rng_type)  # "cuda", "mps", "xla": the device's own RNG, through its backend
    except ValueError:
        raise ValueError(f"rng type {rng_type!r}: anyaccel synchronises 'torch', 'generator' and the device types "
                         "it has a backend for ('cuda', 'mps', 'xla')") from None
    return device.get_rng_state, device.set_rng_state
