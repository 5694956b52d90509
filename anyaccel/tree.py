"""Nested containers of tensors: the one walker behind ``send_to_device``, the collectives and
state-dict conversions. Local (no communication).

Containers: tuples, lists, namedtuples and dicts (subclasses are rebuilt with their own type when
their constructor allows it, else as the plain type). Everything else is a leaf.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

__all__ = ["map_tensors", "flatten"]


def _walk(node: Any, leaf: Callable[[Any], Any], sig: Optional[List[str]]) -> Any:
    """Rebuild ``node`` with ``leaf(x)`` in place of every non-container ``x``; when ``sig`` is a
    list, append a text description of the containers (types, keys, lengths) to it."""
    if isinstance(node, torch.Tensor):
        if sig is not None:
            sig.append("T")
        return leaf(node)
    if isinstance(node, dict):
        if sig is not None:
            sig.append("{" + ",".join(map(str, node.keys())) + "}")
        out = {k: _walk(v, leaf, sig) for k, v in node.items()}
        if type(node) is dict:
            return out
        try:
            return type(node)(out)
        except TypeError:  # e.g. defaultdict: keep the values, lose the factory
            return out
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        if sig is not None:
            sig.append("N" + type(node).__name__)
        return type(node)(*(_walk(v, leaf, sig) for v in node))
    if isinstance(node, (list, tuple)):
        if sig is not None:
            sig.append(("L" if isinstance(node, list) else "U") + str(len(node)))
        return type(node)(_walk(v, leaf, sig) for v in node)
    return leaf(node)


def map_tensors(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """Return ``data`` with ``fn`` applied to each tensor inside it; other leaves unchanged."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    return _walk(data, lambda x: fn(x) if isinstance(x, torch.Tensor) else x, None)


class _Slot:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _single(new: Sequence[Any]) -> Any:
    return new[0]


def flatten(data: Any) -> Tuple[List[torch.Tensor], Callable[[Sequence[Any]], Any], str]:
    """Split ``data`` into its tensor leaves, a function rebuilding the structure from new leaves
    (same order), and a short text signature of the structure (keys and container types; two
    ranks with the same signature hold the same layout). Raises ``TypeError`` for a leaf that is
    not a tensor."""
    if isinstance(data, torch.Tensor):
        return [data], _single, "T"
    leaves: List[torch.Tensor] = []
    sig: List[str] = []

    def take(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"collectives take tensors or tuples/lists/dicts of tensors; found {type(x).__name__}. "
                "Use gather_object() for other Python objects."
            )
        leaves.append(x)
        return _Slot(len(leaves) - 1)

    spec = _walk(data, take, sig)
    return leaves, lambda new: _walk(spec, lambda slot: new[slot.index], None), "".join(sig)
