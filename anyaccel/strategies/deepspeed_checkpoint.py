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
* Conversions, without an engine: :func:`read_full_states` rebuilds full fp32 weights and full
  optimizer states from DeepSpeed's files for any ZeRO stage and process count (the weights as
  DeepSpeed's ``zero_to_fp32`` rebuilds them; the Adam moments by the same merge, applied to the
  moment partitions); :func:`read_dcp_states` reads an FSDP2 checkpoint
  (torch.distributed.checkpoint) into full tensors. Every process reads the whole checkpoint:
  converting needs one full copy of the state per process, for the time of the load.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..errors import CheckpointError

__all__ = ["DEEPSPEED_DIR", "INDEX_FILE", "save", "load", "full_model_state", "load_full_model_state",
           "full_optimizer_state", "load_full_optimizer_state", "read_full_states", "read_dcp_states"]

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
    with _quiet_output():
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
        with _quiet_output():
            path, _ = engine.load_checkpoint(target, tag=_TAG, load_module_strict=strict, load_optimizer_states=True,
                                             load_lr_scheduler_states=True)
    except (RuntimeError, KeyError, ValueError, AssertionError) as exc:
        raise CheckpointError(f"{target} does not fit this DeepSpeed engine: {str(exc).splitlines()[0][:400]}") from exc
    if path is None:
        raise CheckpointError(f"{target} holds no DeepSpeed checkpoint (tag {_TAG!r})")


@contextlib.contextmanager
def _quiet_output() -> Any:
    """DeepSpeed prints and logs per file it writes or reads; keep its warnings only."""
    import logging

    logger = logging.getLogger("DeepSpeed")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


# ---- conversions without an engine ---------------------------------------------------------------
def _index(directory: str) -> Dict[str, Any]:
    path = os.path.join(directory, DEEPSPEED_DIR, INDEX_FILE)
    try:
        with open(path, "r", encoding="utf-8") as fh:
            index: Dict[str, Any] = json.load(fh)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is missing or unreadable ({exc}): this is not a DeepSpeed checkpoint written by "
                              "anyaccel's save_state") from exc
    return index


def read_full_states(directory: str) -> Tuple[Dict[str, torch.Tensor], Optional[Dict[str, Any]]]:
    """Full fp32 weights (with buffers) and the full optimizer state in torch's layout (parameters
    numbered in the saving optimizer's param-group order; None when it never stepped) from the
    DeepSpeed checkpoint under ``directory``, for any ZeRO stage and number of processes. Local
    (every process reads every file)."""
    from deepspeed.utils import zero_to_fp32 as z

    index = _index(directory)
    folder = os.path.join(directory, DEEPSPEED_DIR, index["tag"])
    with _silenced():
        model_files = z.get_model_state_files(folder)
        model_states = z.parse_model_states(model_files)
        optim_files = sorted(glob.glob(os.path.join(folder, "*_optim_states.pt")), key=z.natural_keys)
        if not optim_files:
            raise CheckpointError(f"{folder} has no optimizer partitions (*_optim_states.pt)")
        optim = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"] for f in optim_files]
    stage = int(optim[0]["zero_stage"])
    world = optim[0]["partition_count"]
    world = max(world) if isinstance(world, list) else int(world)
    if world != len(optim):
        raise CheckpointError(f"{folder}: {len(optim)} optimizer partitions for {world} processes")
    flat_key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    base_key = "optimizer_state_dict" if stage == 3 else "base_optimizer_state"

    def merged(flat_groups: List[Any]) -> Dict[str, torch.Tensor]:
        with _silenced():
            if stage == 3:
                sd = z._get_fp32_state_dict_from_zero3_checkpoint(world, flat_groups, model_states, False)
            else:
                sd = z._get_fp32_state_dict_from_zero2_checkpoint(
                    world, flat_groups, model_states, False, optim[0].get("param_alignment_paddings"))
            return z.to_torch_tensor(sd)

    weights = merged([o[flat_key] for o in optim])
    base_states = [_base_state(o[base_key]) for o in optim]
    if not base_states[0]["state"]:
        return weights, None
    per_group = base_states[0]["state"]
    sample = per_group[min(per_group)]
    element_keys = [k for k, v in sample.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
    moments = {key: merged([[s["state"][g][key] for g in sorted(s["state"])] for s in base_states])
               for key in element_keys}
    shared = {k: v for k, v in sample.items() if k not in element_keys}
    names = [n for group in index["param_names"] for n in group]
    state = {i: {**{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in shared.items()},
                 **{key: moments[key][name] for key in element_keys}} for i, name in enumerate(names)}
    groups, start = [], 0
    saved_groups = base_states[0]["param_groups"]
    for g, group_names in enumerate(index["param_names"]):
        hyper = _hyper(saved_groups[g]) if g < len(saved_groups) else {}
        groups.append({**hyper, "params": list(range(start, start + len(group_names)))})
        start += len(group_names)
    return weights, {"state": state, "param_groups": groups}


def _base_state(saved: Any) -> Dict[str, Any]:
    """DeepSpeed's saved base optimizer state as ``{"state": {group: {...}}, "param_groups": [...]}``
    (stage 1/2 may store it as a list of per-group states)."""
    if isinstance(saved, dict):
        return saved
    state, groups = {}, []
    for i, part in enumerate(saved):
        state[i] = part.get("state", part)
        groups.append(part.get("param_groups", [{}])[0] if isinstance(part.get("param_groups"), list) else {})
    return {"state": state, "param_groups": groups}


@contextlib.contextmanager
def _silenced() -> Any:
    """zero_to_fp32 prints progress and a summary to stdout/stderr: keep them out of the job's."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield


def read_dcp_states(directory: str) -> Tuple[Dict[str, torch.Tensor], Optional[Dict[str, Any]]]:
    """Full weights and the optimizer state (keyed by parameter name; None when the checkpoint has
    none) of model 0 / optimizer 0 of the torch.distributed.checkpoint (FSDP2) checkpoint under
    ``directory/sharded``. Local (every process reads all of it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    source = os.path.join(directory, "sharded")
    try:
        metadata = dcp.FileSystemReader(source).read_metadata()
        state: Dict[str, Any] = {}
        for key, meta in metadata.state_dict_metadata.items():  # the saved structure, full-size tensors
            path = (metadata.planner_data or {}).get(key, (key,))
            value = torch.empty(meta.size, dtype=meta.properties.dtype) \
                if isinstance(meta, TensorStorageMetadata) else None
            _set_path(state, path, value)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load(state, checkpoint_id=source, no_dist=True)
    except Exception as exc:  # noqa: BLE001 - DCP's own error types
        raise CheckpointError(f"{source} cannot be read as a torch.distributed.checkpoint: {exc}") from exc
    if "model_0" not in state:
        raise CheckpointError(f"{source} has no model_0")
    return state["model_0"], state.get("optimizer_0")


def _set_path(root: Dict[str, Any], path: Tuple[Any, ...], value: Any) -> None:
    """``root[p0][p1]... = value``, making dicts (lists where the next key is an int)."""
    node: Any = root
    for part, following in zip(path[:-1], path[1:]):
        empty: Any = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            while len(node) <= part:
                node.append(None)
            if node[part] is None:
                node[part] = empty
            node = node[part]
        else:
            node = node.setdefault(part, empty)
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value
