"""RNG states of one process, kept in plain types and tensors so that ``weights_only`` loading
accepts them: Python ``random``, NumPy (when imported), torch's CPU generator, and the generator of
every device backend whose runtime is started here (CUDA, MPS, XLA: :mod:`anyaccel.backends`).
Local to the calling process."""

from __future__ import annotations

import random
import sys
from typing import Any, Dict

import torch

from ..backends import backend_class, started_backends

__all__ = ["get_rng_state", "set_rng_state"]


def get_rng_state() -> Dict[str, Any]:
    """This process's RNG states (see the module docstring). Local."""
    version, internal, gauss = random.getstate()
    state: Dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    for backend in started_backends():
        device_state = backend.get_rng_state()
        if device_state is not None:
            state[backend.device_type] = device_state
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned; device states whose runtime is not started in
    this process are skipped. Local."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"],
                             s["cached_gaussian"]))
    started = {backend.device_type for backend in started_backends()}
    for key, value in state.items():
        if key in started:
            backend_class(key).set_rng_state(value)
