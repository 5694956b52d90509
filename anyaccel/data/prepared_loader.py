"""What ``prepare(dataloader)`` returns: :class:`PreparedDataLoader`, this rank's share of the data
with batches on the device, and the position bookkeeping that exact resume, gradient accumulation
and ``gather_for_metrics`` rely on. Iterating is local to each process."""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Iterable, List, Optional

import torch
from torch.utils.data import DataLoader

from .. import ops
from ..doctor import TRACKER
from .sampler import ShardedBatchSampler

__all__ = ["PreparedDataLoader", "skip_first_batches"]


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, dict):
        for v in batch.values():
            return _batch_len(v)
    if _leaf_list(batch):  # collated non-tensors (strings): one entry per sample
        return len(batch)
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
                 feed: Optional[Callable[[Iterable[Any]], Iterable[Any]]] = None, tracker: Any = None,
                 num_replicas: int = 1, rank: int = 0, iterable_drop_last: bool = False,
                 dispatch: bool = False, split: bool = False, whole_last_batches: bool = False):
        self._loader = loader
        self.batch_sampler = batch_sampler
        self.device = device
        self._feed = feed  # the backend's: host batches -> device batches (None: used as they are)
        self._tracker = tracker
        self.num_replicas = num_replicas
        self.rank = rank
        self._iterable_drop_last = iterable_drop_last
        self._dispatch = bool(dispatch) and num_replicas > 1  # iterable: rank 0 reads, the others receive
        self._split = bool(split)  # iterable: each stream batch is split over the ranks
        self._whole = bool(whole_last_batches)  # iterable: the last round padded to whole batches
        self._skip = 0  # iterable: batches of this rank to skip at the next iteration (resume)
        self._epoch_set_explicitly = False
        self._iterations = 0
        self._worker_seed_generator: Optional[torch.Generator] = getattr(loader, "generator", None) \
            if batch_sampler is not None else None
        self.position = 0  # batches yielded so far in the epoch in progress
        self.on_batch: Optional[Callable[[], None]] = None  # called before each batch is fetched (preemption)
        self.end_of_dataloader = False
        self._last_round = (0, 0)  # an iterable dataset's (real, total) samples of its last round

    @property
    def last_round_real(self) -> int:
        """Real samples in the epoch's last, padded round (0: nothing padded); with
        :attr:`last_round_total`, what ``gather_for_metrics`` drops at the end of data. Local."""
        return self.batch_sampler.last_round_real if self.batch_sampler is not None else self._last_round[0]

    @property
    def last_round_total(self) -> int:
        """Samples in the epoch's last round, padding included (0: nothing padded). Local."""
        return self.batch_sampler.last_round_total if self.batch_sampler is not None else self._last_round[1]

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
        if self._split:
            return n
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
        calls to ``set_epoch``, each new iteration moves to the next epoch automatically. The
        order depends on it only with ``use_seedable_sampler`` (a function of ``(seed, epoch)``);
        by default each epoch draws from the user's generators after the previous one, as torch's
        and Accelerate's loaders do, whatever number is set."""
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
        self.position = bs.skip if bs is not None else self._skip
        self.end_of_dataloader = False
        gen = self._worker_seed_generator
        if gen is not None and bs.randomness is not None:
            # The draws of the user's own DataLoader. torch's iterator draws its worker base seed
            # from the private generator; given the state the user's generator (or the global RNG)
            # had before that draw, it draws the same number: the workers get the seeds of the
            # script without anyaccel. Persistent workers started in an earlier epoch draw none.
            started = getattr(self._loader, "_iterator", None) is not None and self._loader.persistent_workers
            base = bs.randomness.start_epoch(draw_base=not started)
            if bs.randomness.base_state is not None:
                gen.set_state(bs.randomness.base_state)
            else:  # resumed from a checkpoint that did not keep the state: a seed of the same draw
                gen.manual_seed(base)
        elif gen is not None:
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
                batches = iter(self._loader)  # the sampler plans the epoch (and records its last round) when read
            else:
                batches = self._own_batches()
            if self._feed is not None:
                batches = self._feed(batches)
            on_batch = self.on_batch
            if on_batch is not None:
                on_batch()
            if self.batch_sampler is not None:  # known length: the total-th batch is the last
                total = len(self.batch_sampler)
                for batch in batches:  # (inline, not a helper generator: this is the per-batch path)
                    self.position += 1
                    TRACKER.batches += 1  # how far this rank is, for a peer asking (anyaccel.checkpoint.participation)
                    if self.position >= total:
                        self.end_of_dataloader = True
                    yield batch
                    if on_batch is not None:
                        on_batch()
            else:
                for batch in self._count_with_lookahead(batches):
                    yield batch
                    if on_batch is not None:
                        on_batch()
        finally:
            if self._tracker is not None:
                self._tracker.pop(self)

    def _count_with_lookahead(self, batches: Iterable[Any]):
        """Yield ``batches`` of unknown number: one batch of lookahead finds the last."""
        pending, started = None, False
        for batch in batches:
            if started:
                self.position += 1
                TRACKER.batches += 1
                yield pending
            pending, started = batch, True
        if started:
            self.position += 1
            TRACKER.batches += 1
            self.end_of_dataloader = True
            yield pending

    def _own_batches(self):
        """An iterable dataset, cut in rounds (:meth:`_rounds`): rank r keeps batch r of each
        round. Read by every rank, or with ``dispatch`` by rank 0 alone, which broadcasts each
        round (a collective per batch). On a resumed epoch the first ``skip`` rounds are read
        and dropped (by rank 0 alone when dispatching)."""
        skip, self._skip = self._skip, 0
        rounds = itertools.islice(self._rounds(), skip, None) if skip else self._rounds()
        if self._dispatch:
            rounds = self._dispatched(rounds)
        for group, real, total in rounds:
            self._last_round = (real, total)
            yield group[self.rank]

    def _rounds(self):
        """(W batches, real samples, total samples) per round of the stream: rank r's batch is
        stream batch k*W + r (with ``split``, part r of stream batch k). A short final round is
        completed with the first batches of the stream (padding that ``gather_for_metrics``
        removes; real = total = 0 when nothing was padded); with ``whole_last_batches`` its
        samples are completed with the stream's first ones to W whole batches (see
        :func:`_whole_round`)."""
        w = self.num_replicas
        b = self._loader.batch_size
        whole = self._whole and isinstance(b, int)
        if self._split:
            first = None
            for batch in self._loader:
                first = batch if first is None else first
                if whole and _batch_len(batch) < b:  # the stream's last batch, short: completed to b
                    real = _batch_len(batch)
                    batch = _whole_round([batch], [first], b, 1)[0][0]
                    yield [_part(batch, w, i) for i in range(w)], real, b
                    return
                yield [_part(batch, w, i) for i in range(w)], 0, 0
            return
        head: List[Any] = []  # first W batches, reused as padding for a short final round
        group: List[Any] = []
        for batch in self._loader:
            if len(head) < w:
                head.append(batch)
            group.append(batch)
            if len(group) == w and not (whole and _batch_len(batch) < b):
                yield group, 0, 0
                group = []
        if group and not self._iterable_drop_last:
            if whole:
                yield _whole_round(group, head, b, w)
                return
            real = sum(_batch_len(x) for x in group)
            ring = list(group) + [head[i % len(head)] for i in range(w - len(group))]
            yield ring, real, sum(_batch_len(x) for x in ring)

    def _dispatched(self, rounds: Iterable[Any]):
        """``rounds`` read on rank 0 and broadcast to every rank (collective: every rank iterates
        the loader together; the other ranks never start the generator, so never touch the
        dataset)."""
        source = iter(rounds) if self.rank == 0 else None
        while True:
            message = [next(source, None) if source is not None else None]
            ops.broadcast_object_list(message, from_process=0)
            if message[0] is None:
                return
            yield message[0]

    # ---- checkpointing ------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where this loader stands (JSON-serialisable): epoch, batches already yielded in it
        (counted when handed to the loop, so save after processing a batch), whether the epoch
        is finished, the shuffle seed, and the layout (processes × batch size) the position
        refers to. Local; identical on every rank."""
        bs = self.batch_sampler
        state = {
            "epoch": self.epoch,
            "position": self.position if not self.end_of_dataloader else 0,
            "finished_epoch": bool(self.end_of_dataloader),
            "seed": bs.seed if bs is not None else None,
            "iterations": self._iterations,
            "num_replicas": self.num_replicas,
            "batch_size": self.batch_size,
        }
        if bs is not None and bs.randomness is not None:  # where the user's generators stand
            fresh = self.end_of_dataloader or self._iterations == 0
            state["generators"] = bs.randomness.next_epoch_state() if fresh else bs.randomness.state()
        return state

    def load_state_dict(self, state: dict, resume_position: bool = True) -> None:
        """Make the next iteration continue exactly where ``state`` was taken: same epoch (its
        shuffle), starting after the batches already seen; the epochs after it follow as in an
        uninterrupted run. A finished epoch resumes at the start of the next one.

        ``resume_position=False`` restores the epoch and its shuffle but not the position: the
        next iteration runs the saved epoch from its first batch, for a script that skips the
        batches already seen itself (``skip_first_batches``, a ``continue`` loop) — what
        ``Accelerator.load_state`` does unless ``use_stateful_dataloader=True``, as Accelerate's.

        If ``state`` was taken with another number of processes or batch size, the position is
        converted through the number of samples consumed (exact when it divides evenly; a
        warning otherwise). Local."""
        bs = self.batch_sampler
        self._iterations = int(state.get("iterations", 0))
        self.end_of_dataloader = False
        if not resume_position and not state.get("finished_epoch"):
            state = {**state, "position": 0}
        if bs is None:  # an iterable dataset: replay the stream up to the saved position
            position = int(state.get("position", 0))
            if not state.get("finished_epoch") and self._iterations > 0:
                self._iterations -= 1  # the next iteration is the saved one again
                self._skip = self._convert_position(state) if position else 0
            else:
                self._skip = 0
            self.position = self._skip
            return
        if bs.randomness is not None and state.get("generators") is not None:
            bs.randomness.restore(state["generators"])
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


def _whole_round(group: List[Any], head: List[Any], batch_size: int, w: int):
    """The stream's last round as Accelerate's ``IterableDatasetShard`` deals it: its samples
    completed with the stream's first ones (``head``, repeated as needed) to ``w`` whole batches
    of ``batch_size``; ``(batches, real samples, total samples)``. Batches are tensors, or
    mappings / sequences of them (a sequence of non-tensors, such as collated strings, is a list of
    samples). Local."""
    samples = _cat(group)
    real, need = _batch_len(samples), w * batch_size - _batch_len(samples)
    if need > 0:
        first = _cat(head)
        samples = _cat([samples] + [first] * -(-need // _batch_len(first)))
    batches = [_take(samples, r * batch_size, (r + 1) * batch_size) for r in range(w)]
    return batches, real, w * batch_size


def _leaf_list(value: Any) -> bool:
    """A list or plain tuple of non-tensors (strings, numbers): what a collated batch holds one
    per sample (torch's default_collate leaves strings as a tuple of the batch's strings)."""
    return (isinstance(value, list) or (type(value) is tuple)) and \
        not any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in value)


def _cat(batches: List[Any]) -> Any:
    """Collated batches of one structure joined along the batch dimension. Local."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(batches)
    if isinstance(first, dict):
        return type(first)((k, _cat([b[k] for b in batches])) for k in first)
    if _leaf_list(first):
        return type(first)(v for b in batches for v in b)
    if isinstance(first, (list, tuple)):
        parts = [_cat([b[i] for b in batches]) for i in range(len(first))]
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)
    raise TypeError(f"whole_last_batches=True joins the stream's batches to complete the last round; a batch holding "
                    f"{type(first).__name__} cannot be joined (tensors, dicts, lists and tuples of them can). Leave "
                    "whole_last_batches off for this loader")


def _take(batch: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of a batch :func:`_cat` made. Local."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() else batch
    if isinstance(batch, dict):
        return type(batch)((k, _take(v, start, stop)) for k, v in batch.items())
    if _leaf_list(batch):
        return batch[start:stop]
    if isinstance(batch, (list, tuple)):
        parts = [_take(v, start, stop) for v in batch]
        return type(batch)(*parts) if hasattr(batch, "_fields") else type(batch)(parts)
    return batch


def _part(batch: Any, parts: int, index: int) -> Any:
    """Part ``index`` of ``parts`` of ``batch``'s samples, as ``torch.tensor_split`` cuts them
    (split_batches): of every tensor along dim 0, and of collated non-tensors (strings). Local."""
    size, extra = divmod(_batch_len(batch), parts)
    start = index * size + min(index, extra)
    stop = start + size + (1 if index < extra else 0)
    return _take(batch, start, stop)


def _mix(seed: int, epoch: int, rank: int) -> int:
    """A 63-bit seed from (seed, epoch, rank): distinct per epoch and rank, same in every run."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(epoch) * 0xBF58476D1CE4E5B9 + int(rank) * 0x94D049BB133111EB)
    x &= (1 << 64) - 1
    x ^= x >> 31
    return x & ((1 << 63) - 1)
