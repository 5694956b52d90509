"""Reading a checkpoint's full model and optimizer states into the prepared objects (the part of
``load_state`` for checkpoints in the ``"full"`` format, or converted from another strategy's,
such as DeepSpeed's).

Who reads: every process, each the same files — or, for a strategy that says
:attr:`~anyaccel.strategies.base.Strategy.loads_full_state_on_rank0` (FSDP2, as Accelerate's
``rank0_only`` loading), rank 0 alone in a multi-process job: it reads and checks the files (and
converts another strategy's checkpoint), tells the others what it found (one small broadcast, so
a problem raises on every process instead of leaving the others in the next collective) and the
strategy broadcasts the states into every rank's shards. The other processes then read no file
of the model or its optimizer and never hold a full copy of either.
``state`` is the caller's :class:`~anyaccel.checkpoint.training_state.TrainingState`.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

from .. import ops
from ..errors import CheckpointError
from .layout import file_name
from .serialize import load_model_file, torch_load

__all__ = ["read_full_models", "converted"]

States = Tuple[List[Dict[str, Any]], List[Any]]

# Checkpoint formats of one strategy that others read by converting them to full states:
# format -> "module:function" returning (model 0's full state dict, optimizer 0's full state in
# torch's layout or None), given the checkpoint directory.
_CONVERTERS = {"deepspeed": "anyaccel.strategies.deepspeed.convert:read_full_states"}


def converted(kind: str, directory: str, state: Any) -> States:
    """Model and optimizer states of a checkpoint in another strategy's format, as full states. Local."""
    import importlib

    if kind not in _CONVERTERS:
        raise CheckpointError(f"{directory} is a {kind!r} checkpoint, which the {state.strategy.name!r} strategy cannot "
                              "read; load it with the strategy that wrote it")
    module, _, function = _CONVERTERS[kind].partition(":")
    weights, optimizer_state = getattr(importlib.import_module(module), function)(directory)
    if len(state.models) != 1 or len(state.optimizers) > 1:
        raise CheckpointError(f"{directory} ({kind}) holds one model and its optimizer; this Accelerator prepared "
                              f"{len(state.models)} models and {len(state.optimizers)} optimizers")
    return [weights], ([optimizer_state] if state.optimizers else [])


def _first_mismatch(expected: Dict[str, Any], saved: Dict[str, Any]) -> Optional[str]:
    """The first key (in the model's order) that the saved weights lack or hold with another
    shape, else the first saved key the model has not; None when they fit."""
    for key, value in expected.items():
        if key not in saved:
            return f"the model's {key!r} is not in the checkpoint"
        shape, saved_shape = getattr(value, "shape", None), getattr(saved[key], "shape", None)
        if shape is not None and saved_shape is not None and tuple(shape) != tuple(saved_shape):
            return f"{key!r} has shape {tuple(saved_shape)} in the checkpoint and {tuple(shape)} in the model"
    extra = [k for k in saved if k not in expected]
    return f"the checkpoint's {extra[0]!r} is not in the model" if extra else None


def _read(state: Any, directory: str, strict: bool, kind: str) -> States:
    """The checkpoint's model and optimizer states (converted from ``kind`` unless it is
    ``"full"``), every model checked first when ``strict`` (a wrong checkpoint leaves the models as
    they were). An optimizer saved before its first step by a strategy whose converter says so is
    None. Local."""
    given = converted(kind, directory, state) if kind != "full" else None
    all_weights = [load_model_file(directory, file_name("model", i)) for i in range(len(state.models))] \
        if given is None else given[0]
    if strict:
        for i, (model, weights) in enumerate(zip(state.models, all_weights)):
            problem = _first_mismatch(state.strategy.unwrap(model).state_dict(), weights)
            if problem:
                raise CheckpointError(
                    f"checkpoint {directory} was written by a different model: model {i}: {problem}. Resume with "
                    "the model that wrote it, or pass another checkpoint (nothing was loaded)")
    optimizers = [torch_load(os.path.join(directory, file_name("optimizer", i, ".bin"))) if given is None
                  else given[1][i] for i in range(len(state.optimizers))]
    return all_weights, optimizers


def _read_on_rank0(state: Any, directory: str, strict: bool, kind: str) -> States:
    """:func:`_read` on rank 0 alone; the other ranks get empty states (``{}``, None for an
    optimizer rank 0 found None), and rank 0's problem, if any, raised on every rank. Collective
    (one small broadcast)."""
    states: States = ([{} for _ in state.models], [{} for _ in state.optimizers])
    problem: Optional[Tuple[str, str]] = None
    if state.is_main_process:
        try:
            states = _read(state, directory, strict, kind)
        except Exception as exc:  # raised on every process, not on this one alone
            problem = (type(exc).__name__, str(exc))
    unsaved = [s is None for s in states[1]]
    problem, unsaved = ops.broadcast_object_list([(problem, unsaved)], from_process=0)[0]
    if problem is not None:
        kind_of_error, message = problem
        error = FileNotFoundError if kind_of_error == "FileNotFoundError" else CheckpointError
        raise error(message if state.is_main_process else f"{message} (found by process 0)")
    return states[0], [None if none else s for s, none in zip(states[1], unsaved)]


def read_full_models(state: Any, directory: str, strict: bool, kind: str = "full") -> None:
    """Full model and optimizer states into the prepared objects: read from the checkpoint's
    files, or converted from another strategy's format ``kind``; by every process, or by rank 0
    alone where the strategy loads full states from rank 0 (see the module docstring). Collective
    where the strategy's loading is."""
    from_rank0 = state.strategy.loads_full_state_on_rank0 and state.num_processes > 1
    weights, optimizer_states = (_read_on_rank0 if from_rank0 else _read)(state, directory, strict, kind)
    for i, (model, model_state) in enumerate(zip(state.models, weights)):
        try:
            state.strategy.load_model_state_dict(model, model_state, strict=strict)
        except RuntimeError as exc:
            raise CheckpointError(f"model {i} in {directory} does not fit the prepared model: {exc}") from exc
    for i, (optimizer, optimizer_state) in enumerate(zip(state.optimizers, optimizer_states)):
        if optimizer_state is None:
            continue  # saved before its first step: nothing but its hyper-parameters, which are the script's
        try:
            state.strategy.load_optimizer_state_dict(optimizer, optimizer_state)
        except (ValueError, KeyError) as exc:
            path = os.path.join(directory, file_name("optimizer", i, ".bin"))
            raise CheckpointError(f"{path} does not fit optimizer {i}: {exc}") from exc
