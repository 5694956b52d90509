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
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch

from ..errors import CheckpointError

__all__ = ["SHARDED_DIR", "async_stager", "save_sharded", "load_sharded", "optimizer_owner", "nested_optimizer_state"]

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


def _state(modules: List[torch.nn.Module], optimizers: List[Any], which: Sequence[int],
           aliases: Optional[Mapping[str, str]] = None, flat: bool = True) -> Dict[str, Any]:
    """The DCP state of the modules and of the optimizers numbered ``which``. Optimizer states are
    stored per parameter name (``flat``: torch's ``flatten_optimizer_state_dict``, hyper-parameters
    included), so that processes holding different parameters — pipeline stages — write and read
    their own; ``aliases`` maps a parameter name to the name its optimizer state is stored under
    (a weight tied across pipeline stages: every copy under the one name the untied model uses)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    state: Dict[str, Any] = {f"model_{i}": get_model_state_dict(m) for i, m in enumerate(modules)}
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    for j in which:
        owner = modules[optimizer_owner(optimizers[j], modules)]
        optim = get_optimizer_state_dict(owner, optimizers[j], options=options)
        state[f"optimizer_{j}"] = _aliased(optim, aliases) if aliases and flat else optim
    return state


_SECTIONS = ("state.", "param_groups.")


def nested_optimizer_state(saved: Dict[str, Any]) -> Dict[str, Any]:
    """An optimizer state as read from a checkpoint, in torch's nested layout keyed by parameter
    name: ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``. A flat
    state (how :func:`save_sharded` stores it: ``state.<name>.<key>``, ``param_groups.<name>.<key>``)
    is nested, parameters with equal hyper-parameters in one group, in saved order; a nested one
    (written before) is returned as it is. For readers outside torch's ``set_optimizer_state_dict``
    (another engine's converter). Local."""
    if "state" in saved or "param_groups" in saved:
        return saved
    state: Dict[str, Dict[str, Any]] = {}
    hyper: Dict[str, Dict[str, Any]] = {}
    for key, value in saved.items():
        for section, into in (("state.", state), ("param_groups.", hyper)):
            if key.startswith(section):
                name, _, field = key[len(section):].rpartition(".")  # names hold dots; torch's fields do not
                into.setdefault(name, {})[field] = value
    groups: List[Dict[str, Any]] = []
    for name, values in hyper.items():
        values = {k: v for k, v in values.items() if k != "params"}
        group = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == values), None)
        if group is None:
            group = dict(values, params=[])
            groups.append(group)
        group["params"].append(name)
    return {"state": state, "param_groups": groups}


def _aliased(flat: Dict[str, Any], aliases: Mapping[str, str]) -> Dict[str, Any]:
    """A flat optimizer state with each aliased parameter's entries under its stored name (the
    first entry wins where two local names share one stored name: their values are equal)."""
    out: Dict[str, Any] = {}
    for key, value in flat.items():
        out.setdefault(_rename(key, aliases), value)
    return out


def _rename(key: str, aliases: Mapping[str, str]) -> str:
    for section in _SECTIONS:
        if key.startswith(section):
            for local, stored in aliases.items():
                if key.startswith(section + local + "."):
                    return section + stored + key[len(section + local):]
    return key


def _unaliased(loaded: Dict[str, Any], local: Dict[str, Any], aliases: Mapping[str, str]) -> Dict[str, Any]:
    """The flat optimizer state keyed by this process's names, from ``loaded`` (keyed as stored);
    a tensor read once for several local names is copied for each but the first."""
    out: Dict[str, Any] = {}
    used = set()
    for key in local:
        stored = _rename(key, aliases)
        value = loaded[stored]
        if isinstance(value, torch.Tensor) and stored in used:
            value = value.clone()
        used.add(stored)
        out[key] = value
    return out


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
                 process_group: Any = None, asynchronous: Any = False,
                 aliases: Optional[Mapping[str, str]] = None) -> Any:
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
    state = _state(modules, optimizers, stepped, aliases)
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


def load_sharded(directory: str, modules: List[torch.nn.Module], optimizers: List[Any], strict: bool = True,
                 aliases: Optional[Mapping[str, str]] = None) -> None:
    """Load ``directory/sharded`` into ``modules`` (unwrapped) and ``optimizers``, resharding to
    this job's layout (``aliases``: see :func:`_state`). Optimizer states written before they were
    stored per parameter name (one list of param groups per optimizer) still load, except into
    pipeline stages. Collective when a process group exists. Raises :class:`CheckpointError`
    naming the first key that does not fit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    source = os.path.join(directory, SHARDED_DIR)
    keys = list(dcp.FileSystemReader(source).read_metadata().state_dict_metadata)
    stored = {key.split(".", 1)[0] for key in keys}
    flat = not any(k.startswith("optimizer_") and k.endswith(".params") for k in keys)  # param-group lists: older
    which = [j for j in range(len(optimizers)) if f"optimizer_{j}" in stored]
    local = _state(modules, optimizers, which, flat=flat)
    state = _state(modules, optimizers, which, aliases, flat) if aliases and flat else local
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
            optim = state[f"optimizer_{j}"]
            if aliases and flat:
                optim = _unaliased(optim, local[f"optimizer_{j}"], aliases)
            set_optimizer_state_dict(owner, optimizer, optim, options=StateDictOptions(
                strict=strict, flatten_optimizer_state_dict=flat))


def _checkpoint_exception() -> type:
    """torch.distributed.checkpoint's CheckpointException (a BaseException, not an Exception)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]
