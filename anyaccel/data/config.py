"""``DataLoaderConfiguration``: how ``prepare`` cuts a DataLoader over the processes (Hugging Face
Accelerate's dataclass, same field names and defaults). Local: a plain value object."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

from .. import lazyclass

__all__ = ["DataLoaderConfiguration", "resolve_dataloader_config"]


@lazyclass.dataclass
class DataLoaderConfiguration:
    """How prepared DataLoaders are sharded; pass it as ``Accelerator(dataloader_config=...)``.

    Args:
        split_batches: ``False`` (default): the loader's ``batch_size`` is per process, so a step
            consumes ``num_processes * batch_size`` samples. ``True``: it is the global batch,
            divided over the processes (it must be a multiple of their number).
        even_batches: ``True`` (default) pads the last round of an epoch with the first samples
            so every process runs the same number of steps (``gather_for_metrics`` drops the
            padding); ``False`` leaves the last batches uneven (some processes may get none).
        dispatch_batches: ``True``: the main process reads the loader and sends every other
            process its batches (for iterable datasets: streams that must be read once, or that
            are not identical on every process). ``None`` (default): ``True`` for an
            ``IterableDataset``, ``False`` otherwise, as in Accelerate. Map-style datasets are
            read by index, each process only its share, so ``True`` is refused for them.
        use_seedable_sampler: ``False`` (default): the epoch's order comes from the loader's own
            sampler and generator, exactly as the original DataLoader would iterate it (one
            process yields the original batches; several processes each take their share of that
            same order). ``True``: a shuffled order is a function of ``(data_seed, epoch)``, so
            ``set_epoch(e)`` replays epoch ``e`` wherever it is called.
        data_seed: the seed of the seedable order (``None``: the main process's
            ``torch.initial_seed()``, i.e. what ``set_seed`` set, as in Accelerate). Only with
            ``use_seedable_sampler=True``.
        non_blocking: accepted for Accelerate compatibility; both values behave the same,
            because the device backends already copy batches with ``non_blocking=True`` (torch
            makes that copy synchronous where it would not be safe, e.g. from pageable memory).
        use_stateful_dataloader: ``False`` (default, as in Accelerate): ``load_state`` restores
            each loader's epoch and shuffle, and a loader saved mid-epoch runs that epoch again
            from its first batch (the script skips what it had done: ``skip_first_batches``).
            ``True``: ``load_state`` also restores the position, so the next iteration continues
            after the batches already seen (``Accelerator.resume`` always does). Every prepared
            loader is stateful either way (``state_dict``/``load_state_dict``), without torchdata.
        whole_last_batches: with ``even_batches``, how the last, incomplete round of an epoch is
            padded. ``False`` (anyaccel's default): its samples are split evenly, ``ceil(m / N)``
            each, padded with the epoch's first samples only up to that (400 samples, batch 16,
            2 processes: the last round's 16 samples give each process 8). ``True``: every process
            gets a whole batch of ``batch_size``, completed with the epoch's first samples, exactly
            as Accelerate deals it (there rank 1's last batch is samples 0-15): fixed batch shapes
            for static-shape compilation and BatchNorm, at the cost of more repeated samples
            (``gather_for_metrics`` drops them either way). ``None`` (what a configuration made
            without the field has, such as one made in a script written for Accelerate, whose class
            has no such field): what ``anyaccel launch --whole_last_batches`` (or the config file's
            ``whole_last_batches``) said, else False — also for a configuration assigned to
            ``accelerator.dataloader_config`` after the ``Accelerator`` was made. Applies to
            samplers, batch samplers with a ``batch_size`` and iterable datasets batched by the
            DataLoader (see :mod:`anyaccel.data`); a loader without a batch size raises.
    """

    split_batches: bool = False
    dispatch_batches: Optional[bool] = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: Optional[int] = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False
    whole_last_batches: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.data_seed is not None and not self.use_seedable_sampler:
            raise ValueError(f"data_seed={self.data_seed} only applies with use_seedable_sampler=True; set both, "
                             "or seed the DataLoader's own generator (DataLoader(..., generator=g))")
        if self.data_seed is not None and not isinstance(self.data_seed, int):
            raise TypeError(f"data_seed must be an int; got {type(self.data_seed).__name__}")

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


_LEGACY = ("split_batches", "even_batches", "dispatch_batches")


def resolve_dataloader_config(config: Optional[DataLoaderConfiguration], *, whole_last_batches: bool = False,
                              **legacy: Any) -> DataLoaderConfiguration:
    """Merge ``Accelerator(dataloader_config=...)`` with the older keyword arguments
    ``split_batches``/``even_batches``/``dispatch_batches`` (``None`` = not given). Giving both a
    config and a keyword that disagrees with it raises ``ValueError`` naming both values. A
    ``whole_last_batches`` field left ``None`` becomes ``whole_last_batches`` (the launcher's
    value, else the default): the one place that rule is applied, for the constructor's argument
    and for a configuration assigned to ``accelerator.dataloader_config`` later. Local."""
    if config is not None and not isinstance(config, DataLoaderConfiguration):
        raise TypeError(f"dataloader_config must be a DataLoaderConfiguration; got {type(config).__name__}")
    config = _settle(config, whole_last_batches)
    unknown = set(legacy) - set(_LEGACY)
    if unknown:
        raise TypeError(f"unknown data loader arguments {sorted(unknown)}")
    given = {k: v for k, v in legacy.items() if v is not None}
    if config is None:
        return DataLoaderConfiguration(**given, whole_last_batches=bool(whole_last_batches))
    for name, value in given.items():
        if getattr(config, name) != value:
            raise ValueError(f"Accelerator({name}={value!r}) contradicts dataloader_config.{name}="
                             f"{getattr(config, name)!r}; set it in DataLoaderConfiguration only")
    return config


def _settle(config: Optional[DataLoaderConfiguration], whole_last_batches: bool) -> Optional[DataLoaderConfiguration]:
    if config is None or config.whole_last_batches is not None:
        return config
    return dataclasses.replace(config, whole_last_batches=bool(whole_last_batches))
