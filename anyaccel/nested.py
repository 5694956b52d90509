"""Apply a function to every tensor inside nested Python containers (local, no communication)."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["map_tensors"]


def map_tensors(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """Return ``data`` with ``fn`` applied to each tensor in tuples, lists, namedtuples and dicts
    (subclasses kept where they can be rebuilt). Other objects pass through unchanged."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, dict):
        out = {k: map_tensors(fn, v) for k, v in data.items()}
        if type(data) is dict:
            return out
        try:
            return type(data)(out)
        except TypeError:  # e.g. defaultdict: keep the values, lose the factory
            return out
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(map_tensors(fn, v) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(map_tensors(fn, v) for v in data)
    return data
