"""Prototypes of changes proposed for ``anyaccel/ops.py`` (owned by the library, not by the
benchmarks), measured next to the current code by ``python -m benchmarks --only gather,gfm``
so the proposal comes with a number. Same semantics as the library functions they shadow:

* :func:`gather` -- ``ops.gather(data, check=True)``: the shape-check header is cached per
  (structure, shapes, dtypes) instead of re-formatted and re-hashed each call, exchanged with
  ``all_gather_into_tensor`` into one tensor and compared as Python lists (one ``tolist()``
  instead of three tensor comparisons and a ``stack``); a single leaf is gathered straight into
  its result (no ``torch.cat``), several leaves travel in **one** fused byte buffer, so a call
  costs 2 collectives whatever the number of leaves. Travelling as bytes also makes int16
  tensors work on gloo (``ops.gather`` raised "Invalid scalar type" for them; it now widens them for transport).
* :func:`gather_uneven` -- the same for ranks holding different dim-0 sizes (what
  ``gather_for_metrics`` uses): each leaf is padded to the largest size (known from the header),
  all leaves travel in one buffer, the padding is cut out on arrival.
* :func:`gather_for_metrics` -- ``Accelerator.gather_for_metrics`` on top of that.
* :func:`fast_plan` -- ``ShardedBatchSampler._plan`` (anyaccel/data.py) with tensor views: the
  per-epoch cost of computing a shard of a large dataset drops below DistributedSampler's.

Multi-process only (a process group must exist); leaves must be contiguous-able tensors.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from anyaccel import ops

_HEADERS: Dict[Tuple, torch.Tensor] = {}
_ALIGN = 8  # bytes: every leaf starts at an offset where any dtype can be viewed
# gloo has no collectives for these ("RuntimeError: Invalid scalar type"; ops.gather now widens them):
# they always travel as bytes.
_BYTES_ONLY = {torch.int16, getattr(torch, "uint16", None), getattr(torch, "uint32", None), getattr(torch, "uint64", None)}


def _header(leaves, sig: str) -> torch.Tensor:
    key = (sig, tuple((tuple(t.shape), t.dtype) for t in leaves))
    h = _HEADERS.get(key)
    if h is None:
        if len(_HEADERS) > 1024:
            _HEADERS.clear()
        h = _HEADERS[key] = ops._header(leaves, sig, torch.device("cpu"))
    return h


def _exchange(leaves, sig: str, op: str, allow_dim0: bool) -> List[List[int]]:
    world = dist.get_world_size()
    mine = _header(leaves, sig)
    out = torch.empty(world * mine.numel(), dtype=mine.dtype)
    dist.all_gather_into_tensor(out, mine)
    rows = out.view(world, -1).tolist()
    first = rows[0]
    if any(r[0] != first[0] or r[1] != first[1] for r in rows):
        ops._raise_mismatch(op, leaves, "structure, dtypes and shapes" if allow_dim0 else "shapes and dtypes")
    if not allow_dim0 and any(r[2] != first[2] for r in rows):
        ops._raise_mismatch(op, leaves, "shapes and dtypes")
    return rows


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    b = t.contiguous().reshape(-1).view(torch.uint8)
    pad = (-b.numel()) % _ALIGN
    return torch.cat([b, b.new_zeros(pad)]) if pad else b


def _single(t: torch.Tensor, sizes: List[int]) -> torch.Tensor:
    """One leaf: all-gather straight into the result (no byte packing); cut padding if uneven."""
    world = len(sizes)
    m = max(sizes)
    if t.shape[0] < m:
        t = torch.cat([t, t.new_zeros((m - t.shape[0],) + tuple(t.shape[1:]))])
    out = torch.empty((world * m,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t.contiguous())
    if all(n == m for n in sizes):
        return out
    return torch.cat([out[r * m: r * m + n] for r, n in enumerate(sizes)])


def _fused(leaves, dim0: List[List[int]]) -> List[torch.Tensor]:
    """All-gather ``leaves`` (rank r's leaf i has ``dim0[i][r]`` rows) in one collective."""
    if len(leaves) == 1 and leaves[0].dtype not in _BYTES_ONLY:
        return [_single(leaves[0], dim0[0])]
    world = dist.get_world_size()
    padded, spans = [], []
    for t, sizes in zip(leaves, dim0):
        m = max(sizes)
        if t.shape[0] < m:
            t = torch.cat([t, t.new_zeros((m - t.shape[0],) + tuple(t.shape[1:]))])
        b = _as_bytes(t)
        padded.append(b)
        spans.append((b.numel(), t.shape, t.dtype, t.numel()))
    payload = torch.cat(padded)
    out = torch.empty(world * payload.numel(), dtype=torch.uint8)
    dist.all_gather_into_tensor(out, payload)
    out = out.view(world, -1)
    result, offset = [], 0
    for (nbytes, shape, dtype, numel), sizes in zip(spans, dim0):
        block = out[:, offset: offset + nbytes].contiguous().view(dtype)[:, :numel]  # (world, numel)
        m = shape[0]
        full = block.reshape((world * m,) + tuple(shape[1:]))
        if all(n == m for n in sizes):
            result.append(full)
        else:
            result.append(torch.cat([full[r * m: r * m + n] for r, n in enumerate(sizes)]))
        offset += nbytes
    return result


def gather(data: Any) -> Any:
    """``ops.gather(data)`` (shape-checked, equal shapes on all ranks) in 2 collectives."""
    leaves, build, sig = ops.tree_flatten(data)
    leaves = [t.unsqueeze(0) if t.dim() == 0 else t for t in leaves]
    rows = _exchange(leaves, sig, "gather", allow_dim0=False)
    world = len(rows)
    return build(_fused(leaves, [[t.shape[0]] * world for t in leaves]))


def gather_uneven(data: Any) -> Any:
    """``ops.gather_uneven(data)`` in 2 collectives (falls back beyond the header's 13 sizes)."""
    leaves, build, sig = ops.tree_flatten(data)
    if len(leaves) > ops._MAX_DIM0 or not leaves:
        return ops.gather_uneven(data)
    leaves = [t.unsqueeze(0) if t.dim() == 0 else t for t in leaves]
    rows = _exchange(leaves, sig, "gather", allow_dim0=True)
    return build(_fused(leaves, [[r[3 + i] for r in rows] for i in range(len(leaves))]))


def gather_for_metrics(accelerator: Any, data: Any) -> Any:
    """``accelerator.gather_for_metrics(data)`` for tensors, with the fused gather."""
    loader = accelerator.gradient_state.active_loader
    gathered = gather_uneven(data)
    if loader is not None and loader.end_of_dataloader and loader.last_round_total:
        total, real = loader.last_round_total, loader.last_round_real
        from anyaccel.nested import map_tensors

        gathered = map_tensors(lambda t: t[:real] if t.dim() and t.shape[0] == total else t, gathered)
    return gathered


# ---------------------------------------------------------------------------------------------
# anyaccel/data.py: plan an epoch's shard with tensor views instead of Python list slicing
# ---------------------------------------------------------------------------------------------


def fast_plan(self) -> List[List[int]]:
    """Drop-in for ``ShardedBatchSampler._plan`` (same batches, same padding bookkeeping) for a
    ``RandomSampler`` without replacement or a ``SequentialSampler``: rank ``r``'s full rounds are
    ``order.view(rounds, W, b)[:, r]`` -- one ``tolist()`` of this rank's share instead of a
    ``tolist()`` of the whole permutation plus one Python slice per batch. Other samplers fall
    back to the original code."""
    from torch.utils.data import RandomSampler, SequentialSampler

    from anyaccel.data import ShardedBatchSampler

    base = self.base
    if self.batches_given or not isinstance(base, (RandomSampler, SequentialSampler)) or (
        isinstance(base, RandomSampler) and (base.replacement or base.num_samples != len(base.data_source))
    ):
        return ShardedBatchSampler._plan(self)
    n = len(base.data_source)
    if isinstance(base, RandomSampler):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
    else:
        order = torch.arange(n)
    w, r, b = self.num_replicas, self.rank, self.batch_size
    per_round = w * b
    full = n // per_round
    mine = order[: full * per_round].view(full, w, b)[:, r].tolist()
    self.last_round_real = self.last_round_total = 0
    m = n - full * per_round
    if m and not self.drop_last:
        per = -(-m // w)
        need = per * w - m
        ring = order[full * per_round:].tolist() + [int(order[i % n]) for i in range(need)]
        mine.append(ring[r * per: (r + 1) * per])
        self.last_round_real, self.last_round_total = m, per * w
    return mine


def use_fast_plan(prepared_loader: Any) -> Any:
    """Make an anyaccel ``PreparedDataLoader`` plan its epochs with :func:`fast_plan`."""
    sampler = prepared_loader.batch_sampler
    sampler._plan = fast_plan.__get__(sampler)
    return prepared_loader
