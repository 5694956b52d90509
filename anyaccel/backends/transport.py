"""How collectives travel between processes: the transport interface and torch.distributed's.

:mod:`anyaccel.ops` does the bookkeeping (nested structures, the shape header, padding) and hands
flat lists of tensors to a :class:`Transport`. :class:`C10dTransport` serves CPU, CUDA and MPS
tensors over torch.distributed (gloo or NCCL); XLA has its own in :mod:`anyaccel.backends.xla`.

Every method is **collective**: all ranks call it in the same order with matching tensors, and
each receives the result. A transport holds no state of its own (the process group is torch's),
except the size of the region that lets a small gather travel with its shape header
(:class:`_Inline`), which every rank derives from the same exchanged headers.

The fused gather (:meth:`C10dTransport.gather`): one leaf is gathered straight into its result;
several leaves are packed into **one** byte buffer, so a call costs one collective whatever the
number of leaves, and dtypes gloo has no collectives for (int16, uint16, uint32, uint64) travel
as bytes too. Ranks may hold different dim-0 sizes (``sizes``): each leaf is padded to the largest,
and the padding is cut out on arrival.
"""

from __future__ import annotations

import array
import io
import pickle
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["Transport", "C10dTransport", "REDUCE_OPS"]

REDUCE_OPS = ("sum", "max", "min")
_ALIGN = 16  # bytes: every leaf starts at an offset where any dtype (complex128 too) can be viewed


class Transport:
    """The collective primitives ``ops`` needs. ``sizes[i][r]`` is rank ``r``'s dim-0 size of
    leaf ``i`` (from the shape header); ``None`` when the transport must find out itself."""

    #: whether ``ops`` exchanges the shape header before a collective on this transport
    checks_shapes: bool = True
    #: whether tensors inside gathered objects arrive on the receiving rank's device (XLA's
    #: object collectives hand them back on the CPU)
    objects_keep_device: bool = True

    def is_active(self) -> bool:
        """True when several processes take part (else ``ops`` short-cuts to the local result)."""
        raise NotImplementedError

    def world_size(self) -> int:
        raise NotImplementedError

    def rank(self) -> int:
        raise NotImplementedError

    def gather_rows(self, row: torch.Tensor) -> List[List[int]]:
        """All-gather a small 1-d int64 tensor; every rank receives each rank's values as a list."""
        raise NotImplementedError

    def gather(self, leaves: Sequence[torch.Tensor], sizes: Optional[List[List[int]]]) -> List[torch.Tensor]:
        """Concatenate every rank's leaves along dim 0 (rank order, padding removed)."""
        raise NotImplementedError

    def gather_with_header(self, row: List[int], leaves: Sequence[torch.Tensor] = ()) -> Tuple[
            List[List[int]], Optional[Callable[[List[List[int]]], List[torch.Tensor]]]]:
        """All-gather ``row`` (the shape header; the same length on every rank) and, where the
        transport can, this rank's ``leaves`` in the same collective. Returns every rank's row, and
        ``unpack(sizes)`` giving the gathered leaves as :meth:`gather` would (``sizes`` read from
        the rows) when every rank's leaves came along, else None: the caller then calls
        :meth:`gather`. Here: the header alone."""
        return self.gather_rows(torch.tensor(row, dtype=torch.int64)), None

    def all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """A new tensor: ``t`` reduced over ranks with ``op`` in :data:`REDUCE_OPS`; ``t`` untouched."""
        raise NotImplementedError

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """A new tensor holding rank ``src``'s ``t``."""
        raise NotImplementedError

    def gather_object(self, obj: Any) -> List[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        raise NotImplementedError

    def broadcast_object_list(self, objects: List[Any], src: int) -> List[Any]:
        """Rank ``src``'s list of picklable objects (same length everywhere)."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError


# dtypes gloo has no collectives for ("Invalid scalar type"): they travel as bytes.
_BYTES_ONLY = frozenset(getattr(torch, n) for n in ("int16", "uint16", "uint32", "uint64") if hasattr(torch, n))


class C10dTransport(Transport):
    """torch.distributed's default group (gloo or NCCL). NCCL needs CUDA tensors, gloo CPU ones:
    tensors are moved to where the group can send them and results come back to the caller's
    device."""

    def is_active(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def rank(self) -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    @staticmethod
    def _comm_device() -> torch.device:
        """Where the group sends from: this process's own GPU when the group has NCCL (``nccl``, or
        ``cuda:nccl,cpu:gloo`` for FSDP's CPU offload; a tensor on another GPU is copied there: every
        rank must use the device its communicator was made for), else the CPU."""
        if "nccl" in str(dist.get_backend()):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def gather(self, leaves: Sequence[torch.Tensor], sizes: Optional[List[List[int]]]) -> List[torch.Tensor]:
        world = dist.get_world_size()
        if sizes is None:
            sizes = [[t.shape[0]] * world for t in leaves]
        if len(leaves) == 1 and leaves[0].dtype not in _BYTES_ONLY:
            return [self._gather_one(leaves[0], sizes[0])]
        return self._gather_fused(leaves, sizes)

    def _gather_one(self, t: torch.Tensor, sizes: List[int]) -> torch.Tensor:
        """One leaf: all-gather straight into the result; cut the padding when sizes differ."""
        m = max(sizes)
        src = _pad0(t.detach().to(self._comm_device()), m).contiguous()  # a parameter too: gathers are not differentiable
        out = torch.empty((len(sizes) * m,) + tuple(src.shape[1:]), dtype=src.dtype, device=src.device)
        _all_gather_single(out, src)
        return _unpad(out, sizes, m).to(t.device)

    def _gather_fused(self, leaves: Sequence[torch.Tensor], sizes: List[List[int]]) -> List[torch.Tensor]:
        """Several leaves (or a dtype gloo cannot send): one byte buffer, one collective."""
        world = dist.get_world_size()
        device = self._comm_device()
        parts, spans = [], []
        for t, per_rank in zip(leaves, sizes):
            padded = _pad0(t.detach().to(device), max(per_rank)).contiguous()
            raw = padded.reshape(-1).view(torch.uint8)
            pad = (-raw.numel()) % _ALIGN
            parts.append(torch.cat([raw, raw.new_zeros(pad)]) if pad else raw)
            spans.append((parts[-1].numel(), padded.shape, padded.dtype, padded.numel()))
        payload = torch.cat(parts) if len(parts) > 1 else parts[0]
        out = torch.empty(world * payload.numel(), dtype=torch.uint8, device=device).view(world, -1)
        _all_gather_single(out.view(-1), payload)
        result, offset = [], 0
        for (nbytes, shape, dtype, numel), per_rank, t in zip(spans, sizes, leaves):
            block = out[:, offset : offset + nbytes].contiguous().view(dtype)[:, :numel]
            m = shape[0]
            full = block.reshape((world * m,) + tuple(shape[1:]))
            result.append(_unpad(full, per_rank, m).to(t.device))
            offset += nbytes
        return result

    def gather_with_header(self, row: List[int], leaves: Sequence[torch.Tensor] = ()) -> Tuple[
            List[List[int]], Optional[Callable[[List[List[int]]], List[torch.Tensor]]]]:
        """The header travels with an inline region of the group's current size (see
        :class:`_Inline`): every rank sends ``row``, the bytes its leaves need, and the leaves
        themselves when they fit. The buffer has the same size on every rank whatever each is
        doing, so a rank in a barrier while another gathers still reads the other's header and
        raises, as with a bare header."""
        inline = _inline()
        world, capacity = inline.world, inline.size
        device = self._comm_device()
        spans = [_aligned(t.shape[0] * _row_bytes(t)) for t in leaves]
        head = torch.frombuffer(array.array("q", row + [sum(spans), 0]), dtype=torch.uint8)  # + what the leaves need
        hbytes = head.numel()
        parts, used = [head.to(device)], 0
        if leaves and sum(spans) <= capacity:
            for t, span in zip(leaves, spans):
                parts.append(t.detach().reshape(-1).view(torch.uint8).to(device))
                if span > parts[-1].numel():  # the next leaf starts aligned
                    parts.append(head.new_zeros(span - parts[-1].numel(), device=device))
                used += span
        if capacity > used:
            parts.append(head.new_zeros(capacity - used, device=device))
        payload = torch.cat(parts) if len(parts) > 1 else parts[0]
        out = torch.empty((world, payload.numel()), dtype=torch.uint8, device=device)
        _all_gather_single(out.view(-1), payload)
        framed = out[:, :hbytes].view(torch.int64).tolist()
        rows, need = [f[:-2] for f in framed], max(f[-2] for f in framed)
        inline.update(need)  # the same on every rank: it reads the same rows
        if not leaves or need > capacity:
            return rows, None

        def unpack(sizes: List[List[int]]) -> List[torch.Tensor]:
            if all(min(n) == max(n) for n in sizes):  # the usual case: one strided view and one copy per leaf
                result, offset = [], hbytes
                for t, per_rank in zip(leaves, sizes):
                    nbytes = per_rank[0] * _row_bytes(t)
                    block = out[:, offset : offset + nbytes].view(t.dtype)
                    result.append(block.reshape((world * per_rank[0],) + tuple(t.shape[1:])).to(t.device))
                    offset += _aligned(nbytes)
                return result
            per_leaf: List[List[torch.Tensor]] = [[] for _ in leaves]
            for r in range(world):  # each rank packed its leaves at offsets of its own sizes
                offset = hbytes
                for i, t in enumerate(leaves):
                    nbytes = sizes[i][r] * _row_bytes(t)
                    per_leaf[i].append(out[r, offset : offset + nbytes].view(t.dtype).view((sizes[i][r],) + tuple(t.shape[1:])))
                    offset += _aligned(nbytes)
            return [torch.cat(blocks).to(t.device) for blocks, t in zip(per_leaf, leaves)]

        return rows, unpack

    def all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        buf = t.detach().to(self._comm_device(), copy=True).contiguous()
        dist.all_reduce(buf, op=_C10D_OPS[op])
        return buf.to(t.device)

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        buf = t.detach().to(self._comm_device(), copy=True).contiguous()
        dist.broadcast(buf, src=src)
        return buf.to(t.device)

    def gather_object(self, obj: Any) -> List[Any]:
        """Objects travel as :func:`_dumps` bytes: a CUDA tensor inside arrives on the receiving
        process's own GPU (plain pickling would rebuild it on the sender's GPU index)."""
        out: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, _dumps(obj))
        return [_loads(b) for b in out]

    def broadcast_object_list(self, objects: List[Any], src: int) -> List[Any]:
        """As :meth:`gather_object`: tensors arrive on this process's own GPU; ``src`` keeps its objects."""
        payload = [_dumps(o) for o in objects] if dist.get_rank() == src else [None] * len(objects)
        dist.broadcast_object_list(payload, src=src)
        if dist.get_rank() != src:
            objects[:] = [_loads(b) for b in payload]
        return objects

    def barrier(self) -> None:
        dist.barrier()


class _Pickler(pickle.Pickler):
    """Pickles a CUDA tensor as a CPU copy that :func:`_on_own_gpu` puts back on a GPU."""

    def reducer_override(self, obj: Any) -> Any:  # not called for str, int, list, dict, ...: cheap
        if type(obj) is torch.Tensor and obj.device.type == "cuda":
            return _on_own_gpu, (obj.detach().cpu(), obj.requires_grad)
        return NotImplemented


def _on_own_gpu(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """On this process's current GPU (the CPU where this process has no CUDA)."""
    if torch.cuda.is_available():
        t = t.to(torch.device("cuda", torch.cuda.current_device()))
    return t.requires_grad_(requires_grad)


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return pickle.loads(data)


def _all_gather_single(out: torch.Tensor, src: torch.Tensor) -> None:
    """``dist.all_gather_single`` (torch 2.13 renamed ``all_gather_into_tensor`` and warns on the old
    name; older torch has only that)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, src)

_C10D_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN} if dist.is_available() else {}


class _Inline:
    """How many data bytes travel with every shape header of one process group.

    A checked gather costs two collectives (header, then data) unless the data rides in the
    header's own collective. Every rank must then send the same number of bytes whatever it is
    doing, so the size is one number per group, which every rank updates from the same gathered
    headers: it grows to what a gather needed (a metrics loop's batches: from the second batch on,
    one collective each), up to 64 KiB per rank (:meth:`limit`; larger data gains little from
    sharing the header's collective, and every header, a barrier's too, carries the region), stays
    while gathers use at least a quarter of it, and returns to zero after 256 headers that did not."""

    __slots__ = ("size", "idle", "world")
    IDLE_RESET = 256

    def __init__(self, world: int) -> None:
        self.size, self.idle, self.world = 0, 0, world

    @staticmethod
    def limit(world: int) -> int:
        """64 KiB per rank, less in large jobs (every rank receives ``world`` of them)."""
        return _aligned(min(64 << 10, max(1 << 10, (1 << 20) // world)))

    def update(self, need: int) -> None:
        if self.size < need <= self.limit(self.world):
            self.size, self.idle = need, 0
        elif need * 4 >= self.size > 0:
            self.idle = 0
        else:
            self.idle += 1
            if self.idle >= self.IDLE_RESET:
                self.size, self.idle = 0, 0


_INLINE: "weakref.WeakKeyDictionary[Any, _Inline]" = weakref.WeakKeyDictionary()


def _inline() -> _Inline:
    """The inline region of the current default group (a new group starts at zero)."""
    group = dist.group.WORLD
    found = _INLINE.get(group)
    if found is None:
        found = _INLINE[group] = _Inline(dist.get_world_size())
    return found


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up so that the next leaf starts where any dtype can be viewed."""
    return nbytes + (-nbytes) % _ALIGN


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes in one dim-0 row of ``t``."""
    return torch.Size(t.shape[1:]).numel() * t.element_size()


def _pad0(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] >= rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))])


def _unpad(full: torch.Tensor, sizes: List[int], m: int) -> torch.Tensor:
    if all(n == m for n in sizes):
        return full
    return torch.cat([full[r * m : r * m + n] for r, n in enumerate(sizes)])
