"""Sharded data loading: each process sees a disjoint share of every epoch.

How an epoch is cut (``W`` processes, per-process batch ``b``):

* One global order per epoch, identical on every rank. By default (Accelerate's
  ``use_seedable_sampler=False``) it is the order the user's own DataLoader would produce: its
  sampler iterated with its own generators (rank 0's states, broadcast when an epoch starts),
  drawn exactly as torch draws them (see :class:`~.sampler.UserGenerators`), so one process
  yields the original loader's batches. With ``DataLoaderConfiguration(
  use_seedable_sampler=True)`` a shuffled order is instead ``randperm`` seeded with
  ``seed + epoch``, as Accelerate's ``SeedableRandomSampler`` (the seed is ``data_seed``, or rank
  0's ``torch.initial_seed()``), so ``set_epoch(e)`` replays epoch ``e``.
* The order is read in *rounds* of ``W*b`` samples; in round ``k`` rank ``r`` takes samples
  ``[k*W*b + r*b, k*W*b + (r+1)*b)`` (the original loader's batch ``k*W + r``, as Accelerate
  deals them). Concatenating the ranks' ``k``-th batches in rank order (what a gather does) gives
  back round ``k`` in order, so 2 processes × batch ``b`` see exactly the batches of 1 process ×
  batch ``2b``.
* The last, incomplete round of ``m`` samples is split evenly (``ceil(m/W)`` each), padded with
  the first samples of the epoch so that every rank runs the same number of steps (no rank waits
  forever in a collective). The loader remembers how many of those were padding, and
  ``gather_for_metrics`` removes them: over an epoch each sample is counted exactly once.
* ``drop_last=True`` drops the incomplete round instead; ``even_batches=False`` leaves it
  unpadded, dealt in batches of ``b`` (some ranks get a shorter last batch, or none).
* ``whole_last_batches=True`` (see :class:`DataLoaderConfiguration`) pads the last round to whole
  batches instead, as Accelerate deals it: ``W*b`` samples completed with the epoch's first ones,
  rank ``r`` taking slice ``r`` — for a sampler, a user's batch sampler with a ``batch_size``
  (Accelerate's ``BatchSamplerShard``) and an iterable dataset's stream (Accelerate's
  ``IterableDatasetShard``; with ``dispatch_batches`` too, where Accelerate itself splits the last
  batch evenly instead), so every batch has ``b`` samples.
* Planning an epoch of a ``RandomSampler`` or ``SequentialSampler`` costs one tensor view of the
  order (``order.view(rounds, W, b)[:, r]``) and one ``tolist()`` of this rank's share; other
  samplers are iterated as lists.

A user-supplied ``batch_sampler`` (or a ``batch_size=None`` loader's sampler, such as
``sampler=BatchSampler(...)``) is sharded by whole items in the same round-robin way. An
``IterableDataset`` is cut into rounds of ``W`` batches of the stream, rank ``r`` keeping batch
``r`` of each; with ``dispatch_batches`` (the default for iterable datasets, as in Accelerate)
rank 0 alone reads the stream and broadcasts each round, otherwise every rank reads it.

Exact resume: ``PreparedDataLoader.state_dict()`` records the epoch, the batches already yielded,
the seed and (default mode) the user generators' states at the start of the epoch. The next
iteration after ``load_state_dict`` replays the saved epoch's order from the saved position, and
the following iterations move on as an uninterrupted run would; an iterable dataset re-reads its
stream and drops the batches already seen. The inner DataLoader gets a private generator which,
when an epoch starts, takes the state the user's loader generator (or the global RNG) has just
before torch would draw the worker base seed from it — so torch draws the same base seed and the
workers get the seeds of the original DataLoader, bitwise (seedable mode: reseeded with a function
of ``(seed, epoch, rank)``). The sharded sampler plans an epoch lazily, at its first ``next()``,
as torch's samplers draw (a DataLoader with workers calls ``iter()`` on its sampler twice per
iterator). The global RNG is drawn from only where the
original DataLoader draws from it (a loader or sampler without a generator), and not again on a
resumed epoch, so a resumed run's dropout masks match the uninterrupted run's. Randomness drawn
*inside* worker processes is not replayed for the batches skipped on resume.

Modules: :mod:`.config` (:class:`DataLoaderConfiguration`), :mod:`.sampler` (which samples a rank
takes), :mod:`.prepared_loader` (what ``prepare`` returns: iteration, device feeding through the backend,
positions). Everything is local to a process
except :func:`shared_seed` and :func:`prepare_data_loader`, which are collective.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from .. import ops
from .config import DataLoaderConfiguration, resolve_dataloader_config
from .prepared_loader import PreparedDataLoader, skip_first_batches
from .sampler import SeedableRandomSampler, ShardedBatchSampler, UserGenerators, generator_owner, shared_seed

__all__ = ["DataLoaderConfiguration", "ShardedBatchSampler", "PreparedDataLoader", "prepare_data_loader",
           "resolve_dataloader_config", "shared_seed", "skip_first_batches"]


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


def _sharded_sampler(loader: DataLoader, num_replicas: int, rank: int,
                     config: DataLoaderConfiguration) -> ShardedBatchSampler:
    """The :class:`ShardedBatchSampler` dealing ``loader``'s batches (or its sampler's items) to
    ``rank`` of ``num_replicas``, with the seed or generators every rank shuffles alike.
    Collective (through :func:`_user_generators` / :func:`_initial_seed`)."""
    user_batch_sampler = loader.batch_sampler
    auto_batches = isinstance(user_batch_sampler, BatchSampler) and type(user_batch_sampler) is BatchSampler
    # batch_size=None: the sampler's items (often whole batches, e.g. sampler=BatchSampler(...))
    # are passed to the dataset one by one; they are dealt to the ranks like a batch sampler's.
    base = user_batch_sampler if user_batch_sampler is not None else loader.sampler
    randomness = None
    if config.use_seedable_sampler:
        seed = config.data_seed if config.data_seed is not None else _initial_seed(num_replicas)
    else:
        owner = generator_owner(base if not auto_batches else user_batch_sampler.sampler)
        inner = user_batch_sampler.sampler if auto_batches else getattr(base, "sampler", base)
        # a sampler without a generator attribute is iterated under a seed shared by the ranks (seed + epoch)
        needs_shared = owner is None and not isinstance(inner, SequentialSampler)
        randomness, seed = _user_generators(loader, owner, num_replicas, needs_shared)
    whole = bool(config.whole_last_batches)
    if user_batch_sampler is None or not auto_batches:
        if config.split_batches:
            raise ValueError("split_batches=True needs a DataLoader built with batch_size=..., not a custom "
                             "batch_sampler (or batch_size=None)")
        completes = whole and config.even_batches and not getattr(base, "drop_last", False)
        if completes and (user_batch_sampler is None or not isinstance(getattr(base, "batch_size", None), int)):
            what = ("a batch_size=None loader's sampler items" if user_batch_sampler is None
                    else f"the batch sampler {type(base).__name__}, which has no int batch_size")
            raise ValueError(f"whole_last_batches=True completes the last round with whole batches of batch_size; "
                             f"{what} give no batch size to complete. Leave whole_last_batches off for this loader "
                             "(prepare it with an Accelerator whose dataloader_config says whole_last_batches=False), "
                             "or give the batch sampler a batch_size attribute")
        sampler = ShardedBatchSampler(base, getattr(base, "batch_size", None), getattr(base, "drop_last", False),
                                      num_replicas, rank, seed, batches_given=True, even_batches=config.even_batches,
                                      randomness=randomness, whole_last_batches=whole)
    else:
        bs = user_batch_sampler.batch_size
        if config.split_batches:
            bs = _split_size(bs, num_replicas)
        inner, shown = user_batch_sampler.sampler, user_batch_sampler
        if config.use_seedable_sampler and type(inner) is RandomSampler:  # Accelerate's structure, same order
            inner = SeedableRandomSampler(inner.data_source, replacement=inner.replacement,
                                          num_samples=inner._num_samples, data_seed=seed)
            shown = BatchSampler(inner, user_batch_sampler.batch_size, user_batch_sampler.drop_last)
        sampler = ShardedBatchSampler(inner, bs, user_batch_sampler.drop_last, num_replicas, rank, seed,
                                      even_batches=config.even_batches, randomness=randomness,
                                      shown_batch_sampler=shown, whole_last_batches=whole)
    return sampler


def prepare_data_loader(
    loader: DataLoader,
    device: torch.device,
    num_replicas: int,
    rank: int,
    tracker: Any = None,
    split_batches: bool = False,
    feed: Optional[Callable[[Iterable[Any]], Iterable[Any]]] = None,
    even_batches: bool = True,
    config: Optional[DataLoaderConfiguration] = None,
) -> PreparedDataLoader:
    """Build this process's sharded view of ``loader``; ``feed`` (the backend's) takes its host
    batches to ``device``. ``config`` (a :class:`DataLoaderConfiguration`) says how; without it,
    ``split_batches`` and ``even_batches`` are used with the other fields at their defaults.
    Collective (rank 0's generator states or shuffle seed are broadcast): every rank prepares its
    loaders in the same order."""
    if isinstance(loader, PreparedDataLoader):
        return loader
    if config is None:
        config = DataLoaderConfiguration(split_batches=split_batches, even_batches=even_batches)
    kwargs = {k: getattr(loader, k) for k in _LOADER_ARGS if hasattr(loader, k)}
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
    if isinstance(loader.dataset, IterableDataset):
        return _prepare_iterable(loader, device, feed, tracker, num_replicas, rank, config)
    if config.dispatch_batches:  # asked for explicitly: rank 0 iterates the user's loader, as for a stream
        return _prepare_iterable(loader, device, feed, tracker, num_replicas, rank, config)
    sampler = _sharded_sampler(loader, num_replicas, rank, config)
    kwargs["generator"] = torch.Generator()  # private: worker seeds per epoch, see PreparedDataLoader._begin_epoch
    if loader.batch_sampler is None:
        new = DataLoader(loader.dataset, sampler=sampler, batch_size=None, **kwargs)
    else:
        new = DataLoader(loader.dataset, batch_sampler=sampler, **kwargs)
    return PreparedDataLoader(new, sampler, device, feed, tracker, num_replicas, rank)


def _initial_seed(num_replicas: int) -> int:
    """Rank 0's ``torch.initial_seed()`` (what ``set_seed`` set), the seed Accelerate's seedable
    sampler uses when no ``data_seed`` is given. Collective in a multi-process job."""
    seed = int(torch.initial_seed())
    return int(ops.broadcast_object_list([seed], from_process=0)[0]) if num_replicas > 1 else seed


def _split_size(batch_size: Optional[int], num_replicas: int) -> int:
    if batch_size is None or batch_size % num_replicas:
        raise ValueError(
            f"split_batches=True divides the batch size {batch_size} over {num_replicas} processes; "
            "choose a batch size that is a multiple of the number of processes"
        )
    return batch_size // num_replicas


def _user_generators(loader: DataLoader, owner: Any, num_replicas: int, needs_shared: bool):
    """The user's generators (see :class:`~.sampler.UserGenerators`) and, when a sampler without
    a generator attribute needs one, a seed drawn on rank 0 and broadcast (collective then)."""
    return UserGenerators(owner, loader.generator, num_replicas), shared_seed() if needs_shared else 0


def _prepare_iterable(loader: DataLoader, device: torch.device, feed: Any, tracker: Any, num_replicas: int,
                      rank: int, config: DataLoaderConfiguration) -> PreparedDataLoader:
    """An ``IterableDataset``: batches of the stream dealt to the ranks (see :class:`PreparedDataLoader`).
    Local (no communication at prepare)."""
    dispatch = config.dispatch_batches if config.dispatch_batches is not None else True
    if config.whole_last_batches and not loader.drop_last and loader.batch_size is None:
        raise ValueError("whole_last_batches=True completes the stream's last round with whole batches of batch_size; "
                         f"this DataLoader over {type(loader.dataset).__name__} has batch_size=None (the dataset or a "
                         "batch sampler makes the batches), so there is no batch size to complete. Leave "
                         "whole_last_batches off for this loader, or batch with DataLoader(batch_size=...)")
    if config.split_batches and num_replicas > 1:
        _split_size(loader.batch_size, num_replicas)
    return PreparedDataLoader(loader, None, device, feed, tracker, num_replicas, rank,
                              iterable_drop_last=bool(loader.drop_last), dispatch=dispatch,
                              split=config.split_batches and num_replicas > 1,
                              whole_last_batches=bool(config.whole_last_batches))
