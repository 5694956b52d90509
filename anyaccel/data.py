"""Sharded data loading: each process sees a disjoint share of every epoch.

How an epoch is cut (``W`` processes, per-process batch ``b``):

* One permutation of the whole dataset per epoch, seeded identically on every rank
  (``seed + epoch``; the seed is drawn once on rank 0 at ``prepare`` and broadcast), so all ranks
  agree on the order and differ only in their share.
* The order is read in *rounds* of ``W*b`` samples; in round ``k`` rank ``r`` takes samples
  ``[k*W*b + r*b, k*W*b + (r+1)*b)``. Concatenating the ranks' ``k``-th batches in rank order
  (what a gather does) gives back round ``k`` in order, so 2 processes × batch ``b`` see exactly
  the batches of 1 process × batch ``2b``.
* The last, incomplete round of ``m`` samples is split evenly (``ceil(m/W)`` each), padded with
  the first samples of the epoch so that every rank runs the same number of steps (no rank waits
  forever in a collective). The loader remembers how many of those were padding, and
  ``gather_for_metrics`` removes them: over an epoch each sample is counted exactly once.
* ``drop_last=True`` drops the incomplete round instead.

A user-supplied ``batch_sampler`` is sharded by whole batches in the same round-robin way;
an ``IterableDataset`` is read by every rank and sharded by batches (each rank keeps its own).

Exact resume: ``PreparedDataLoader.state_dict()`` records the epoch, the batches already yielded
and the seed. Because the order is a pure function of ``(seed, epoch)``, ``load_state_dict`` needs
no RNG state: the next iteration replays the saved epoch's order from the saved position, and the
following iterations move on to the next epochs as an uninterrupted run would. The inner
DataLoader gets a private generator, reseeded from ``(seed, epoch, rank)`` at each epoch, for the
worker base seed torch draws when an iterator starts; so iterating never consumes the global RNG
(a resumed run's dropout masks match the uninterrupted run's). Randomness drawn *inside* worker
processes is not replayed for the batches skipped on resume.

Everything in this module is local to a process except :func:`shared_seed`, which is collective.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, List, Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler

from . import ops
from .devices import send_to_device

__all__ = ["ShardedBatchSampler", "PreparedDataLoader", "prepare_data_loader", "shared_seed", "skip_first_batches"]


def shared_seed(generator: Optional[torch.Generator] = None) -> int:
    """Draw a seed on rank 0 (from ``generator`` or torch's global RNG, so ``set_seed`` makes it
    reproducible) and broadcast it. Collective: every rank calls it and receives the same int."""
    value = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item()) & ((1 << 62) - 1)
    return int(ops.broadcast_object_list([value], from_process=0)[0])


class ShardedBatchSampler(Sampler):
    """Yields this rank's lists of indices for one epoch (see the module docstring).

    ``base`` is the original loader's sampler (shuffle when it is a :class:`RandomSampler`), or,
    when ``batches_given`` is True, the original ``batch_sampler`` (sharded by whole batches).
    """

    def __init__(
        self,
        base: Any,
        batch_size: Optional[int],
        drop_last: bool,
        num_replicas: int,
        rank: int,
        seed: int,
        batches_given: bool = False,
    ):
        self.base = base
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.batches_given = batches_given
        self.epoch = 0
        self.skip = 0  # batches to skip at the start of the next iteration (resume)
        # Set by __iter__ for the epoch in progress: how the final round was padded.
        self.last_round_real = 0
        self.last_round_total = 0

    # ---- the epoch's global order --------------------------------------------------------
    def _order(self) -> List[int]:
        base = self.base
        if isinstance(base, RandomSampler) and not self.batches_given:
            n = len(base.data_source)
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            if base.replacement:
                k = base.num_samples
                return torch.randint(high=n, size=(k,), dtype=torch.int64, generator=g).tolist()
            perm = torch.randperm(n, generator=g)
            return perm[: base.num_samples].tolist() if base.num_samples != n else perm.tolist()
        if isinstance(base, SequentialSampler):
            return list(range(len(base.data_source)))
        # Any other sampler (or batch sampler): seed its randomness identically on every rank.
        gen = getattr(base, "generator", None)
        if isinstance(gen, torch.Generator):
            gen.manual_seed(self.seed + self.epoch)
            return list(base)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + self.epoch)
            return list(base)

    def _plan(self) -> List[List[int]]:
        order = self._order()
        w, r = self.num_replicas, self.rank
        self.last_round_real = self.last_round_total = 0
        if self.batches_given:
            batches = [list(b) for b in order]
            full = len(batches) // w
            mine = [batches[k * w + r] for k in range(full)]
            rest = len(batches) - full * w
            if rest and not self.drop_last:
                tail = batches[full * w :]
                pads = [batches[i % len(batches)] for i in range(w - rest)]
                ring = tail + pads
                mine.append(ring[r])
                self.last_round_real = sum(len(b) for b in tail)
                self.last_round_total = sum(len(b) for b in ring)
            return mine
        b = self.batch_size
        n = len(order)
        per_round = w * b
        full = n // per_round
        mine = [order[k * per_round + r * b : k * per_round + (r + 1) * b] for k in range(full)]
        m = n - full * per_round
        if m and not self.drop_last:
            per = math.ceil(m / w)
            tail = order[full * per_round :]
            need = per * w - m
            ring = tail + [order[i % n] for i in range(need)]
            mine.append(ring[r * per : (r + 1) * per])
            self.last_round_real, self.last_round_total = m, per * w
        return mine

    def __iter__(self) -> Iterator[List[int]]:
        plan = self._plan()
        skip, self.skip = self.skip, 0
        return iter(plan[skip:])

    def __len__(self) -> int:
        if self.batches_given:
            n = len(self.base)
            return n // self.num_replicas + (0 if self.drop_last or n % self.num_replicas == 0 else 1)
        n = len(self.base)
        per_round = self.num_replicas * self.batch_size
        return n // per_round + (0 if self.drop_last or n % per_round == 0 else 1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, dict):
        for v in batch.values():
            return _batch_len(v)
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_len(batch[0])
    return 1


class PreparedDataLoader:
    """What ``accelerator.prepare(dataloader)`` returns: iterates this process's share of the data,
    with batches already on ``accelerator.device``.

    Behaves like the original loader (``len()`` is the number of batches *this process* yields,
    ``batch_size`` is per process, ``dataset`` is the whole dataset) and adds ``set_epoch``,
    ``state_dict``/``load_state_dict`` (epoch and position, for exact resume) and the end-of-data
    bookkeeping that ``gather_for_metrics`` and gradient accumulation rely on.
    Iterating is local to each process; all processes must iterate the same number of times.
    """

    def __init__(self, loader: DataLoader, batch_sampler: Optional[ShardedBatchSampler], device: torch.device,
                 tracker: Any = None, num_replicas: int = 1, rank: int = 0, iterable_drop_last: bool = False):
        self._loader = loader
        self.batch_sampler = batch_sampler
        self.device = device
        self._move = device.type != "cpu"
        self._tracker = tracker
        self.num_replicas = num_replicas
        self.rank = rank
        self._iterable_drop_last = iterable_drop_last
        self._epoch_set_explicitly = False
        self._iterations = 0
        self._worker_seed_generator: Optional[torch.Generator] = getattr(loader, "generator", None) \
            if batch_sampler is not None else None
        self.position = 0  # batches yielded so far in the epoch in progress
        self.end_of_dataloader = False
        self.last_round_real = 0
        self.last_round_total = 0

    # ---- torch DataLoader look-alike ----------------------------------------------------
    @property
    def dataset(self):
        return self._loader.dataset

    @property
    def batch_size(self) -> Optional[int]:
        if self.batch_sampler is not None:
            return self.batch_sampler.batch_size
        return self._loader.batch_size

    @property
    def total_batch_size(self) -> Optional[int]:
        bs = self.batch_size
        return None if bs is None else bs * self.num_replicas

    @property
    def total_dataset_length(self) -> int:
        return len(self.dataset)

    @property
    def sampler(self):
        return self.batch_sampler if self.batch_sampler is not None else self._loader.sampler

    def __len__(self) -> int:
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        n = len(self._loader)
        w = self.num_replicas
        return n // w if self._iterable_drop_last else math.ceil(n / w)

    def __getattr__(self, name: str) -> Any:  # num_workers, collate_fn, pin_memory, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._loader, name)

    @property
    def epoch(self) -> int:
        return self.batch_sampler.epoch if self.batch_sampler is not None else self._iterations

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration's shuffle (same value on every rank). Without
        calls to ``set_epoch``, each new iteration moves to the next epoch automatically."""
        if self.batch_sampler is not None:
            self.batch_sampler.set_epoch(epoch)
        ds = self._loader.dataset
        if hasattr(ds, "set_epoch"):
            ds.set_epoch(epoch)
        self._epoch_set_explicitly = True

    # ---- iteration ----------------------------------------------------------------------
    def _begin_epoch(self) -> None:
        bs = self.batch_sampler
        # The next epoch, unless set_epoch/load_state_dict chose one. A pending skip (resume,
        # skip_first_batches) does not change which epoch this is.
        if bs is not None and self._iterations > 0 and not self._epoch_set_explicitly:
            bs.set_epoch(bs.epoch + 1)
        self._epoch_set_explicitly = False
        self._iterations += 1
        self.position = bs.skip if bs is not None else 0
        self.end_of_dataloader = False
        gen = self._worker_seed_generator
        if gen is not None:
            # torch's DataLoader draws its worker base seed from this generator when an iterator
            # is created. A private generator reseeded per epoch keeps that draw off the global
            # RNG (so a resumed run's dropout etc. continue exactly) and makes it a function of
            # (seed, epoch, rank) only.
            gen.manual_seed(_mix(bs.seed, bs.epoch, self.rank))

    def __iter__(self):
        self._begin_epoch()
        if self._tracker is not None:
            self._tracker.push(self)
        try:
            if self.batch_sampler is not None:
                yield from self._iter_map_style()
            else:
                yield from self._iter_iterable()
        finally:
            if self._tracker is not None:
                self._tracker.pop(self)

    def _iter_map_style(self):
        bs = self.batch_sampler
        total = len(bs)
        it = iter(self._loader)
        self.last_round_real, self.last_round_total = bs.last_round_real, bs.last_round_total
        move, device = self._move, self.device
        for batch in it:
            self.position += 1
            if self.position >= total:
                self.end_of_dataloader = True
            yield send_to_device(batch, device, non_blocking=True) if move else batch

    def _iter_iterable(self):
        """Every rank reads the stream; rank r keeps batches k*W + r. Lookahead finds the end."""
        w, r = self.num_replicas, self.rank
        move, device = self._move, self.device
        head: List[Any] = []  # first W batches, reused as padding for a short final round
        group: List[Any] = []
        pending = None

        def rounds():
            for batch in self._loader:
                if len(head) < w:
                    head.append(batch)
                group.append(batch)
                if len(group) == w:
                    yield list(group), None
                    group.clear()
            if group and not self._iterable_drop_last:
                real = sum(_batch_len(b) for b in group)
                ring = list(group) + [head[i % len(head)] for i in range(w - len(group))]
                yield ring, (real, sum(_batch_len(b) for b in ring))

        for ring, pad in rounds():
            if pending is not None:
                self.position += 1
                yield pending
            batch = ring[r]
            pending = send_to_device(batch, device, non_blocking=True) if move else batch
            self.last_round_real, self.last_round_total = pad if pad else (0, 0)
        if pending is not None:
            self.position += 1
            self.end_of_dataloader = True
            yield pending

    # ---- checkpointing ------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where this loader stands (JSON-serialisable): epoch, batches already yielded in it
        (counted when handed to the loop, so save after processing a batch), whether the epoch
        is finished, the shuffle seed, and the layout (processes × batch size) the position
        refers to. Local; identical on every rank."""
        bs = self.batch_sampler
        return {
            "epoch": self.epoch,
            "position": self.position if not self.end_of_dataloader else 0,
            "finished_epoch": bool(self.end_of_dataloader),
            "seed": bs.seed if bs is not None else None,
            "iterations": self._iterations,
            "num_replicas": self.num_replicas,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict) -> None:
        """Make the next iteration continue exactly where ``state`` was taken: same epoch (its
        shuffle), starting after the batches already seen; the epochs after it follow as in an
        uninterrupted run. A finished epoch resumes at the start of the next one.

        If ``state`` was taken with another number of processes or batch size, the position is
        converted through the number of samples consumed (exact when it divides evenly; a
        warning otherwise). Local."""
        bs = self.batch_sampler
        self._iterations = int(state.get("iterations", 0))
        if bs is None:
            return
        if state.get("seed") is not None:
            bs.seed = int(state["seed"])
        if state.get("finished_epoch"):
            bs.set_epoch(int(state["epoch"]) + 1)
            bs.skip = 0
        else:
            bs.set_epoch(int(state["epoch"]))
            bs.skip = self._convert_position(state)
        self._epoch_set_explicitly = True
        self.position = bs.skip
        self.end_of_dataloader = False

    def _convert_position(self, state: dict) -> int:
        position = int(state.get("position", 0))
        old_w, old_b = state.get("num_replicas"), state.get("batch_size")
        new_w, new_b = self.num_replicas, self.batch_size
        if old_w is None or old_b is None or new_b is None or (old_w, old_b) == (new_w, new_b):
            return position
        consumed = position * int(old_w) * int(old_b)
        converted, rest = divmod(consumed, new_w * new_b)
        if rest:
            import warnings

            warnings.warn(
                f"the loader state was saved with {old_w} processes x batch {old_b} and is loaded with "
                f"{new_w} x {new_b}: {consumed} samples of epoch {state.get('epoch')} were consumed, which is "
                f"not a whole number of rounds; resuming after {converted * new_w * new_b} samples "
                f"({rest} samples are seen twice)",
                stacklevel=3,
            )
        return converted


def skip_first_batches(loader: PreparedDataLoader, num_batches: int) -> PreparedDataLoader:
    """Make the *next* iteration of ``loader`` start after ``num_batches`` batches of the epoch it
    would run anyway (each process skips its own first ``num_batches``; later iterations are
    complete). Returns the same loader. Local; call it on every rank alike."""
    if loader.batch_sampler is None:
        raise TypeError("skip_first_batches needs a map-style dataset (an IterableDataset has no positions)")
    if int(num_batches) < 0:
        raise ValueError(f"num_batches must be >= 0, got {num_batches}")
    loader.batch_sampler.skip = int(num_batches)
    return loader


def _mix(seed: int, epoch: int, rank: int) -> int:
    """A 63-bit seed from (seed, epoch, rank): distinct per epoch and rank, same in every run."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(epoch) * 0xBF58476D1CE4E5B9 + int(rank) * 0x94D049BB133111EB)
    x &= (1 << 64) - 1
    x ^= x >> 31
    return x & ((1 << 63) - 1)


_LOADER_ARGS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def prepare_data_loader(
    loader: DataLoader,
    device: torch.device,
    num_replicas: int,
    rank: int,
    tracker: Any = None,
    split_batches: bool = False,
) -> PreparedDataLoader:
    """Build this process's sharded view of ``loader``. Collective (draws the shared shuffle seed
    on rank 0 and broadcasts it): every rank prepares its loaders in the same order."""
    if isinstance(loader, PreparedDataLoader):
        return loader
    kwargs = {k: getattr(loader, k) for k in _LOADER_ARGS if hasattr(loader, k)}
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
    if isinstance(loader.dataset, IterableDataset):
        return PreparedDataLoader(loader, None, device, tracker, num_replicas, rank,
                                  iterable_drop_last=bool(loader.drop_last))
    seed = shared_seed(loader.generator)
    user_batch_sampler = loader.batch_sampler
    batches_given = not (isinstance(user_batch_sampler, BatchSampler) and type(user_batch_sampler) is BatchSampler)
    if batches_given:
        if split_batches:
            raise ValueError("split_batches=True needs a DataLoader built with batch_size=..., not a custom batch_sampler")
        sampler = ShardedBatchSampler(user_batch_sampler, getattr(user_batch_sampler, "batch_size", None),
                                      getattr(user_batch_sampler, "drop_last", False), num_replicas, rank, seed,
                                      batches_given=True)
    else:
        bs = user_batch_sampler.batch_size
        if split_batches:
            if bs % num_replicas:
                raise ValueError(
                    f"split_batches=True divides the batch size {bs} over {num_replicas} processes; "
                    "choose a batch size that is a multiple of the number of processes"
                )
            bs //= num_replicas
        sampler = ShardedBatchSampler(user_batch_sampler.sampler, bs, user_batch_sampler.drop_last,
                                      num_replicas, rank, seed)
    kwargs["generator"] = torch.Generator()  # private: worker seeds per (seed, epoch, rank), see _begin_epoch
    new = DataLoader(loader.dataset, batch_sampler=sampler, **kwargs)
    return PreparedDataLoader(new, sampler, device, tracker, num_replicas, rank)
