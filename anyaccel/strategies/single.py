"""One process: the model is used as it is."""

from __future__ import annotations

from .base import Strategy

__all__ = ["SingleStrategy"]


class SingleStrategy(Strategy):
    """The strategy of a job with one process (any device)."""

    name = "single"
