"""Which samples each rank takes in an epoch: :class:`ShardedBatchSampler` (local) and the shared
shuffle seed (collective). See :mod:`anyaccel.data` for how an epoch is cut."""

from __future__ import annotations

from typing import Any, Iterator, List, Optional, Union

import torch
from torch.utils.data import RandomSampler, Sampler, SequentialSampler

from .. import ops

__all__ = ["ShardedBatchSampler", "shared_seed"]


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
        even_batches: bool = True,
    ):
        self.base = base
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.batches_given = batches_given
        self.even_batches = even_batches
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
        if isinstance(base, RandomSampler):
            n, k = len(base.data_source), base.num_samples
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            if base.replacement:
                return torch.randint(high=n, size=(k,), dtype=torch.int64, generator=g)
            perms = [torch.randperm(n, generator=g) for _ in range(-(-k // n))]  # as torch: whole permutations
            return (torch.cat(perms) if len(perms) > 1 else perms[0])[:k]
        return self._seeded_iteration()

    def _seeded_iteration(self) -> List[Any]:
        """Iterate any other sampler (or a user's batch sampler) with its randomness seeded
        identically on every rank."""
        base = self.base
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
            return self._plan_batches([list(b) for b in self._seeded_iteration()])
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
            if self.even_batches:
                per = -(-m // w)
                need = per * w - m
                head = order[:need].tolist() if isinstance(order, torch.Tensor) else list(order[:need])
                ring = tail + (head * (-(-need // n)))[:need] if need else tail
                mine.append(ring[r * per : (r + 1) * per])
                self.last_round_real, self.last_round_total = m, per * w
            elif tail[r * b : (r + 1) * b]:
                mine.append(tail[r * b : (r + 1) * b])
        return mine

    def _plan_batches(self, batches: List[List[int]]) -> List[List[int]]:
        """A user's batch sampler: whole batches dealt round-robin."""
        w, r = self.num_replicas, self.rank
        full = len(batches) // w
        mine = [batches[k * w + r] for k in range(full)]
        rest = len(batches) - full * w
        if rest and not self.drop_last:
            tail = batches[full * w :]
            if self.even_batches:
                ring = tail + [batches[i % len(batches)] for i in range(w - rest)]
                mine.append(ring[r])
                self.last_round_real = sum(len(b) for b in tail)
                self.last_round_total = sum(len(b) for b in ring)
            elif r < rest:
                mine.append(tail[r])
        return mine

    def __iter__(self) -> Iterator[List[int]]:
        plan = self._plan()
        skip, self.skip = self.skip, 0
        return iter(plan[skip:])

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
