"""What every tracker is: :class:`GeneralTracker` (Accelerate's shape), and how logged values are
turned into plain Python numbers and strings. Local."""

from __future__ import annotations

import json
import numbers
from typing import Any, Dict, Optional

__all__ = ["GeneralTracker", "to_python"]


def to_python(key: str, value: Any) -> Any:
    """Turn one logged value into a Python number/str/bool (dicts recursively). Local."""
    if isinstance(value, dict):
        return {k: to_python(f"{key}/{k}", v) for k, v in value.items()}
    if isinstance(value, (bool, str)) or value is None:
        return value
    if isinstance(value, numbers.Number):
        return value
    if hasattr(value, "item") and hasattr(value, "shape"):  # torch tensor / numpy array or scalar
        size = 1
        for dim in tuple(value.shape):
            size *= int(dim)
        if size != 1:
            raise TypeError(f"log(): value for {key!r} is an array of shape {tuple(value.shape)}; log scalars "
                            "(e.g. loss.mean()) or log one value per key")
        return value.item()
    raise TypeError(f"log(): value for {key!r} is a {type(value).__name__}; log numbers, strings, "
                    "1-element tensors or dicts of them")


def _flatten(values: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in values.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, prefix=name + "/"))
        else:
            out[name] = v
    return out


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item") and hasattr(obj, "shape") and len(tuple(obj.shape)) == 0:
        return obj.item()
    return str(obj)


def _write_json(path: str, data: Any) -> None:
    from ..fileio import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True, default=_json_default))


class GeneralTracker:
    """Base class for trackers (same shape as Hugging Face Accelerate's).

    Subclasses set ``name`` and implement :meth:`log`; the rest is optional. ``main_process_only``
    (default True) means the tracker is used on rank 0 only; set it False to be called on every
    rank (your tracker then decides what each rank does).
    """

    name: str = "general"
    requires_logging_directory: bool = False
    main_process_only: bool = True

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        """Record the run's hyper-parameters (called by ``init_trackers(..., config=...)``)."""

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Record the scalar ``values`` at ``step``."""
        raise NotImplementedError(f"{type(self).__name__}.log(values, step) is not implemented")

    def finish(self) -> None:
        """Flush and close (called by ``end_training``)."""

    @property
    def tracker(self) -> Any:
        """The underlying object (``get_tracker(name, unwrap=True)``); the tracker itself by default."""
        return self
