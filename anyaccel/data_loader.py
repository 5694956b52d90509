"""``anyaccel.data_loader``: Accelerate's ``accelerate.data_loader`` module path.

Re-exports: :func:`prepare_data_loader` (Accelerate's signature), :class:`SeedableRandomSampler`,
the ``isinstance`` classes :class:`DataLoaderShard` / :class:`DataLoaderDispatcher`
(:mod:`anyaccel.data.accelerate_names`), and :func:`skip_first_batches` (:mod:`anyaccel.data`).
Accelerate's internal loader classes (``BatchSamplerShard``, ``IterableDatasetShard``,
``SkipDataLoader``, ...) have no counterpart: anyaccel has one prepared-loader class
(:class:`anyaccel.data.PreparedDataLoader`).
"""

from __future__ import annotations

from .data import PreparedDataLoader, skip_first_batches
from .data.accelerate_names import DataLoaderDispatcher, DataLoaderShard, SeedableRandomSampler, prepare_data_loader

__all__ = ["prepare_data_loader", "skip_first_batches", "SeedableRandomSampler", "DataLoaderShard",
           "DataLoaderDispatcher", "PreparedDataLoader"]
