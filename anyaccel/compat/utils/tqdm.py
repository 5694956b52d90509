"""``anyaccel.utils.tqdm``: Accelerate's rank-aware ``tqdm``."""

from __future__ import annotations

from typing import Any

__all__ = ["tqdm"]


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm(*args, **kwargs)``, drawn only on each node's local main process when
    ``main_process_only`` (the other ranks iterate silently). Local."""
    from ...environment import resolve_environment
    from ...logging import progress

    iterable = args[0] if args else kwargs.pop("iterable", None)
    if len(args) > 1:
        raise TypeError("tqdm(): pass options by keyword (desc=..., total=...) after the iterable")
    return progress(iterable, main=not main_process_only or resolve_environment().local_rank == 0, **kwargs)
