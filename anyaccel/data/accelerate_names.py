"""Accelerate's ``accelerate.data_loader`` names, for scripts that use them directly.

* :func:`prepare_data_loader` with Accelerate's signature (device, process count and index given
  by the caller) over anyaccel's :func:`anyaccel.data.prepare_data_loader`.
* :class:`SeedableRandomSampler` (its home is :mod:`.sampler`): a ``RandomSampler`` whose order is a
  function of ``initial_seed + epoch`` (Accelerate's class: the same seed on every rank gives the
  same order); with ``use_seedable_sampler=True`` a prepared loader shows one where Accelerate's
  does, at ``loader.batch_sampler.batch_sampler.sampler``.
* :class:`DataLoaderShard` / :class:`DataLoaderDispatcher`: ``isinstance`` checks for a prepared
  loader that shards (every rank reads its own share) or dispatches (rank 0 reads, the others
  receive). anyaccel has one prepared-loader class; these names only classify it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..environment.devices import send_to_device
from . import prepare_data_loader as _prepare
from .config import DataLoaderConfiguration
from .prepared_loader import PreparedDataLoader
from .sampler import SeedableRandomSampler

__all__ = ["prepare_data_loader", "SeedableRandomSampler", "DataLoaderShard", "DataLoaderDispatcher"]


def prepare_data_loader(dataloader: Any, device: Optional[torch.device] = None, num_processes: Optional[int] = None,
                        process_index: Optional[int] = None, split_batches: bool = False, put_on_device: bool = False,
                        rng_types: Any = None, dispatch_batches: Optional[bool] = None, even_batches: bool = True,
                        slice_fn_for_dispatch: Any = None, use_seedable_sampler: bool = False,
                        data_seed: Optional[int] = None, non_blocking: bool = False,
                        use_stateful_dataloader: bool = False, torch_device_mesh: Any = None) -> PreparedDataLoader:
    """Accelerate's ``prepare_data_loader``: this process's share of ``dataloader`` for
    ``num_processes`` processes, as process ``process_index`` (default: the running job's), with
    batches moved to ``device`` when ``put_on_device``. Collective like
    :meth:`Accelerator.prepare_data_loader` (every rank prepares its loaders in the same order).
    ``rng_types`` is not needed (the ranks share one order by construction);
    ``slice_fn_for_dispatch`` and ``torch_device_mesh`` are refused when given."""
    if slice_fn_for_dispatch is not None or torch_device_mesh is not None:
        raise NotImplementedError("prepare_data_loader: slice_fn_for_dispatch and torch_device_mesh are not supported "
                                  "by anyaccel; leave them at None")
    if num_processes is None or process_index is None:
        from .. import ops

        num_processes = ops.world_size() if num_processes is None else num_processes
        process_index = ops.rank() if process_index is None else process_index
    device = torch.device(device) if device is not None else torch.device("cpu")
    config = DataLoaderConfiguration(split_batches=split_batches, even_batches=even_batches,
                                     dispatch_batches=dispatch_batches, use_seedable_sampler=use_seedable_sampler,
                                     data_seed=data_seed, non_blocking=non_blocking)

    def feed(batches: Any) -> Any:
        return (send_to_device(b, device, non_blocking=non_blocking) for b in batches)

    return _prepare(dataloader, device if put_on_device else torch.device("cpu"), num_processes, process_index,
                    feed=feed if put_on_device else None, config=config)


class _Kind(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, PreparedDataLoader) and bool(getattr(obj, "_dispatch", False)) == cls._dispatching


class DataLoaderShard(metaclass=_Kind):
    """``isinstance(loader, DataLoaderShard)``: a prepared loader where every rank reads its share."""

    _dispatching = False


class DataLoaderDispatcher(metaclass=_Kind):
    """``isinstance(loader, DataLoaderDispatcher)``: a prepared loader where rank 0 reads and sends."""

    _dispatching = True
