"""RNG states of one process, kept in plain types and tensors so that ``weights_only`` loading
accepts them: Python ``random``, NumPy (when imported), torch's CPU generator, and the generator of
every device backend whose runtime is started here (CUDA, MPS, XLA: :mod:`anyaccel.backends`).
Local to the calling process."""

from __future__ import annotations

import os
import random
import sys
import warnings
from typing import Any, Dict

import torch

from ..backends import backend_class, started_backends

__all__ = ["get_rng_state", "capture_rng_state", "rng_state_of", "set_rng_state", "rng_source_rank", "restore_rng_file"]


def get_rng_state() -> Dict[str, Any]:
    """This process's RNG states (see the module docstring). Local."""
    return rng_state_of(capture_rng_state())


def capture_rng_state() -> Any:
    """This process's RNG states now, as the generators give them (no conversion: a few C calls),
    for :func:`rng_state_of` to turn into :func:`get_rng_state`'s form later, on any thread (a
    healing state taken at every step boundary and read only when a peer heals). Local."""
    np = sys.modules.get("numpy")
    devices = [(backend.device_type, backend.get_rng_state()) for backend in started_backends()]
    return random.getstate(), torch.get_rng_state(), np.random.get_state() if np is not None else None, devices


def rng_state_of(captured: Any) -> Dict[str, Any]:
    """:func:`get_rng_state`'s form of what :func:`capture_rng_state` took. Local."""
    (version, internal, gauss), cpu, numpy_state, devices = captured
    state: Dict[str, Any] = {"python": [version, list(internal), gauss], "torch": cpu}
    if numpy_state is not None:
        kind, keys, pos, has_gauss, cached = numpy_state
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    for device_type, device_state in devices:
        if device_state is not None:
            state[device_type] = device_state
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


def rng_source_rank(rank: int, world_size: int, data_parallel: "tuple[int, int]", saved_world_size: int,
                    saved_data_parallel_size: int) -> int:
    """Whose saved RNG file process ``rank`` restores. In the layout that saved (same number of
    processes and of data-parallel ranks): its own, so the run continues bitwise. In another
    layout (TP2xDP2 <-> FSDP over 4 <-> one process): data-parallel rank ``d`` (``data_parallel``
    is ``(d, size)``) takes the file of the saved job's data-parallel rank ``d mod saved size``,
    from the first process of that rank's tensor/context-parallel group (rank ``k x group size``:
    the ``nd`` mesh puts those dimensions innermost). So every process of one tensor-parallel
    group restores the same state and they keep drawing alike (dropout on replicated
    activations), whatever layout saved. Local."""
    d, size = data_parallel
    if world_size == saved_world_size and size == saved_data_parallel_size:
        return rank
    saved_dp = max(1, int(saved_data_parallel_size))
    group = max(1, int(saved_world_size) // saved_dp)
    return (d % saved_dp) * group


def restore_rng_file(directory: str, rank: int, process_index: int, num_processes: int, saved_alone: bool) -> None:
    """This process's RNG states from checkpoint ``directory``'s file of saved process ``rank``. A
    checkpoint the main process saved alone holds process 0's only: the others keep theirs, as
    under Accelerate (the main process says so once). Otherwise a missing file is a warning. Local."""
    from .serialize import torch_load

    path = os.path.join(directory, f"random_states_{rank}.pkl")
    if saved_alone and process_index == 0 and num_processes > 1:
        warnings.warn(f"{directory} was saved by the main process alone (save_state under `if accelerator."
                      "is_main_process:`): it holds process 0's RNG states only; the other processes keep theirs",
                      stacklevel=4)
    if os.path.exists(path):
        set_rng_state(torch_load(path))
    elif not saved_alone:
        warnings.warn(f"{directory} has no RNG state for process {rank} (the one process {process_index} "
                      "restores); RNG states unchanged", stacklevel=4)
