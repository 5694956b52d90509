"""What one process holds of a sharded tensor, for the replica groups' average and heal.

Inside a replica group of several processes (FSDP2, tensor parallel) a parameter, its gradient and
its optimizer state are ``DTensor``\\ s of which each rank holds a shard. torchft joins rank ``r`` of
every replica group into one gradient group and lets rank ``r`` of a healing group fetch from rank
``r`` of a live one; the groups are split alike, so rank ``r`` holds the same shard everywhere.
Each rank therefore averages and sends **its local shard** (no gather, no rank holding the whole
state), and a received shard is put back into the receiving rank's own ``DTensor``\\ s.
Local, pure functions (no communication).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["local_part", "local_tree", "like_parameter"]


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this process holds: a ``DTensor``'s local shard (sharing its
    storage, so writing it writes the ``DTensor``), any other tensor itself. The ``DTensor``'s
    own local tensor is taken as it is (``_local_tensor``, what FSDP2 itself writes gradients
    into), not through ``to_local()``, an autograd function: this runs for every parameter at every
    step boundary (:mod:`.healing`) and every gradient bucket. Local."""
    local = getattr(tensor, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def local_tree(obj: Any) -> Any:
    """``obj`` (dicts, lists, tuples of tensors and values) with every ``DTensor`` replaced by its
    local shard (by reference). Local."""
    if isinstance(obj, torch.Tensor):
        return local_part(obj)
    if isinstance(obj, dict):
        return {k: local_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(local_tree(v) for v in obj)
    return obj


def like_parameter(param: torch.Tensor, value: Any) -> Any:
    """``value`` (a received local shard of one of ``param``'s optimizer states) as ``param``
    holds its states: a ``DTensor`` on ``param``'s mesh and placements when ``param`` is one and
    ``value`` has its local shape (a scalar such as Adam's ``step`` stays as it is). Local."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None or not isinstance(value, torch.Tensor) or value.shape != local_part(param).shape \
            or value.dim() == 0:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value.to(local_part(param).device), mesh, param.placements,  # type: ignore[attr-defined]
                              run_check=False, shape=param.shape, stride=param.stride())

