"""Which samples each rank takes in an epoch: :class:`ShardedBatchSampler` (local), where the
epoch's randomness comes from (:class:`UserGenerators`, local) and the shared shuffle seed
(collective). See :mod:`anyaccel.data` for how an epoch is cut."""

from __future__ import annotations

import base64
from typing import Any, Dict, Iterator, List, Optional, Union

import torch
from torch.utils.data import RandomSampler, Sampler, SequentialSampler

from .. import ops

__all__ = ["ShardedBatchSampler", "SeedableRandomSampler", "UserGenerators", "generator_owner", "shared_seed"]


def shared_seed(generator: Optional[torch.Generator] = None) -> int:
    """Draw a seed on rank 0 (from ``generator`` or torch's global RNG, so ``set_seed`` makes it
    reproducible) and broadcast it. Collective: every rank calls it and receives the same int."""
    value = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item()) & ((1 << 62) - 1)
    return int(ops.broadcast_object_list([value], from_process=0)[0])


def generator_owner(sampler: Any) -> Any:
    """The object whose ``generator`` attribute drives ``sampler``'s order: the sampler itself
    (``RandomSampler``), or the sampler inside a batch sampler; None when there is none."""
    for obj in (sampler, getattr(sampler, "sampler", None)):
        if obj is not None and hasattr(obj, "generator") and (obj.generator is None
                                                               or isinstance(obj.generator, torch.Generator)):
            return obj
    return None


def _draw(generator: Optional[torch.Generator]) -> int:
    """One int64 draw, as torch's DataLoader and RandomSampler draw their seeds."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def _encode(generator: Optional[torch.Generator]) -> Optional[str]:
    return None if generator is None else base64.b64encode(bytes(generator.get_state().tolist())).decode()


def _decode(generator: Optional[torch.Generator], text: Optional[str]) -> None:
    if generator is not None and text is not None:
        generator.set_state(torch.tensor(list(base64.b64decode(text)), dtype=torch.uint8))


class UserGenerators:
    """The epoch's randomness drawn exactly as the user's own ``DataLoader`` draws it (Accelerate's
    default, ``use_seedable_sampler=False``): when an epoch starts, torch's iterator draws one
    worker base seed from the loader's ``generator`` (the global RNG when it has none), then the
    sampler draws its order from its own ``generator`` (or from a seed drawn from the global RNG
    when it has none). The user's generator objects are used, as by the original loader and by
    Accelerate: one process yields the original loader's batches, and reseeding the generator
    after ``prepare`` takes effect.

    With several processes every rank takes rank 0's generator states when an epoch starts (as
    Accelerate synchronises its ``"generator"`` RNG), and for a sampler without a generator every
    rank draws the seed from its global RNG as torch does and takes rank 0's: every rank computes
    the same global order — the one a single process draws after the same ``set_seed``, which
    keeps 2 processes × batch b equal to 1 process × batch 2b. Those broadcasts (one or two per
    epoch) make :meth:`start_epoch` collective in a multi-process job.

    Exact resume: :meth:`state` is taken at the start of the epoch (before its draws) and
    :meth:`restore` replays that epoch; on a resumed epoch the global RNG, restored by
    ``load_state`` *after* the original run drew from it, is not drawn from again."""

    def __init__(self, owner: Any, loader_generator: Optional[torch.Generator], world_size: int):
        self.owner = owner
        self.world_size = world_size
        self.order = owner.generator if owner is not None else None
        self.loader = loader_generator
        self.draws_global_order_seed = owner is not None and self.order is None  # a sampler without a generator
        self._epoch_state: Dict[str, Any] = {}
        self._pending: Optional[Dict[str, Any]] = None
        self.order_seed: Optional[int] = None
        self.base_state: Optional[torch.Tensor] = None  # see start_epoch

    def _generators(self) -> List[torch.Generator]:
        return [g for g in (self.order, self.loader if self.loader is not self.order else None) if g is not None]

    def _encode_all(self) -> Dict[str, Any]:
        return {"order": _encode(self.order), "loader": _encode(self.loader) if self.loader is not self.order else None}

    def _decode_all(self, state: Dict[str, Any]) -> None:
        _decode(self.order, state.get("order"))
        if self.loader is not self.order:
            _decode(self.loader, state.get("loader"))

    def start_epoch(self, draw_base: bool = True) -> int:
        """Draw what torch draws when an epoch starts; return the worker base seed. Collective
        in a multi-process job (see the class docstring).

        :attr:`base_state` is then the state of the generator the base seed was drawn from, just
        before that draw (None when unknown: an old checkpoint resumed): a generator given that
        state draws the same base seed, so the worker processes get the seeds (``base + worker
        id``) the user's own DataLoader gives them. ``draw_base=False``: torch draws no base
        seed this epoch (persistent workers, started in an earlier epoch)."""
        pending, self._pending = self._pending, None
        resumed = pending is not None
        if resumed:
            self._decode_all(pending)
            draw_base = bool(pending.get("base_drawn", True))
        elif self.world_size > 1 and self._generators():
            gens = self._generators()
            states = ops.broadcast_object_list([[g.get_state() for g in gens]], from_process=0)[0]
            for generator, state in zip(gens, states):
                generator.set_state(state)
        state = self._encode_all()
        self.base_state: Optional[torch.Tensor] = None
        global_state: Optional[str] = None
        if not draw_base:
            base = int(pending.get("base_seed") or 0) if resumed else 0
        elif self.loader is not None:
            self.base_state = self.loader.get_state()
            base = _draw(self.loader)
        elif not resumed:
            self.base_state = torch.get_rng_state()
            global_state = base64.b64encode(bytes(self.base_state.tolist())).decode()
            base = _draw(None)
        else:
            base = int(pending.get("base_seed") or 0)
            if pending.get("base_state"):
                self.base_state = torch.tensor(list(base64.b64decode(pending["base_state"])), dtype=torch.uint8)
        if self.draws_global_order_seed:
            if resumed and pending.get("order_seed") is not None:
                self.order_seed = int(pending["order_seed"])
            else:
                self.order_seed = _draw(None)
                if self.world_size > 1:
                    self.order_seed = int(ops.broadcast_object_list([self.order_seed], from_process=0)[0])
        state.update(base_seed=base, order_seed=self.order_seed, base_drawn=draw_base)
        if global_state is not None:  # the global RNG's state is not saved elsewhere: replay needs it
            state["base_state"] = global_state
        self._epoch_state = state
        return base

    def random_order(self, sampler: RandomSampler) -> torch.Tensor:
        """The order a plain ``torch.utils.data.RandomSampler`` yields this epoch, drawn as its
        ``__iter__`` draws it (same calls, same generator) but kept as one tensor."""
        n, k = len(sampler.data_source), sampler.num_samples
        generator = self.order if self.order is not None else torch.Generator().manual_seed(self.order_seed)
        # torch's last draw yields nothing when k is a multiple of n (or of 32), but it moves the
        # generator on: drawn only when the generator outlives this epoch (the user's)
        last = k % 32 if sampler.replacement else k % n
        keep_state = self.order is not None
        if sampler.replacement:
            parts = [torch.randint(high=n, size=(32,), dtype=torch.int64, generator=generator) for _ in range(k // 32)]
            if last or keep_state:
                parts.append(torch.randint(high=n, size=(last,), dtype=torch.int64, generator=generator))
        else:
            parts = [torch.randperm(n, generator=generator) for _ in range(k // n)]
            if last or keep_state:
                parts.append(torch.randperm(n, generator=generator)[:last])
        if not parts:
            return torch.empty(0, dtype=torch.int64)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def iterate(self, sampler: Any) -> List[Any]:
        """``list(sampler)``; a sampler without a generator draws from one seeded with this
        epoch's seed (what torch's ``RandomSampler`` does with a seed from the global RNG)."""
        owner = self.owner
        if owner is None or not self.draws_global_order_seed:
            return list(sampler)
        saved, owner.generator = owner.generator, torch.Generator().manual_seed(self.order_seed)
        try:
            return list(sampler)
        finally:
            owner.generator = saved

    def state(self) -> Dict[str, Any]:
        """The epoch in progress, as it was before its draws (JSON-serialisable); after
        :meth:`restore`, before the replayed epoch starts, the restored one (a checkpoint saved
        right after loading one must replay the same epoch)."""
        return dict(self._pending if self._pending is not None else self._epoch_state)

    def next_epoch_state(self) -> Dict[str, Any]:
        """The generators as they are now, after a finished epoch: where the next one starts."""
        return dict(self._encode_all(), fresh=True)

    def restore(self, state: Dict[str, Any]) -> None:
        """Make the next :meth:`start_epoch` replay the epoch ``state`` describes (from
        :meth:`state`), or start the epoch after a finished one (from :meth:`next_epoch_state`)."""
        if state.get("fresh"):
            self._decode_all(state)
            self._pending = None
            self._epoch_state = dict(state)  # what state() reports until the next epoch starts
        else:
            self._pending = dict(state)


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose permutation for epoch ``e`` is drawn from a generator seeded with
    ``initial_seed + e`` (``data_seed``, else torch's initial seed), advancing the epoch after each
    pass; :meth:`set_epoch` chooses one. Local: ranks with the same seed draw the same order."""

    def __init__(self, *args: Any, data_seed: Optional[int] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.initial_seed = data_seed if data_seed is not None else torch.random.initial_seed()
        self.epoch = 0

    def __iter__(self):
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)


class ShardedBatchSampler(Sampler):
    """Yields this rank's lists of indices for one epoch (see the module docstring).

    ``base`` is the original loader's sampler (shuffle when it is a :class:`RandomSampler`), or,
    when ``batches_given`` is True, the original ``batch_sampler`` (sharded by whole batches).
    """

    @property
    def batch_sampler(self) -> Any:
        """The batch sampler this one shards (Accelerate's ``BatchSamplerShard.batch_sampler``): the
        user's own, unchanged (a ``BatchSampler`` whose ``.sampler`` is the user's sampler), or, with
        ``use_seedable_sampler=True``, a ``BatchSampler`` over the :class:`SeedableRandomSampler`
        whose order this one deals, as in Accelerate. Local."""
        return self.shown_batch_sampler if self.shown_batch_sampler is not None else self.base

    def __init__(
        self,
        base: Any,
        batch_size: Optional[int],
        drop_last: bool,
        num_replicas: int,
        rank: int,
        seed: int,
        batches_given: bool = False,
        even_batches: bool = True,
        randomness: Optional[UserGenerators] = None,
        shown_batch_sampler: Any = None,
        whole_last_batches: bool = False,
    ):
        self.base = base
        self.shown_batch_sampler = shown_batch_sampler  # what .batch_sampler shows (None: base)
        self.whole_last_batches = bool(whole_last_batches)  # the last round: whole batches (Accelerate's)
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.batches_given = batches_given
        self.even_batches = even_batches
        self.randomness = randomness  # None: the order is a function of (seed, epoch)
        self.epoch = 0
        self.skip = 0  # batches to skip at the start of the next iteration (resume)
        # Set by __iter__ for the epoch in progress: how the final round was padded.
        self.last_round_real = 0
        self.last_round_total = 0

    # ---- the epoch's global order --------------------------------------------------------
    def _order(self) -> Union[torch.Tensor, List[Any]]:
        """The epoch's sample indices, identical on every rank (a function of seed and epoch): a
        tensor for the samplers whose order is computed here, else the sampler's own list."""
        base = self.base
        if isinstance(base, SequentialSampler):
            return torch.arange(len(base.data_source))
        if self.randomness is not None:
            if type(base) is RandomSampler:  # torch's own class: the same draws, as a tensor
                return self.randomness.random_order(base)
            return self._seeded_iteration()
        if isinstance(base, RandomSampler):
            n, k = len(base.data_source), base.num_samples
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            if base.replacement:  # as torch's RandomSampler draws them: 32 at a time
                parts = [torch.randint(high=n, size=(32,), dtype=torch.int64, generator=g) for _ in range(k // 32)]
                parts.append(torch.randint(high=n, size=(k % 32,), dtype=torch.int64, generator=g))
                return torch.cat(parts)
            perms = [torch.randperm(n, generator=g) for _ in range(-(-k // n))]  # as torch: whole permutations
            return (torch.cat(perms) if len(perms) > 1 else perms[0])[:k]
        return self._seeded_iteration()

    def _seeded_iteration(self) -> List[Any]:
        """Iterate any other sampler (or a user's batch sampler) with its randomness seeded
        identically on every rank (or, with ``randomness``, with the user's generators)."""
        base = self.base
        if self.randomness is not None and self.randomness.owner is not None:
            return self.randomness.iterate(base)
        gen = getattr(base, "generator", None)
        if isinstance(gen, torch.Generator):
            gen.manual_seed(self.seed + self.epoch)
            return list(base)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + self.epoch)
            return list(base)

    def _plan(self) -> List[List[int]]:
        """This rank's batches for the epoch; records how the last round was padded."""
        self.last_round_real = self.last_round_total = 0
        if self.batches_given:
            return self._plan_batches([list(b) if isinstance(b, (list, tuple)) else b
                                       for b in self._seeded_iteration()])
        return self._plan_samples(self._order())

    def _plan_samples(self, order: Union[torch.Tensor, List[Any]]) -> List[List[Any]]:
        """Rounds of ``W*b`` consecutive samples; rank ``r`` takes slice ``r`` of each. For a
        tensor order, the full rounds are one view (``order.view(rounds, W, b)[:, r]``) and one
        ``tolist()`` of this rank's share, not of the whole permutation."""
        w, r, b = self.num_replicas, self.rank, self.batch_size
        n = len(order)
        per_round = w * b
        full = n // per_round
        if isinstance(order, torch.Tensor):
            mine = order[: full * per_round].view(full, w, b)[:, r].tolist()
            tail = order[full * per_round :].tolist()
        else:
            mine = [order[k * per_round + r * b : k * per_round + (r + 1) * b] for k in range(full)]
            tail = list(order[full * per_round :])
        m = len(tail)
        if m and not self.drop_last:
            if self.even_batches:  # whole batches of the epoch's first samples (Accelerate's), or an even split
                per = b if self.whole_last_batches else -(-m // w)
                need = per * w - m
                head = order[:need].tolist() if isinstance(order, torch.Tensor) else list(order[:need])
                ring = tail + (head * (-(-need // n)))[:need] if need else tail
                mine.append(ring[r * per : (r + 1) * per])
                self.last_round_real, self.last_round_total = m, per * w
            elif tail[r * b : (r + 1) * b]:
                mine.append(tail[r * b : (r + 1) * b])
        return mine

    def _plan_batches(self, batches: List[Any]) -> List[Any]:
        """A user's batch sampler: whole batches dealt round-robin. (A ``batch_size=None``
        loader's sampler items are dealt the same way, whatever they are.)"""
        if self.whole_last_batches and self.even_batches and not self.drop_last:
            return self._plan_whole_batches(batches)
        w, r = self.num_replicas, self.rank
        full = len(batches) // w
        mine = [batches[k * w + r] for k in range(full)]
        rest = len(batches) - full * w
        if rest and not self.drop_last:
            tail = batches[full * w :]
            if self.even_batches:
                ring = tail + [batches[i % len(batches)] for i in range(w - rest)]
                mine.append(ring[r])
                if all(isinstance(b, list) for b in ring):  # else (batch_size=None items) sizes are unknown
                    self.last_round_real = sum(len(b) for b in tail)
                    self.last_round_total = sum(len(b) for b in ring)
            elif r < rest:
                mine.append(tail[r])
        return mine

    def _plan_whole_batches(self, batches: List[List[Any]]) -> List[List[Any]]:
        """A user's batch sampler with ``whole_last_batches``, dealt as Accelerate's
        ``BatchSamplerShard`` deals it: a round ends with a batch of ``batch_size``; in the last
        one the short batch is completed, and the missing batches made, from the indices of the
        epoch's first ``W`` batches (repeated as needed), so every rank's last batch has
        ``batch_size`` indices."""
        w, r, b = self.num_replicas, self.rank, int(self.batch_size or 0)
        full = len(batches) // w
        if full and len(batches[full * w - 1]) != b:  # the last round's short batch: completed below
            full -= 1
        mine = [batches[k * w + r] for k in range(full)]
        tail = [list(batch) for batch in batches[full * w:]]
        if tail:
            initial = [i for batch in batches[:w] for i in batch]
            while len(initial) < w * b:
                initial += initial
            used = max(b - len(tail[-1]), 0)
            tail[-1] += initial[:used]
            while len(tail) < w:
                tail.append(initial[used:used + b])
                used += b
            mine.append(tail[r])
            self.last_round_real = sum(len(batch) for batch in batches[full * w:])
            self.last_round_total = w * b
        return mine

    def __iter__(self) -> Iterator[List[int]]:
        """This rank's batches of the epoch, planned at the first ``next()`` (as torch's samplers
        draw lazily: a DataLoader with workers calls ``iter()`` twice when it makes an iterator
        and advances only the second, so an eager plan would draw the epoch's order twice)."""
        plan = self._plan()
        skip, self.skip = self.skip, 0
        yield from plan[skip:]

    def __len__(self) -> int:
        """Batches this rank yields per epoch."""
        n, w, r = len(self.base), self.num_replicas, self.rank
        per_round = w if self.batches_given else w * self.batch_size
        full, rest = divmod(n, per_round)
        if not rest or self.drop_last:
            return full
        if self.even_batches:
            return full + 1
        share = 1 if self.batches_given else self.batch_size
        return full + (1 if rest > r * share else 0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        if isinstance(self.base, SeedableRandomSampler):  # the sampler shown keeps the epoch it deals
            self.base.set_epoch(self.epoch)
