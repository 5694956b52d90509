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
* ``drop_last=True`` drops the incomplete round instead; ``even_batches=False`` leaves it
  unpadded, dealt in batches of ``b`` (some ranks get a shorter last batch, or none).
* Planning an epoch costs one tensor view of the permutation (``order.view(rounds, W, b)[:, r]``)
  and one ``tolist()`` of this rank's share — less than ``DistributedSampler`` on large datasets.

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

Modules: :mod:`.sampler` (which samples a rank takes), :mod:`.loader` (what ``prepare`` returns:
iteration, device feeding through the backend, positions). Everything is local to a process
except :func:`shared_seed` and :func:`prepare_data_loader`, which are collective.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from .loader import PreparedDataLoader, skip_first_batches
from .sampler import ShardedBatchSampler, shared_seed

__all__ = ["ShardedBatchSampler", "PreparedDataLoader", "prepare_data_loader", "shared_seed", "skip_first_batches"]


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
    feed: Optional[Callable[[Iterable[Any]], Iterable[Any]]] = None,
    even_batches: bool = True,
) -> PreparedDataLoader:
    """Build this process's sharded view of ``loader``; ``feed`` (the backend's) takes its host
    batches to ``device``. With ``even_batches=False`` the last round is not padded: some ranks get
    a shorter last batch or none. Collective (draws the shared shuffle seed on rank 0 and
    broadcasts it): every rank prepares its loaders in the same order."""
    if isinstance(loader, PreparedDataLoader):
        return loader
    kwargs = {k: getattr(loader, k) for k in _LOADER_ARGS if hasattr(loader, k)}
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
    if isinstance(loader.dataset, IterableDataset):
        return PreparedDataLoader(loader, None, device, feed, tracker, num_replicas, rank,
                                  iterable_drop_last=bool(loader.drop_last))
    seed = shared_seed(loader.generator)
    user_batch_sampler = loader.batch_sampler
    batches_given = not (isinstance(user_batch_sampler, BatchSampler) and type(user_batch_sampler) is BatchSampler)
    if batches_given:
        if split_batches:
            raise ValueError("split_batches=True needs a DataLoader built with batch_size=..., not a custom batch_sampler")
        sampler = ShardedBatchSampler(user_batch_sampler, getattr(user_batch_sampler, "batch_size", None),
                                      getattr(user_batch_sampler, "drop_last", False), num_replicas, rank, seed,
                                      batches_given=True, even_batches=even_batches)
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
                                      num_replicas, rank, seed, even_batches=even_batches)
    kwargs["generator"] = torch.Generator()  # private: worker seeds per (seed, epoch, rank), see _begin_epoch
    new = DataLoader(loader.dataset, batch_sampler=sampler, **kwargs)
    return PreparedDataLoader(new, sampler, device, feed, tracker, num_replicas, rank)
