"""Logging and progress bars that behave in a multi-process job.

* :func:`get_logger` returns a :class:`MultiProcessAdapter` around a standard :mod:`logging`
  logger. Each record is prefixed ``[rank N]``. By default only the main process (rank 0) emits
  it; ``main_process_only=False`` makes every rank emit; ``in_order=True`` makes every rank emit,
  one rank after another (rank 0 first), with a barrier between ranks. Same keywords as Hugging
  Face Accelerate's ``get_logger``, but no ``Accelerator`` (or any other state) is needed first:
  the rank comes from ``torch.distributed`` when a process group exists, else from the
  launcher's environment variables (:func:`anyaccel.environment.resolve_environment`).
* :func:`progress` returns a tqdm bar that is drawn by one process only (the others get a disabled
  bar with the same methods, so ``bar.set_postfix(...)`` works everywhere).

Like any library, this module adds no handler: configure output once in your script, e.g.
``logging.basicConfig(level=logging.INFO)``. ``ANYACCEL_LOG_LEVEL`` sets the level of loggers
created by :func:`get_logger` when ``log_level`` is not given.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any, Iterable, Optional, Tuple

from . import envvars

__all__ = ["get_logger", "MultiProcessAdapter", "progress", "process_position"]


def process_position() -> Tuple[int, int, int]:
    """``(rank, local_rank, world_size)`` of the calling process, without side effects.

    Uses the default ``torch.distributed`` group when one exists (for rank and world size), else
    the launcher's variables (torchrun, SLURM ``srun``, MPI). Returns ``(0, 0, 1)`` outside any
    job or when the variables are inconsistent. Local: no communication.
    """
    local_rank = None
    try:
        from .environment import resolve_environment

        env = resolve_environment(cpu=True)  # cpu=True: never query the GPUs just to log
        rank, local_rank, world = env.rank, env.local_rank, env.world_size
    except Exception:  # a logger must never be the thing that crashes the job
        rank, local_rank, world = 0, 0, 1
    ops = _ops()
    if ops is not None and ops.world_size() > 1:
        rank, world = ops.rank(), ops.world_size()
    return rank, local_rank, world


def _ops() -> Any:
    """:mod:`anyaccel.ops` once a job may exist (torch.distributed loaded), else None: a logger
    made before any ``Accelerator`` imports nothing heavy."""
    if "torch.distributed" not in sys.modules:
        return None
    from . import ops

    return ops


def _barrier() -> None:
    ops = _ops()
    if ops is not None:
        ops.barrier()


class MultiProcessAdapter(logging.LoggerAdapter):
    """A :class:`logging.LoggerAdapter` that knows about ranks.

    Every logging method (``debug``, ``info``, ``warning``, ``error``, ``exception``,
    ``critical``, ``log``) accepts two extra keywords:

    * ``main_process_only`` (default True): emit on rank 0 only. False: emit on every rank.
    * ``in_order`` (default False): emit on every rank, one rank at a time in rank order.
      Collective: every rank must make the same call (it contains ``world_size`` barriers).

    Messages are prefixed ``[rank N]``. Deciding *whether* to emit is local, so a main-only
    message costs the other ranks one environment lookup and nothing else.
    """

    def __init__(self, logger: logging.Logger, extra: Optional[dict] = None):
        super().__init__(logger, extra or {})

    def process(self, msg: Any, kwargs: Any) -> Tuple[Any, Any]:
        rank = kwargs.pop("_rank", None)
        if rank is None:
            rank = process_position()[0]
        return f"[rank {rank}] {msg}", kwargs

    def log(self, level: int, msg: Any, *args: Any, main_process_only: bool = True, in_order: bool = False,
            **kwargs: Any) -> None:
        """Log ``msg`` at ``level`` on rank 0 only (default), on every rank
        (``main_process_only=False``) or on every rank in rank order (``in_order=True``,
        collective)."""
        if in_order:
            rank, _, world = process_position()
            for turn in range(world):
                if turn == rank and self.isEnabledFor(level):
                    self._emit(level, msg, args, kwargs, rank)
                _barrier()
            return
        if not self.isEnabledFor(level):
            return
        rank = process_position()[0]
        if main_process_only and rank != 0:
            return
        self._emit(level, msg, args, kwargs, rank)

    def _emit(self, level: int, msg: Any, args: tuple, kwargs: dict, rank: int) -> None:
        kwargs = dict(kwargs, _rank=rank)
        msg, kwargs = self.process(msg, kwargs)
        kwargs.setdefault("stacklevel", 3)  # report the caller's file/line, not this module's
        self.logger.log(level, msg, *args, **kwargs)

    # LoggerAdapter's helpers (info, warning, ...) call self.log(level, msg, *args, **kwargs), so the
    # extra keywords reach log() above. exception() also sets exc_info.

    @functools.lru_cache(maxsize=None)  # noqa: B019 - one adapter per name, lives as long as the logger
    def warning_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        """``warning`` that emits a given message only the first time it is called (per process).
        Arguments must be hashable."""
        self.warning(msg, *args, **kwargs)


def get_logger(name: str, log_level: Optional[Any] = None) -> MultiProcessAdapter:
    """A rank-aware logger for ``name`` (usually ``__name__``). Local: each process calls it.

    ``log_level`` (e.g. ``"INFO"`` or ``logging.DEBUG``; default ``ANYACCEL_LOG_LEVEL`` when set)
    sets the underlying logger's level. Output still needs a handler, e.g.
    ``logging.basicConfig(level=logging.INFO)`` at the top of the script.

    Example::

        logger = get_logger(__name__)
        logger.info("epoch %d done", epoch)                 # rank 0 only: "[rank 0] epoch 3 done"
        logger.info("my shard has %d samples", n, main_process_only=False)   # every rank
        logger.info("rank-ordered report", in_order=True)  # every rank, 0 then 1 then ...
    """
    if log_level is None:
        log_level = os.environ.get(envvars.LOG_LEVEL.name) or None
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper() if isinstance(log_level, str) else log_level)
    return MultiProcessAdapter(logger, {})


def progress(iterable: Optional[Iterable] = None, main: bool = True, **tqdm_kwargs: Any):
    """A tqdm progress bar over ``iterable`` that is drawn only where ``main`` is True.

    Where ``main`` is False the bar is a disabled tqdm: iterating it yields the same items with
    no output and ``update``/``set_postfix``/``close`` are no-ops, so one code path serves every
    rank. Local. ``Accelerator.progress`` calls this with ``main=accelerator.is_local_main_process``
    (one bar per node); pass ``main=accelerator.is_main_process`` for one bar per job.

    tqdm is imported when a bar is first requested, not when :mod:`anyaccel` is imported.
    """
    from tqdm.auto import tqdm

    disable = bool(tqdm_kwargs.pop("disable", False)) or not main
    return tqdm(iterable, disable=disable, **tqdm_kwargs)
