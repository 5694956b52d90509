"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), for every strategy.

A sharded checkpoint stores, under ``<checkpoint>/sharded/``, one DCP checkpoint holding
``{"model_<i>": model state, "optimizer_<j>": optimizer state}`` with fully qualified parameter
names as keys: each rank writes its own shards (FSDP2's DTensors), and loading reshards to
whatever the loading job holds — FSDP2 over another number of processes, or a plain model in one
process or under DDP. The state dicts come from ``torch.distributed.checkpoint.state_dict``
(``get_model_state_dict`` etc.), which return DTensor shards for FSDP2 modules and plain tensors
for other modules, so the same two functions serve every strategy.

Both functions are collective when a process group exists (every rank calls them); without one
(a single process) they read alone.
"""

from __future__ import annotations

import copy as copy_module
import os
import warnings
from typing import Any, Callable, Dict, List, Sequence

import torch

from ..errors import CheckpointError

__all__ = ["SHARDED_DIR", "async_stager", "save_sharded", "load_sharded", "optimizer_owner"]

SHARDED_DIR = "sharded"


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def optimizer_owner(optimizer: torch.optim.Optimizer, modules: List[torch.nn.Module]) -> int:
    """The index of the (unwrapped) module that holds every parameter of ``optimizer``. Raises
    :class:`CheckpointError` when the parameters are spread over several prepared models."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for i, module in enumerate(modules):
        own = {id(p) for p in module.parameters()}
        if params <= own:
            return i
    raise CheckpointError(
        "a sharded checkpoint stores each optimizer with the model its parameters belong to, but this optimizer's "
        "parameters are not all in one prepared model; use one optimizer per model, or "
        "FullyShardedDataParallelPlugin(state_dict_type='FULL_STATE_DICT')"
    )


def _state(modules: List[torch.nn.Module], optimizers: List[Any], which: Sequence[int]) -> Dict[str, Any]:
    """The DCP state of the modules and of the optimizers numbered ``which``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: Dict[str, Any] = {f"model_{i}": get_model_state_dict(m) for i, m in enumerate(modules)}
    for j in which:
        owner = modules[optimizer_owner(optimizers[j], modules)]
        state[f"optimizer_{j}"] = get_optimizer_state_dict(owner, optimizers[j])
    return state


def async_stager(copy: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A DCP stager (torch's ``AsyncStager`` protocol) for ``save_sharded``'s ``asynchronous``:
    staging a state copies each tensor with ``copy`` (e.g. an asynchronous saver's reused host
    buffers) — a DTensor's local shard, rewrapped as a DTensor of the same layout — and deep-copies
    the other values; containers are rebuilt, nothing else is walked or allocated. Only one save may
    use it at a time. Local."""
    return _CopyStager(copy)


class _CopyStager:
    """torch's ``AsyncStager`` protocol over a tensor-copy function (see :func:`async_stager`).
    Torch's ``DefaultStager`` rebuilt every DTensor through a deep copy and the tensor dispatcher:
    half of the stall of an FSDP2 asynchronous save went there, the other half to the copy."""

    _synchronize_after_execute = False  # stage() returns complete copies

    def __init__(self, copy: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._copy = copy

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        from torch.distributed.tensor import DTensor

        return _staged(state_dict, self._copy, DTensor)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _staged(value: Any, copy: Callable[[torch.Tensor], torch.Tensor], dtensor: type) -> Any:
    """``value`` with every tensor replaced by ``copy(tensor)`` (a DTensor's local shard, same spec)."""
    if isinstance(value, dtensor):
        return dtensor(copy(value._local_tensor), value._spec, requires_grad=False)
    if isinstance(value, torch.Tensor):
        return copy(value)
    if isinstance(value, dict):
        return type(value)((k, _staged(v, copy, dtensor)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_staged(v, copy, dtensor) for v in value)
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype)):
        return value
    return copy_module.deepcopy(value)


def save_sharded(directory: str, modules: List[torch.nn.Module], optimizers: List[Any],
                 process_group: Any = None, asynchronous: Any = False) -> Any:
    """Write ``modules`` (unwrapped) and their ``optimizers`` (the torch optimizers) into
    ``directory/sharded``; every rank writes its shards. Collective (on ``process_group``, default:
    the job's group). Returns, on the main process, ``{relative file name: size}`` of every file
    written (for the manifest), else ``{}``. With ``asynchronous`` (``dcp.async_save``; give a CPU
    ``process_group`` that training does not use) it returns once DCP has staged a host copy: a
    function that waits for the write and returns that listing (collective on ``process_group``);
    ``asynchronous`` may be a stager from :func:`async_stager` (else torch's default stager
    copies the state into fresh memory)."""
    import torch.distributed.checkpoint as dcp

    target = os.path.join(directory, SHARDED_DIR)
    os.makedirs(target, exist_ok=True)
    # An optimizer that never stepped has no state to store (and torch's state-dict helper would
    # initialise it with a fake step, changing the run): it is left out, and stays fresh on load.
    stepped = [j for j, optimizer in enumerate(optimizers) if optimizer.state]
    state = _state(modules, optimizers, stepped)
    if asynchronous:
        stager = None if asynchronous is True else asynchronous
        future = dcp.async_save(state, checkpoint_id=target, process_group=process_group, async_stager=stager)
        return lambda: _written(future.result, target)
    return _written(lambda: dcp.save(state, checkpoint_id=target, process_group=process_group), target)


def _written(wait: Any, target: str) -> Dict[str, int]:
    """Wait for DCP (it returns once every rank has written); the main process lists the files."""
    try:
        wait()
    except _checkpoint_exception() as exc:  # a BaseException in torch: make it one our protocol reports
        raise CheckpointError(f"writing the shards into {target} failed: {_first_line(exc)}") from exc
    if _distributed():
        import torch.distributed as dist

        if dist.get_rank() != 0:
            return {}
    return {f"{SHARDED_DIR}/{name}": os.path.getsize(os.path.join(target, name)) for name in sorted(os.listdir(target))}


def load_sharded(directory: str, modules: List[torch.nn.Module], optimizers: List[Any], strict: bool = True) -> None:
    """Load ``directory/sharded`` into ``modules`` (unwrapped) and ``optimizers``, resharding to
    this job's layout. Collective when a process group exists. Raises :class:`CheckpointError`
    naming the first key that does not fit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    source = os.path.join(directory, SHARDED_DIR)
    stored = {key.split(".", 1)[0] for key in dcp.FileSystemReader(source).read_metadata().state_dict_metadata}
    state = _state(modules, optimizers, [j for j in range(len(optimizers)) if f"optimizer_{j}" in stored])
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load(state, checkpoint_id=source, no_dist=not _distributed())
    except (Exception, _checkpoint_exception()) as exc:  # noqa: BLE001 - DCP's own error types
        raise CheckpointError(f"{source} does not fit the prepared models/optimizers: {_first_line(exc)}") from exc
    options = StateDictOptions(strict=strict)
    for i, module in enumerate(modules):
        set_model_state_dict(module, state[f"model_{i}"], options=options)
    for j, optimizer in enumerate(optimizers):
        if f"optimizer_{j}" in state:
            owner = modules[optimizer_owner(optimizer, modules)]
            set_optimizer_state_dict(owner, optimizer, state[f"optimizer_{j}"], options=options)


def _checkpoint_exception() -> type:
    """torch.distributed.checkpoint's CheckpointException (a BaseException, not an Exception)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]
