"""A model built on meta, sharded by FSDP2, then filled shard by shard: no process ever holds the
whole model.

:func:`materialize` (collective; called by the FSDP2 strategy after ``fully_shard`` when the model
has meta tensors) allocates only each process's shards (``to_empty``) and fills them from the
model's own initialisation, one module at a time: the module's meta tensors are swapped for full
temporary CPU tensors, ``reset_parameters()`` runs on them (then the root's ``_init_weights(module)``
when the model defines one, the Hugging Face convention), the local slice is copied into the shard
and the temporaries are dropped. Peak extra memory is one module's tensors.

Why this equals an eager build: building on meta draws no random numbers, and
:func:`~anyaccel.big_modeling.init_empty_weights` records the CPU generator's state when the build
began. Replaying ``reset_parameters`` module by module, in registration order, from that state, draws
the same numbers in the same order as the eager constructors did (every ``torch.nn`` layer
initialises itself in ``__init__`` through ``reset_parameters``). All processes replay from rank 0's
state (broadcast once, a few KB), so they hold slices of one model: what ``sync_module_states``
gives an eager build, without a full copy anywhere. Models whose constructors initialise tensors
otherwise (a parameter filled in ``__init__`` without ``reset_parameters``) are not covered: their
tensors are listed, and the first forward refuses to run until a checkpoint provides them. A tied
parameter (one tensor under several names, ``lm_head.weight is embed_tokens.weight``) is filled
once, by its first user in registration order: later users still draw their numbers (so the
modules after them draw what they drew eagerly) but keep none, as an eager build that ties after
constructing keeps the first module's values.

:func:`load_into_sharded` fills the shards from a checkpoint. Each process reads only the slices its
shards cover (a row range of a safetensors tensor is one byte range: ``pread`` straight into the
shard; other slices through ``safe_open``; ``torch.distributed.checkpoint`` resharding for DCP
directories), so peak host memory per process is its shards plus at most one slice: no process
reads the model. The alternative — rank 0 reads each tensor and broadcasts it — is kept (``method=
"broadcast"``) because ``python -m benchmarks --only bigmodel`` measures both.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import torch

from ..errors import CheckpointError
from .checkpoints import CheckpointReader, check_checkpoint, open_checkpoint
from .empty_init import INIT_RNG_ATTR

__all__ = ["has_meta", "materialize", "load_into_sharded", "is_sharded", "local_index", "PENDING_ATTR"]

PENDING_ATTR = "_anyaccel_uninitialised"  # names the first forward refuses to run without


def has_meta(module: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device. Local."""
    return any(_local(t).is_meta for t in _tensors(module))


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds DTensor parameters (FSDP2, tensor parallel). Local."""
    return any(_is_dtensor(p) for p in module.parameters())


def _tensors(module: torch.nn.Module) -> Iterable[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" or type(getattr(t, "data", None)).__name__ == "DTensor"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def local_index(t: torch.Tensor) -> Tuple[slice, ...]:
    """The slice of the full tensor that this process's shard of ``t`` holds (all of it for a
    plain tensor). Local."""
    if not _is_dtensor(t):
        return ()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _copy_into(target: torch.Tensor, full_or_slice: torch.Tensor, index: Tuple[slice, ...], sliced: bool) -> None:
    local = _local(target)
    if local.numel() == 0:
        return
    value = full_or_slice if sliced or not index else full_or_slice[index]
    local.copy_(value.reshape(local.shape))


# ---- materialise from the model's own initialisation ----------------------------------------------
def materialize(module: torch.nn.Module, device: torch.device) -> List[str]:
    """Allocate this process's shards of every meta tensor of ``module`` on ``device`` and fill
    them from the model's initialisation (module docstring). Collective: every rank calls it after
    ``fully_shard``; rank 0's recorded RNG state is broadcast. Returns the names that no
    initialisation covered (the first forward refuses to run until a checkpoint provides them)."""
    meta: Set[Tuple[int, str]] = set()
    kept: Dict[Tuple[int, str], torch.Tensor] = {}
    for m in module.modules():
        for kind in ("_parameters", "_buffers"):
            for n, t in getattr(m, kind).items():
                if t is None:
                    continue
                (meta.add((id(m), n)) if _local(t).is_meta else kept.__setitem__((id(m), n), _local(t)))
    with torch.no_grad():
        module.to_empty(device=device)  # FSDP2 re-points its shards (FSDPModule._apply)
        for m in module.modules():
            for kind in ("_parameters", "_buffers"):
                for n, t in getattr(m, kind).items():
                    if (id(m), n) in kept and t is not None:
                        _local(t).copy_(kept[(id(m), n)])
    del kept
    pending = _replay_init(module, meta, _rank0_rng(module))
    if pending:
        _refuse_forward_until_loaded(module, pending)
    return pending


def _rank0_rng(module: torch.nn.Module) -> torch.Tensor:
    state = next((m.__dict__[INIT_RNG_ATTR] for m in module.modules() if INIT_RNG_ATTR in m.__dict__), None)
    if state is None:
        state = torch.random.get_rng_state()  # built under torch.device("meta"): the state now
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [state]
        dist.broadcast_object_list(box, src=0)
        state = box[0]
    return state


def _replay_init(root: torch.nn.Module, meta: Set[Tuple[int, str]], rng: torch.Tensor) -> List[str]:
    hf_init = getattr(root, "_init_weights", None)
    hf_init = hf_init if callable(hf_init) else None
    pending: List[str] = []
    filled: Set[int] = set()  # the tensors a module's initialisation filled: a tied one only by its first user
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.random.set_rng_state(rng)
        for prefix, m in root.named_modules():
            own = [(kind, n) for kind in ("_parameters", "_buffers")
                   for n, t in getattr(m, kind).items() if t is not None and (id(m), n) in meta]
            if not own:
                continue
            reset = getattr(m, "reset_parameters", None)
            if not callable(reset) and hf_init is None:
                pending += [f"{prefix}.{n}" if prefix else n for kind, n in own
                            if id(getattr(m, kind)[n]) not in filled]
                continue
            _init_module(m, own, reset if callable(reset) else None, hf_init, filled)
    return pending


def _init_module(m: torch.nn.Module, own: List[Tuple[str, str]], reset: Any, hf_init: Any, filled: Set[int]) -> None:
    """Run ``m``'s initialisation on full temporary CPU tensors, then keep this process's slices
    of the tensors no earlier module filled (``filled``: their ids, updated)."""
    originals: Dict[Tuple[str, str], torch.Tensor] = {}
    for kind in ("_parameters", "_buffers"):
        for n, t in getattr(m, kind).items():
            if t is None:
                continue
            originals[(kind, n)] = t
            temp = torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu")
            getattr(m, kind)[n] = torch.nn.Parameter(temp, requires_grad=t.requires_grad) if kind == "_parameters" \
                else temp
    try:
        if reset is not None:
            reset()
        if hf_init is not None:
            hf_init(m)
        for key in own:
            if id(originals[key]) in filled:
                continue  # tied, and filled by its first user
            filled.add(id(originals[key]))
            full = getattr(m, key[0])[key[1]]
            _copy_into(originals[key], full.detach(), local_index(originals[key]), sliced=False)
    finally:
        for (kind, n), t in originals.items():
            getattr(m, kind)[n] = t


def _refuse_forward_until_loaded(root: torch.nn.Module, pending: List[str]) -> None:
    root.__dict__[PENDING_ATTR] = set(pending)

    def check(module: torch.nn.Module, args: Any) -> None:
        left = module.__dict__.get(PENDING_ATTR)
        if left:
            raise RuntimeError(
                f"{len(left)} tensors of this model were built on meta and no initialisation covers them "
                f"({sorted(left)[:5]}: their modules have no reset_parameters and the model no _init_weights); "
                "load them first, e.g. load_checkpoint_in_model(model, checkpoint), or give those modules a "
                "reset_parameters()")
        handle.remove()

    handle = root.register_forward_pre_hook(check)
    warnings.warn(f"{len(pending)} meta tensors have no initialisation ({pending[:5]}); they must come from a "
                  "checkpoint (load_checkpoint_in_model) before the first forward", stacklevel=4)


# ---- fill from a checkpoint ----------------------------------------------------------------------
def load_into_sharded(model: torch.nn.Module, checkpoint: Any, strict: bool = False, method: str = "slices") -> None:
    """Fill ``model``'s shards (FSDP2 DTensors; plain tensors get the whole value) from
    ``checkpoint`` (any layout :func:`~anyaccel.big_modeling.checkpoints.open_checkpoint` reads).
    ``method="slices"``: each process reads only the slices its shards cover (local reads, no
    communication; the default, see the module docstring). ``method="broadcast"``: rank 0 reads
    each tensor and broadcasts it; collective. A ``torch.distributed.checkpoint`` directory is
    resharded by DCP itself (collective). The checkpoint is checked against the model first:
    nothing is loaded when keys or shapes do not fit. A tied parameter is read once, under its first
    name the checkpoint has. Returns nothing; every rank gets its shards."""
    if method not in ("slices", "broadcast"):
        raise ValueError(f"method={method!r}; use 'slices' or 'broadcast'")
    reader = checkpoint if isinstance(checkpoint, CheckpointReader) else open_checkpoint(checkpoint)
    pending = model.__dict__.get(PENDING_ATTR, set())
    covered = check_checkpoint(model, reader, strict=strict, must_load=pending)
    state = model.state_dict(keep_vars=True)
    plan = _once_per_tensor(covered, state)
    with torch.no_grad():
        if reader.kind == "dcp":
            _load_dcp(reader, {k: state[k] for k in plan}, plan)
        elif method == "broadcast":
            _load_broadcast(reader, state, plan)
        else:
            for key, src in plan.items():
                index = local_index(state[key])
                local = _local(state[key])
                if local.numel() and not reader.read_into(src, index, local):
                    _copy_into(state[key], reader.read_slice(src, index), index, sliced=True)
    if pending:
        pending.difference_update(covered)


def _once_per_tensor(plan: Dict[str, str], state: Dict[str, torch.Tensor]) -> Dict[str, str]:
    """``plan`` with one entry per tensor: the names of a tied parameter after the first dropped
    (they hold the same tensor, which is filled once)."""
    seen: Set[int] = set()
    once: Dict[str, str] = {}
    for key, src in plan.items():
        if id(state[key]) not in seen:
            seen.add(id(state[key]))
            once[key] = src
    return once


def _load_dcp(reader: Any, targets: Dict[str, torch.Tensor], plan: Dict[str, str]) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    wanted: Dict[str, torch.Tensor] = {}
    for key, t in targets.items():
        stored = reader.dtype(plan[key])
        wanted[reader.prefix + plan[key]] = t if t.dtype == stored else None  # type: ignore[assignment]
    if any(v is None for v in wanted.values()):
        raise CheckpointError(f"{reader.path} stores other dtypes than the model's; convert the model "
                              "(model.to(dtype)) before loading a torch.distributed.checkpoint directory")
    try:
        dcp.load(wanted, checkpoint_id=reader.path, no_dist=not (dist.is_available() and dist.is_initialized()))
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"reading {reader.path} failed: {str(exc).strip().splitlines()[0][:300]}") from exc


def _load_broadcast(reader: CheckpointReader, state: Dict[str, torch.Tensor], plan: Dict[str, str]) -> None:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    for key, src in plan.items():
        target = state[key]
        buf: Optional[torch.Tensor]
        if rank == 0:
            buf = reader.read(src).to(_local(target).device)
        else:
            buf = torch.empty(reader.shape(src), dtype=reader.dtype(src), device=_local(target).device)
        if dist.is_initialized():
            dist.broadcast(buf, src=0)
        _copy_into(target, buf, local_index(target), sliced=False)
        del buf
