"""DeepSpeed state in and out: full state dicts gathered from ZeRO partitions, DeepSpeed's own
checkpoint inside anyaccel's protocol, and the conversions that let one checkpoint move between
DeepSpeed, FSDP2, DDP and one process.

* Full states, from a live engine (collective: every rank calls them in the same order, one
  collective per parameter): :func:`full_model_state` / :func:`load_full_model_state`,
  :func:`full_optimizer_state` / :func:`load_full_optimizer_state` (torch's layout: the state of
  each parameter, numbered in param-group order as DDP saves it, or keyed by name as
  torch.distributed.checkpoint saves it). They go through DeepSpeed's public tensor-fragment API
  (``deepspeed.utils.safe_get_full_fp32_param`` and friends) and ``deepspeed.zero.GatheredParameters``.
* DeepSpeed's checkpoint: :func:`save` writes ``engine.save_checkpoint`` under
  ``<checkpoint>/deepspeed`` plus ``anyaccel_deepspeed.json`` (the optimizer's parameter names per
  param group); :func:`load` reads it back with ``engine.load_checkpoint`` (same number of
  processes).
* Conversions without an engine (another format as full states) are in :mod:`.convert`.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from ...errors import CheckpointError

__all__ = ["DEEPSPEED_DIR", "INDEX_FILE", "save", "load", "full_model_state", "load_full_model_state",
           "full_optimizer_state", "load_full_optimizer_state"]

DEEPSPEED_DIR = "deepspeed"
INDEX_FILE = "anyaccel_deepspeed.json"
_TAG = "state"


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _zero3(engine: Any) -> bool:
    return int(engine.zero_optimization_stage()) == 3


def _base_optimizer(engine: Any) -> Optional[torch.optim.Optimizer]:
    """The torch optimizer doing the update (inside DeepSpeed's ZeRO/bf16 wrapper, or itself)."""
    optimizer = engine.optimizer
    if optimizer is None:
        return None
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _fragmented(engine: Any) -> bool:
    """Whether parameters carry DeepSpeed's fp32 fragments (ZeRO 1-3, bf16/fp16 optimizers);
    False for stage 0 in fp32, where the torch optimizer holds the parameters themselves."""
    return any(hasattr(p, "ds_id") or getattr(p, "_hp_mapping", None) is not None
               for p in engine.module.parameters())


# ---- full model state -----------------------------------------------------------------------------
def full_model_state(engine: Any, fp32: bool = True) -> Dict[str, torch.Tensor]:
    """The engine's model as a full state dict (the user's key names, CPU tensors) on rank 0, ``{}``
    on the others: the fp32 master weights (``fp32``) where DeepSpeed keeps them, else the weights
    the engine computes with. Collective."""
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    main = _rank() == 0
    masters = fp32 and engine.optimizer is not None and _fragmented(engine)
    done: Dict[int, torch.Tensor] = {}
    for _, param in module.named_parameters():
        if id(param) in done:
            continue
        value = safe_get_full_fp32_param(param) if masters and param.requires_grad else None
        if value is None:
            value = _gathered(engine, param)
        done[id(param)] = value.detach().to("cpu", copy=True) if main else value[:0]
    if not main:
        return {}
    out: Dict[str, torch.Tensor] = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        out[key] = done[id(tensor)] if id(tensor) in done else tensor.detach().to("cpu", copy=True)
    return out


def _gathered(engine: Any, param: torch.nn.Parameter) -> torch.Tensor:
    """The full value of ``param`` (ZeRO-3 gathers it). Collective under ZeRO-3."""
    if hasattr(param, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            return param.data.detach().clone()
    return param.detach()


def load_full_model_state(engine: Any, state: Dict[str, Any], strict: bool = True) -> None:
    """Put a full state dict (every rank holds it) into the engine: its weights and the fp32 master
    copies. ``strict``: every key must match (``CheckpointError`` naming the first that does not,
    before anything is changed). Collective."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param

    module = engine.module
    expected = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in module.named_parameters(remove_duplicate=False)}
    expected.update({name: tuple(b.shape) for name, b in module.named_buffers()})
    if strict:
        for name, shape in expected.items():
            if name not in state:
                raise CheckpointError(f"the model's {name!r} is not in the checkpoint (nothing was loaded)")
            if tuple(state[name].shape) != shape:
                raise CheckpointError(f"{name!r} has shape {tuple(state[name].shape)} in the checkpoint and {shape} in "
                                      "the model (nothing was loaded)")
        extra = [k for k in state if k not in expected]
        if extra:
            raise CheckpointError(f"the checkpoint's {extra[0]!r} is not in the model (nothing was loaded)")
    masters = engine.optimizer is not None and _fragmented(engine)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name not in state:
                continue
            value = state[name].detach().to(torch.float32)
            if hasattr(param, "ds_id"):
                with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                    if _rank() == 0:
                        param.data.copy_(value.to(param.dtype).view_as(param.data))
            else:
                param.data.copy_(value.to(param.dtype).view_as(param.data))
            if masters and param.requires_grad:
                if hasattr(param, "ds_id"):
                    from deepspeed.utils import safe_set_local_fp32_param

                    safe_set_local_fp32_param(param, _own_partition(param, value))
                else:
                    safe_set_full_fp32_param(param, value.to(_device(param)))
        for name, buffer in module.named_buffers():
            if name in state:
                buffer.copy_(state[name].to(buffer.dtype))


def _own_partition(param: Any, value: torch.Tensor) -> torch.Tensor:
    """This rank's ZeRO-3 partition of the full ``value`` of ``param`` (zero-padded at the end, as
    ZeRO-3 pads a parameter whose size the processes do not divide). Local."""
    import torch.distributed as dist

    size = param.ds_tensor.numel()
    rank = dist.get_rank(group=getattr(param, "ds_process_group", None))
    flat = value.detach().reshape(-1).to(torch.float32)
    start = min(rank * size, flat.numel())
    part = flat[start:start + size]
    if part.numel() < size:
        part = torch.cat([part, part.new_zeros(size - part.numel())])
    return part.to(param.ds_tensor.device)


def _device(param: torch.Tensor) -> torch.device:
    return getattr(param, "ds_tensor", param).device


# ---- full optimizer state -------------------------------------------------------------------------
def _params_by_name(engine: Any) -> Dict[str, torch.nn.Parameter]:
    return dict(engine.module.named_parameters())


def _flats(engine: Any, base: torch.optim.Optimizer) -> List[torch.Tensor]:
    """The tensors the base optimizer keeps state for: ZeRO's fp32 partitions (stage 3 hands them
    to the optimizer only while it steps), else its param groups' parameters."""
    for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
        flats = getattr(engine.optimizer, name, None)
        if flats:
            return list(flats)
    return [p for group in base.param_groups for p in group["params"]]


def _flat_state(engine: Any) -> Tuple[Optional[torch.optim.Optimizer], Dict[str, Any]]:
    """The base optimizer and the state of one of its parameters (a template: which keys are per
    element, which are shared such as Adam's ``step``); ``{}`` before the first step."""
    base = _base_optimizer(engine)
    if base is None:
        return None, {}
    for flat in _flats(engine, base):
        if base.state.get(flat):
            return base, base.state[flat]
    return base, {}


def _hyper(group: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def full_optimizer_state(engine: Any, names: List[List[str]]) -> Dict[str, Any]:
    """The engine optimizer's state in torch's layout: ``{"state": {i: {key: full tensor}},
    "param_groups": [...]}`` with parameters numbered in the order of ``names`` (the user's
    optimizer's, per param group), on rank 0 (CPU tensors); ``{}`` on the others. Collective."""
    from deepspeed.utils import safe_get_full_optimizer_state

    base, template = _flat_state(engine)
    params = _params_by_name(engine)
    groups = [dict(_hyper(g)) for g in (base.param_groups if base is not None else [])]
    if len(groups) != len(names):
        groups = [dict(groups[0]) if groups else {} for _ in names]
    main = _rank() == 0
    state: Dict[int, Dict[str, Any]] = {}
    index = 0
    for g, group_names in enumerate(names):
        groups[g]["params"] = list(range(index, index + len(group_names)))
        for name in group_names:
            entry: Dict[str, Any] = {}
            param = params[name]
            for key, value in template.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    if _fragmented(engine):
                        full = safe_get_full_optimizer_state(param, key)
                    else:
                        full = base.state[param][key]  # type: ignore[union-attr]
                    entry[key] = full.detach().to("cpu", copy=True) if main else None
                else:
                    entry[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
            if template:
                state[index] = entry
            index += 1
    return {"state": state, "param_groups": groups} if main else {}


def load_full_optimizer_state(engine: Any, names: List[List[str]], saved: Dict[str, Any]) -> None:
    """Load torch's layout of a full optimizer state (parameters numbered in the order of
    ``names``, or keyed by name) into the engine's partitioned optimizer: per-element entries
    (Adam's moments) through DeepSpeed's fragment API, shared ones (``step``) on every partition,
    and the param groups' hyper-parameters. Collective."""
    from deepspeed.utils import safe_set_full_optimizer_state

    base = _base_optimizer(engine)
    if base is None:
        raise CheckpointError("this DeepSpeed engine has no optimizer to load a state into")
    order = [n for group in names for n in group]
    entries = {(order[int(k)] if not isinstance(k, str) else k): v for k, v in saved.get("state", {}).items()}
    groups = saved.get("param_groups", [])
    if len(groups) == len(base.param_groups):
        for mine, theirs in zip(base.param_groups, groups):
            mine.update({k: v for k, v in theirs.items() if k != "params" and k in mine})
    if not entries:
        return
    template = next(iter(entries.values()))
    _ensure_state(engine, base, template)
    params = _params_by_name(engine)
    fragmented = _fragmented(engine)
    for name in order:
        entry = entries.get(name)
        if entry is None:
            raise CheckpointError(f"the saved optimizer state has no entry for parameter {name!r}")
        param = params[name]
        for key, value in entry.items():
            if not (isinstance(value, torch.Tensor) and value.dim() > 0):
                continue
            value = value.detach().to(torch.float32)
            if hasattr(param, "ds_id"):  # ZeRO-3: this rank's partition (DeepSpeed's full setter skips padding)
                from deepspeed.utils import safe_set_local_optimizer_state

                safe_set_local_optimizer_state(param, _own_partition(param, value), key)
            elif fragmented:
                safe_set_full_optimizer_state(param, value.to(_device(param)), key)
            else:
                base.state[param][key].copy_(value.view_as(param))
    shared = {k: v for k, v in template.items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
    for flat in _flats(engine, base):
        for key, value in shared.items():
            current = base.state[flat].get(key)
            if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
                base.state[flat][key] = value.detach().to(current.dtype).to(current.device).clone()
            else:
                base.state[flat][key] = value.clone() if isinstance(value, torch.Tensor) else value


def _ensure_state(engine: Any, base: torch.optim.Optimizer, template: Dict[str, Any]) -> None:
    """An optimizer that never stepped has no state yet (torch makes it at the first step): make
    it, zeros of each flat partition's shape for the per-element keys, and link DeepSpeed's
    fragments to it (what DeepSpeed does after its first step). Local."""
    made = False
    for flat in _flats(engine, base):
        if base.state.get(flat):
            continue
        made = True
        entry: Dict[str, Any] = {}
        for key, value in template.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                entry[key] = torch.zeros_like(flat, dtype=torch.float32)
            elif isinstance(value, torch.Tensor):
                entry[key] = value.detach().clone()
            else:
                entry[key] = value
        base.state[flat] = entry
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if made and callable(link):
        link()


# ---- DeepSpeed's checkpoint inside anyaccel's ------------------------------------------------------
def save(directory: str, engine: Any, names: List[List[str]]) -> Dict[str, int]:
    """``engine.save_checkpoint`` into ``directory/deepspeed`` (every rank writes its partitions),
    then the main process writes the index (the optimizer's parameter names per param group) and
    returns ``{relative file name: size}`` of every file there (``{}`` on the others).
    Collective."""
    import torch.distributed as dist

    target = os.path.join(directory, DEEPSPEED_DIR)
    with quiet_deepspeed():
        engine.save_checkpoint(target, tag=_TAG, client_state={}, save_latest=True)
    if _rank() != 0:
        return {}
    index = {"tag": _TAG, "zero_stage": int(engine.zero_optimization_stage()), "param_names": names,
             "world_size": dist.get_world_size() if dist.is_initialized() else 1}
    with open(os.path.join(target, INDEX_FILE), "w", encoding="utf-8") as fh:
        json.dump(index, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    files = {}
    for root, _, entries in os.walk(target):
        for entry in entries:
            path = os.path.join(root, entry)
            files[os.path.relpath(path, directory)] = os.path.getsize(path)
    return dict(sorted(files.items()))


def load(directory: str, engine: Any, strict: bool = True) -> None:
    """``engine.load_checkpoint`` of ``directory/deepspeed`` (saved by the same number of
    processes): weights, optimizer partitions, DeepSpeed's own scheduler and step counters.
    Collective. Raises :class:`CheckpointError` naming the directory when DeepSpeed finds nothing."""
    target = os.path.join(directory, DEEPSPEED_DIR)
    try:
        with quiet_deepspeed():
            path, _ = engine.load_checkpoint(target, tag=_TAG, load_module_strict=strict, load_optimizer_states=True,
                                             load_lr_scheduler_states=True)
    except (RuntimeError, KeyError, ValueError, AssertionError) as exc:
        raise CheckpointError(f"{target} does not fit this DeepSpeed engine: {str(exc).splitlines()[0][:400]}") from exc
    if path is None:
        raise CheckpointError(f"{target} holds no DeepSpeed checkpoint (tag {_TAG!r})")


@contextlib.contextmanager
def quiet_deepspeed() -> Any:
    """DeepSpeed logs at INFO on every rank (its set-up, each file it writes or reads); keep its
    warnings only while it runs. Local. (The strategy's engine set-up uses it too.)"""
    import logging

    logger = logging.getLogger("DeepSpeed")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
