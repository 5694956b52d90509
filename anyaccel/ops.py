"""Collectives on tensors and nested structures (tuples, lists, dicts, namedtuples of tensors).

Every function here is *collective*: all ranks of the job must call it, in the same order, with
structures of the same layout. In a single process each one returns its input unchanged (or
shaped the way the multi-process result would be) and costs nothing.

The tensors travel on the transport of their device (:func:`anyaccel.backends.transport_for`):
torch.distributed (gloo or NCCL) for CPU/CUDA/MPS tensors, torch-xla between XLA replicas.

**Shape safety.** ``gather``, ``gather_uneven``, ``reduce``, ``broadcast``,
``pad_across_processes`` and ``barrier`` first exchange a 16-integer header: which operation this
is, this process's collective sequence number, the number of leaves, digests of the structure,
dtypes and shapes, and the sizes along the dimension that may differ. When ranks disagree —
different shapes (:class:`ShapeMismatchError`), or different operations or sequence numbers (one
rank in ``gather`` while another is in ``reduce``, or a collective ahead:
:class:`CollectiveMismatchError`) — **every** rank raises, naming each rank's side and call site,
instead of hanging or crashing inside gloo/NCCL. ``gather`` then moves all leaves in one fused
collective, so a checked gather costs two collectives whatever the number of leaves — and only
one when the data is small (up to 64 KiB per rank): then it travels in the header's own collective,
from the second call of a loop on (see ``_Inline`` in :mod:`anyaccel.backends.transport`), which
is what makes ``gather_for_metrics`` over an evaluation epoch cheaper than a hand-written
``all_gather`` loop. Pass ``check=False`` to skip the header in a hot loop you trust.

**Hangs.** Every collective here tells the hang doctor (:mod:`anyaccel.doctor`) which one it is;
when one fails after a peer left or after the process group's timeout, the error says which rank
left and where, or where every rank was.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar, cast

import torch

from . import doctor
from .backends import active_transport, transport_for
from .doctor import TRACKER
from .errors import CollectiveMismatchError, ShapeMismatchError
from .tree import flatten, map_tensors

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
]

REDUCTIONS = ("sum", "mean", "max", "min", "none")


def world_size() -> int:
    """Number of processes in the job (1 when there is no group). Local."""
    return active_transport().world_size()


def rank() -> int:
    """This process's rank in the job (0 when there is no group). Local."""
    return active_transport().rank()


_F = TypeVar("_F", bound=Callable[..., Any])


def _collective(op: str) -> Callable[[_F], _F]:
    """Mark a public collective: the hang doctor knows this process is in ``op`` (and its sequence
    number) while it runs, and when torch.distributed fails under it the error says what the
    doctor knows (the peer that left, or where every rank was)."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with doctor.waiting(op):
                return fn(*args, **kwargs)

        return cast(_F, run)  # the same signature as fn

    return decorate


@_collective("barrier")
def barrier() -> None:
    """Block until all ranks arrive (no-op in a single process). Collective; a header exchange,
    so a rank in a barrier while another is in a different collective raises on both."""
    transport = active_transport()
    if not transport.is_active():
        return
    if transport.checks_shapes:
        _exchange(transport, "barrier", [], "", [], sizes_must_match=True)
    else:
        transport.barrier()


# --------------------------------------------------------------------------------------------
# The header
# --------------------------------------------------------------------------------------------

_HEADER_LEN = 16
_FIXED = 5  # op, sequence number (reserved), leaf count, layout digest, full digest
_MAX_SIZES = _HEADER_LEN - _FIXED
_OPS = {1: "gather", 2: "gather_uneven", 3: "reduce", 4: "broadcast", 5: "pad_across_processes", 6: "barrier",
        7: "gather_object", 8: "broadcast_object_list"}
_OP_CODES = {name: code for code, name in _OPS.items()}
_DIGESTS: Dict[Tuple, Tuple[int, int]] = {}


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _digests(leaves: Sequence[torch.Tensor], sig: str, free: Sequence[Optional[int]]) -> Tuple[int, int]:
    """(digest of everything that must match — structure, dtypes, shapes except each leaf's free
    dimension; digest of the full shapes). Cached: the same layout recurs every step."""
    shapes = tuple((tuple(t.shape), t.dtype) for t in leaves)
    key = (sig, shapes, tuple(free))
    found = _DIGESTS.get(key)
    if found is None:
        layout = "|".join(f"{_without(shape, d)}:{len(shape)}:{dtype}" for (shape, dtype), d in zip(shapes, free))
        full = "|".join(f"{shape}:{dtype}" for shape, dtype in shapes)
        if len(_DIGESTS) > 1024:
            _DIGESTS.clear()
        found = _DIGESTS[key] = (_digest(sig + "#" + layout), _digest(sig + "#" + full))
    return found


def _without(shape: Tuple[int, ...], dim: Optional[int]) -> Tuple[int, ...]:
    return shape if dim is None else shape[:dim] + shape[dim + 1 :]


def _exchange(transport: Any, op: str, leaves: Sequence[torch.Tensor], sig: str, free: Sequence[Optional[int]],
              sizes_must_match: bool, carry: Sequence[torch.Tensor] = ()) -> Tuple[List[List[int]], Any]:
    """Exchange headers; raise :class:`ShapeMismatchError` on every rank when ranks disagree.
    Returns, per leaf, every rank's size along its free dimension (None entries for leaves
    without one, and for leaves past the header's room, which ``pad_across_processes`` then
    exchanges separately), and the transport's ``unpack`` when ``carry`` travelled with the
    headers (see :meth:`~anyaccel.backends.transport.Transport.gather_with_header`), else None."""
    rows, unpack = transport.gather_with_header(_header(op, leaves, sig, free), carry)
    return _check(transport, op, leaves, rows, sizes_must_match), unpack


def _header(op: str, leaves: Sequence[torch.Tensor], sig: str, free: Sequence[Optional[int]]) -> List[int]:
    layout, full = _digests(leaves, sig, free)
    values = [_OP_CODES[op], TRACKER.seq, len(leaves), layout, full]
    values += [(t.shape[d] if d is not None else -1) for t, d in zip(leaves[:_MAX_SIZES], free)]
    values += [-1] * (_HEADER_LEN - len(values))
    return values


def _check(transport: Any, op: str, leaves: Sequence[torch.Tensor], rows: List[List[int]],
           sizes_must_match: bool) -> List[List[int]]:
    """Raise on every rank when the gathered header ``rows`` disagree (see :func:`_exchange`)."""
    first = rows[0]
    if any(r[0] != first[0] or r[1] != first[1] for r in rows):
        sites = transport.gather_object(doctor.call_site(sys._getframe(2)))
        detail = "; ".join(f"rank {i}: {_OPS.get(r[0], 'unknown')}() at {sites[i]} (its collective #{r[1]})"
                           for i, r in enumerate(rows))
        raise CollectiveMismatchError(
            f"ranks reached different collectives at the same point — {detail}. Every rank must call the "
            "same collectives in the same order (look for a collective inside `if accelerator.is_main_process:`, "
            "a rank that returned early, or a loop that runs a different number of times on each rank)."
        )
    if any(r[2] != first[2] or r[3] != first[3] for r in rows):
        _raise_mismatch(transport, op, leaves, "structure, dtypes and shapes")
    if sizes_must_match and any(r[4] != first[4] for r in rows):
        _raise_mismatch(transport, op, leaves, "shapes and dtypes")
    return [[r[_FIXED + i] for r in rows] if i < _MAX_SIZES else None for i in range(len(leaves))]


def _checked_gather(transport: Any, op: str, leaves: Sequence[torch.Tensor], sig: str,
                    sizes_must_match: bool) -> List[torch.Tensor]:
    """A shape-checked gather along dim 0: the header, and the data in the same collective when
    the transport could carry it there (small data, from the second call of a loop on), else in a
    second one sized from the headers. The checks are the same either way."""
    carry = leaves if len(leaves) <= _MAX_SIZES else ()  # the sizes to unpack come from the header
    sizes, unpack = _exchange(transport, op, leaves, sig, [0] * len(leaves), sizes_must_match, carry)
    if unpack is not None:
        return unpack(sizes)
    if sizes_must_match:
        sizes = [[t.shape[0]] * transport.world_size() for t in leaves]
    else:  # past the header's room: asked separately
        sizes = [s if s is not None else _sizes(transport, t, 0) for s, t in zip(sizes, leaves)]
    return transport.gather(leaves, sizes)


def _describe(leaves: Sequence[torch.Tensor]) -> str:
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in leaves) or "nothing"


def _raise_mismatch(transport: Any, op: str, leaves: Sequence[torch.Tensor], what: str) -> None:
    detail = "; ".join(f"rank {r}: {s}" for r, s in enumerate(transport.gather_object(_describe(leaves))))
    if op == "gather":
        advice = "Use pad_across_processes() first, or gather_for_metrics() which accepts different batch sizes."
    elif op == "pad_across_processes":
        advice = "Only the padded dimension may differ; every other dimension and the dtype must match."
    else:
        advice = "Make every rank pass tensors of identical shape."
    raise ShapeMismatchError(f"{op}() needs the same {what} on every process, but they differ — {detail}. {advice}")


# --------------------------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------------------------


def _as_rows(leaves: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    return [t.unsqueeze(0) if t.dim() == 0 else t for t in leaves]


def _transport(leaves: Sequence[torch.Tensor]) -> Any:
    return transport_for(leaves[0].device.type) if leaves else active_transport()


@_collective("gather")
def gather(data: Any, check: bool = True) -> Any:
    """All-gather ``data`` (a tensor or nested structure of tensors) and concatenate along dim 0.

    Collective; **every rank** receives the full result, ordered by rank. 0-d tensors become
    1-d of length ``world_size``. Shapes must match on all ranks (else :class:`ShapeMismatchError`
    on every rank).
    """
    leaves, build, sig = flatten(data)
    leaves = _as_rows(leaves)
    transport = _transport(leaves)
    if not leaves or not transport.is_active():
        return build(leaves)
    if check and transport.checks_shapes:
        return build(_checked_gather(transport, "gather", leaves, sig, sizes_must_match=True))
    return build(transport.gather(leaves, None))


@_collective("gather_uneven")
def gather_uneven(data: Any) -> Any:
    """Like :func:`gather`, but ranks may hold different sizes along dim 0 (other dimensions must
    match). Collective; every rank receives the concatenation without any padding. Used by
    ``gather_for_metrics`` for the last, shorter batches of an epoch."""
    leaves, build, sig = flatten(data)
    leaves = _as_rows(leaves)
    transport = _transport(leaves)
    if not leaves or not transport.is_active():
        return build(leaves)
    if not transport.checks_shapes:
        return build(transport.gather(leaves, None))
    return build(_checked_gather(transport, "gather_uneven", leaves, sig, sizes_must_match=False))


@_collective("gather_object")
def gather_object(obj: Any) -> List[Any]:
    """Gather any picklable object from every rank. Collective; every rank receives the result.

    A list is concatenated over ranks (Accelerate's behaviour); anything else comes back as a
    list with one entry per rank, ordered by rank.
    """
    transport = active_transport()
    per_rank = transport.gather_object(obj) if transport.is_active() else [obj]
    if isinstance(obj, list):
        return [x for part in per_rank for x in part]
    return per_rank


@_collective("reduce")
def reduce(data: Any, reduction: str = "sum", scale: float = 1.0, check: bool = True) -> Any:
    """All-reduce ``data`` with ``reduction`` = ``"sum"`` | ``"mean"`` | ``"max"`` | ``"min"`` |
    ``"none"``, times ``scale``.

    Collective; every rank receives the same result (``"none"`` only scales, locally). ``"mean"``
    on integer tensors returns floats. Shapes must match on all ranks (else
    :class:`ShapeMismatchError` on every rank). The input is never modified.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(map(repr, REDUCTIONS))}; got {reduction!r}")
    leaves, build, sig = flatten(data)
    if reduction == "none":
        return build([t * scale if scale != 1.0 else t for t in leaves])
    transport = _transport(leaves)
    active = bool(leaves) and transport.is_active()
    if active and check and transport.checks_shapes:
        _exchange(transport, "reduce", leaves, sig, [None] * len(leaves), sizes_must_match=True)
    n = transport.world_size() if active else 1
    out = []
    for t in leaves:
        if reduction == "mean" and not (t.is_floating_point() or t.is_complex()):
            t = t.float()
        buf = transport.all_reduce(t, "sum" if reduction == "mean" else reduction) if active else t.clone()
        if reduction == "mean" and n > 1:
            buf = buf / n
        if scale != 1.0:
            buf = buf * scale
        out.append(buf)
    return build(out)


@_collective("broadcast")
def broadcast(data: Any, from_process: int = 0, check: bool = True) -> Any:
    """Send ``data`` from rank ``from_process`` to all ranks. Collective; every rank must pass a
    structure of the same shapes (its values are not modified) and receives rank
    ``from_process``'s values."""
    leaves, build, sig = flatten(data)
    transport = _transport(leaves)
    if not leaves or not transport.is_active():
        return data
    if check and transport.checks_shapes:
        _exchange(transport, "broadcast", leaves, sig, [None] * len(leaves), sizes_must_match=True)
    return build([transport.broadcast(t, from_process) for t in leaves])


@_collective("broadcast_object_list")
def broadcast_object_list(objects: List[Any], from_process: int = 0) -> List[Any]:
    """Replace, in place, the items of ``objects`` on every rank by rank ``from_process``'s items.
    Collective; returns the list."""
    transport = active_transport()
    if transport.is_active():
        transport.broadcast_object_list(objects, from_process)
    return objects


def _sizes(transport: Any, t: torch.Tensor, dim: int) -> List[int]:
    return [int(x) for x in transport.gather_object(int(t.shape[dim]))]


def _pad_dim(t: torch.Tensor, dim: int, target: int, pad_index: Any, pad_first: bool) -> torch.Tensor:
    if t.shape[dim] >= target:
        return t
    shape = list(t.shape)
    shape[dim] = target - t.shape[dim]
    pad = t.new_full(shape, pad_index)
    return torch.cat([pad, t] if pad_first else [t, pad], dim=dim)


@_collective("pad_across_processes")
def pad_across_processes(data: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """Pad each tensor in ``data`` along ``dim`` to the largest size any rank has, with
    ``pad_index``, at the end (or at the start with ``pad_first``), so it can be gathered.
    Tensors with fewer dimensions than ``dim`` (and 0-d tensors) are returned as they are.

    Collective; each rank receives its own padded data. Every dimension other than ``dim`` and
    the dtypes must match across ranks (else :class:`ShapeMismatchError` on every rank).
    """
    leaves, build, sig = flatten(data)
    transport = _transport(leaves)
    if not leaves or not transport.is_active():
        return data
    free = [dim % t.dim() if t.dim() and -t.dim() <= dim < t.dim() else None for t in leaves]
    if transport.checks_shapes:
        sizes, _ = _exchange(transport, "pad_across_processes", leaves, sig, free, sizes_must_match=False)
    else:
        sizes = [None] * len(leaves)
    out = []
    for t, d, per_rank in zip(leaves, free, sizes):
        if d is None:
            out.append(t)
            continue
        per_rank = per_rank if per_rank is not None else _sizes(transport, t, d)
        out.append(_pad_dim(t, d, max(per_rank), pad_index, pad_first))
    return build(out)


def drop_padding(data: Any, total: int, real: int) -> Any:
    """Cut gathered tensors of ``total`` rows (an epoch's last, padded round) to their ``real``
    first rows. Local."""
    return map_tensors(lambda t: t[:real] if t.dim() and t.shape[0] == total else t, data)
