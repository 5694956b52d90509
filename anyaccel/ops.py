"""Collectives on tensors and nested structures (tuples, lists, dicts, namedtuples of tensors).

Every function here is *collective*: all ranks of the default process group must call it, in the
same order, with structures of the same layout. In a single process each one returns its input
unchanged (or wrapped the way the multi-process result would be) and costs nothing.

Shape safety: ``gather``, ``reduce`` and ``broadcast`` first exchange a 16-integer header
describing the leaves (count, a digest of shapes and dtypes, the first dimensions). When ranks
disagree, **every** rank raises :class:`ShapeMismatchError` naming each rank's shapes, instead of
hanging or crashing inside gloo/NCCL. The header costs one extra tiny all-gather per call
(measured in ``benchmarks/``); pass ``check=False`` to skip it in a hot loop you trust.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, List, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "ShapeMismatchError",
    "world_size",
    "rank",
    "gather",
    "gather_uneven",
    "gather_object",
    "reduce",
    "broadcast",
    "broadcast_object_list",
    "pad_across_processes",
    "barrier",
    "tree_flatten",
    "tree_unflatten",
]

_HEADER_LEN = 16
_MAX_DIM0 = _HEADER_LEN - 3


class ShapeMismatchError(RuntimeError):
    """Raised on every rank when a collective is called with different shapes on different ranks."""


# --------------------------------------------------------------------------------------------
# Group helpers
# --------------------------------------------------------------------------------------------


def world_size() -> int:
    """Size of the default process group (1 when there is none)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    xla = _xla_world_size()
    return xla


def rank() -> int:
    """Rank of this process in the default group (0 when there is none)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    if _xla_world_size() > 1:  # pragma: no cover - XLA
        from .backends import xla

        return xla.rank()
    return 0


def _xla_world_size() -> int:
    import sys

    if "torch_xla" not in sys.modules:
        return 1
    from .backends import xla

    return xla.world_size()


def barrier() -> None:
    """Block until all ranks arrive (no-op in a single process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    elif world_size() > 1:  # pragma: no cover - XLA
        from .backends import xla

        xla.rendezvous("anyaccel.barrier")


# --------------------------------------------------------------------------------------------
# Nested structures
# --------------------------------------------------------------------------------------------


def tree_flatten(data: Any) -> Tuple[List[torch.Tensor], Callable[[Sequence[Any]], Any], str]:
    """Split ``data`` into its tensor leaves, a function rebuilding the structure from new leaves,
    and a short text signature of the structure (keys and container types)."""
    leaves: List[torch.Tensor] = []
    sig: List[str] = []

    def visit(node):
        if isinstance(node, torch.Tensor):
            leaves.append(node)
            sig.append("T")
            idx = len(leaves) - 1
            return lambda new: new[idx]
        if isinstance(node, dict):
            sig.append("{" + ",".join(map(str, node.keys())) + "}")
            builders = [(k, visit(v)) for k, v in node.items()]

            def build_dict(new, _t=type(node)):
                out = {k: b(new) for k, b in builders}
                try:
                    return out if _t is dict else _t(out)
                except TypeError:
                    return out

            return build_dict
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            sig.append("N" + type(node).__name__)
            builders = [visit(v) for v in node]
            return lambda new, _t=type(node): _t(*(b(new) for b in builders))
        if isinstance(node, (list, tuple)):
            sig.append(("L" if isinstance(node, list) else "U") + str(len(node)))
            builders = [visit(v) for v in node]
            return lambda new, _t=type(node): _t(b(new) for b in builders)
        raise TypeError(
            f"collectives take tensors or tuples/lists/dicts of tensors; found {type(node).__name__}. "
            "Use gather_object() for other Python objects."
        )

    build = visit(data)
    return leaves, build, "".join(sig)


def tree_unflatten(build: Callable[[Sequence[Any]], Any], leaves: Sequence[Any]) -> Any:
    return build(leaves)


# --------------------------------------------------------------------------------------------
# Shape header
# --------------------------------------------------------------------------------------------


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _describe(leaves: Sequence[torch.Tensor]) -> str:
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in leaves) or "nothing"


def _header(leaves: Sequence[torch.Tensor], sig: str, device: torch.device) -> torch.Tensor:
    tail = "|".join(f"{tuple(t.shape[1:])}:{t.dim()}:{t.dtype}" for t in leaves)
    full = "|".join(f"{tuple(t.shape)}:{t.dtype}" for t in leaves)
    values = [len(leaves), _digest(sig + "#" + tail), _digest(sig + "#" + full)]
    values += [(t.shape[0] if t.dim() else 1) for t in leaves[:_MAX_DIM0]]
    values += [-1] * (_HEADER_LEN - len(values))
    return torch.tensor(values, dtype=torch.int64, device=device)


def _comm_device(t: torch.Tensor) -> torch.device:
    """Where a collective over ``t`` must run: NCCL needs CUDA tensors, gloo wants CPU ones."""
    backend = dist.get_backend()
    if backend == "nccl":
        return t.device if t.device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _exchange_headers(leaves, sig, device) -> torch.Tensor:
    mine = _header(leaves, sig, device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return torch.stack(out).cpu()


def _raise_mismatch(op: str, leaves, what: str) -> None:
    shapes: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, _describe(leaves))
    detail = "; ".join(f"rank {r}: {s}" for r, s in enumerate(shapes))
    raise ShapeMismatchError(
        f"{op}() needs the same {what} on every process, but they differ — {detail}. "
        + (
            "Use pad_across_processes() first, or gather_for_metrics() which accepts different batch sizes."
            if op == "gather"
            else "Make every rank pass tensors of identical shape."
        )
    )


def _check(op: str, leaves, sig, device, allow_dim0: bool) -> torch.Tensor:
    headers = _exchange_headers(leaves, sig, device)
    if not bool((headers[:, 0] == headers[0, 0]).all()) or not bool((headers[:, 1] == headers[0, 1]).all()):
        _raise_mismatch(op, leaves, "structure, dtypes and shapes" if allow_dim0 else "shapes and dtypes")
    if not allow_dim0 and not bool((headers[:, 2] == headers[0, 2]).all()):
        _raise_mismatch(op, leaves, "shapes and dtypes")
    return headers


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _is_xla(leaves) -> bool:
    return bool(leaves) and leaves[0].device.type == "xla"


# --------------------------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------------------------


# dtypes gloo has no collectives for ("Invalid scalar type"): sent widened, then cast back.
_WIDEN = {torch.int16: torch.int32}
for _name, _wide in (("uint16", torch.int32), ("uint32", torch.int64)):
    if hasattr(torch, _name):
        _WIDEN[getattr(torch, _name)] = _wide


def _all_gather_cat(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 0:
        t = t.unsqueeze(0)
    device = _comm_device(t)
    wide = _WIDEN.get(t.dtype) if device.type == "cpu" else None
    src = (t.to(device, wide) if wide is not None else t.to(device)).contiguous()
    out = [torch.empty_like(src) for _ in range(dist.get_world_size())]
    dist.all_gather(out, src)
    result = torch.cat(out, dim=0)
    return result.to(t.device, t.dtype) if wide is not None else result.to(t.device)


def gather(data: Any, check: bool = True) -> Any:
    """All-gather ``data`` (a tensor or nested structure of tensors) and concatenate along dim 0.

    Collective; **every rank** receives the full result, ordered by rank. 0-d tensors become
    1-d of length ``world_size``. Shapes must match on all ranks (else :class:`ShapeMismatchError`
    on every rank).
    """
    leaves, build, sig = tree_flatten(data)
    if _is_xla(leaves):  # pragma: no cover - needs torch-xla
        from .backends import xla

        return build([xla.all_gather(t) for t in leaves])
    if not _is_dist():
        return build([t.unsqueeze(0) if t.dim() == 0 else t for t in leaves])
    if check and leaves:
        _check("gather", leaves, sig, _comm_device(leaves[0]), allow_dim0=False)
    return build([_all_gather_cat(t) for t in leaves])


def gather_uneven(data: Any) -> Any:
    """Like :func:`gather`, but ranks may hold different sizes along dim 0 (other dimensions must
    match). Collective; every rank receives the concatenation without any padding. Used by
    ``gather_for_metrics`` for the last, shorter batches of an epoch."""
    leaves, build, sig = tree_flatten(data)
    if _is_xla(leaves):  # pragma: no cover - needs torch-xla
        from .backends import xla

        return build([xla.all_gather_uneven(t) for t in leaves])
    if not _is_dist() or not leaves:
        return build([t.unsqueeze(0) if t.dim() == 0 else t for t in leaves])
    leaves = [t.unsqueeze(0) if t.dim() == 0 else t for t in leaves]
    headers = _check("gather", leaves, sig, _comm_device(leaves[0]), allow_dim0=True)
    if bool((headers[:, 2] == headers[0, 2]).all()):
        return build([_all_gather_cat(t) for t in leaves])
    out = []
    for i, t in enumerate(leaves):
        if i < _MAX_DIM0:
            sizes = headers[:, 3 + i].tolist()
        else:
            sizes = _gather_sizes(t, 0)
        padded = _pad_dim(t, 0, max(sizes), 0, False)
        full = _all_gather_cat(padded)
        step = max(sizes)
        out.append(torch.cat([full[r * step : r * step + n] for r, n in enumerate(sizes)], dim=0))
    return build(out)


def gather_object(obj: Any) -> List[Any]:
    """Gather any picklable object from every rank. Collective; every rank receives the result.

    A list is concatenated over ranks (Accelerate's behaviour); anything else comes back as a
    list with one entry per rank, ordered by rank.
    """
    if not _is_dist():
        if world_size() > 1:  # pragma: no cover - XLA
            from .backends import xla

            per_rank = xla.gather_object(obj)
        else:
            per_rank = [obj]
    else:
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, obj)
    if isinstance(obj, list):
        return [x for part in per_rank for x in part]
    return per_rank


def reduce(data: Any, reduction: str = "sum", scale: float = 1.0, check: bool = True) -> Any:
    """All-reduce ``data`` with ``reduction`` = ``"sum"`` | ``"mean"`` | ``"none"``, times ``scale``.

    Collective; every rank receives the same result. ``"mean"`` on integer tensors returns floats.
    Shapes must match on all ranks (else :class:`ShapeMismatchError` on every rank).
    """
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}")
    leaves, build, sig = tree_flatten(data)
    if reduction == "none":
        return build([t * scale if scale != 1.0 else t for t in leaves])
    if _is_xla(leaves):  # pragma: no cover - needs torch-xla
        from .backends import xla

        return build([xla.all_reduce(t, reduction, scale) for t in leaves])
    n = world_size()
    if _is_dist() and check and leaves:
        _check("reduce", leaves, sig, _comm_device(leaves[0]), allow_dim0=False)
    out = []
    for t in leaves:
        if reduction == "mean" and not (t.is_floating_point() or t.is_complex()):
            t = t.float()
        if _is_dist():
            device = _comm_device(t)
            buf = t.detach().to(device, copy=True).contiguous()
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            buf = buf.to(t.device)
        else:
            buf = t.clone()
        if reduction == "mean":
            buf = buf / n
        if scale != 1.0:
            buf = buf * scale
        out.append(buf)
    return build(out)


def broadcast(data: Any, from_process: int = 0, check: bool = True) -> Any:
    """Send ``data`` from rank ``from_process`` to all ranks. Collective; every rank must pass a
    structure of the same shapes (its values are overwritten) and receives rank
    ``from_process``'s values."""
    leaves, build, sig = tree_flatten(data)
    if _is_xla(leaves):  # pragma: no cover - needs torch-xla
        from .backends import xla

        return build([xla.broadcast(t, from_process) for t in leaves])
    if not _is_dist():
        return data
    if check and leaves:
        _check("broadcast", leaves, sig, _comm_device(leaves[0]), allow_dim0=False)
    out = []
    for t in leaves:
        device = _comm_device(t)
        buf = t.detach().to(device, copy=True).contiguous()
        dist.broadcast(buf, src=from_process)
        out.append(buf.to(t.device))
    return build(out)


def broadcast_object_list(objects: List[Any], from_process: int = 0) -> List[Any]:
    """Replace, in place, the items of ``objects`` on every rank by rank ``from_process``'s items.
    Collective; returns the list."""
    if _is_dist():
        dist.broadcast_object_list(objects, src=from_process)
    elif world_size() > 1:  # pragma: no cover - XLA
        from .backends import xla

        objects[:] = xla.broadcast_object_list(objects, from_process)
    return objects


def _gather_sizes(t: torch.Tensor, dim: int) -> List[int]:
    device = _comm_device(t)
    size = torch.tensor([t.shape[dim]], dtype=torch.int64, device=device)
    out = [torch.empty_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(out, size)
    return [int(s.item()) for s in out]


def _pad_dim(t: torch.Tensor, dim: int, target: int, pad_index: Any, pad_first: bool) -> torch.Tensor:
    if t.shape[dim] >= target:
        return t
    shape = list(t.shape)
    shape[dim] = target - t.shape[dim]
    pad = t.new_full(shape, pad_index)
    return torch.cat([pad, t] if pad_first else [t, pad], dim=dim)


def pad_across_processes(data: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """Pad each tensor in ``data`` along ``dim`` to the largest size any rank has, with
    ``pad_index``, at the end (or at the start with ``pad_first``), so it can be gathered.

    Collective (one small all-gather of sizes per tensor); each rank receives its own padded data.
    """
    leaves, build, _ = tree_flatten(data)
    on_xla = _is_xla(leaves) and world_size() > 1
    if not _is_dist() and not on_xla:
        return data
    out = []
    for t in leaves:
        if t.dim() == 0 or dim >= t.dim() or dim < -t.dim():
            out.append(t)
            continue
        d = dim % t.dim()
        if on_xla:  # pragma: no cover - XLA
            from .backends import xla

            sizes = xla.gather_sizes(t, d)
        else:
            sizes = _gather_sizes(t, d)
        out.append(_pad_dim(t, d, max(sizes), pad_index, pad_first))
    return build(out)
