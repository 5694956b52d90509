"""Where this process stands in expert parallelism: :class:`ExpertGroup`, and the one divisibility
rule (each ep rank holds ``num_experts / ep_size`` whole experts).

Two groups matter, and they are not the same:

* the **ep group** (``group``): the processes the experts of one MoE layer are split over; a
  token's hidden state travels to the process that holds its expert and back (two all-to-alls per
  layer forward, two backward). Expert ``e`` lives on ep rank ``e // (num_experts / ep_size)``.
* the **loss group** (``loss_group``): every process whose tokens differ and that together make
  the global batch — data parallel replicas x FSDP shards (ep is carved out of these: its ranks
  read different batches) x sequence slices. Tensor-parallel and pipeline ranks are not in it
  (they see the same tokens). The router's load-balancing statistics (tokens per expert, router
  probability per expert, the number of tokens) are summed over this group, so that the auxiliary
  loss is the one a single process computes on the global batch; summing over the ep group alone
  would give ep-local statistics, different from one process as soon as there are replicas or
  FSDP shards outside ep. ``loss_size`` is also the number of processes gradients are averaged
  over (what DDP/FSDP divide by), which the loss's backward multiplies back.

Phase 1 builds the groups from process groups (:func:`expert_group`); the N-D mesh object will
hand them out by name later. No torch.distributed call happens at import.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

__all__ = ["ExpertGroup", "expert_group", "check_divisible", "local_experts"]


@dataclasses.dataclass(frozen=True)
class ExpertGroup:
    """Expert parallelism seen from one process. Local (a value; building it is not collective).

    ``group``/``size``/``rank``: the ep process group, its size and this process's index in it
    (None, 1, 0 for one process). ``mesh``: a 1-D ``DeviceMesh`` over the same processes; when
    given, sharded expert weights are DTensors ``Shard(0)`` on it (so torch.distributed.checkpoint
    and full-state gathering see one tensor of the unsharded shape); None keeps them plain local
    tensors. ``loss_group``/``loss_size``: the processes whose tokens make the global batch (see
    the module's docstring); None and 1 for one process."""

    group: Any = None
    size: int = 1
    rank: int = 0
    mesh: Any = None
    loss_group: Any = None
    loss_size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"ExpertGroup: rank {self.rank} of size {self.size} is impossible; the ep group's size "
                             "is at least 1 and its rank in range(size)")
        if self.loss_size < self.size and self.loss_group is not None:
            raise ValueError(f"ExpertGroup: the loss group ({self.loss_size} processes) must contain the ep group "
                             f"({self.size} processes): ep ranks read different batches, so their tokens are part of "
                             "the global batch")

    @property
    def enabled(self) -> bool:
        """True when experts are split over more than one process. Local."""
        return self.size > 1


def expert_group(group: Any = None, *, loss_group: Any = None, device_type: Optional[str] = "cpu") -> ExpertGroup:
    """An :class:`ExpertGroup` from process groups: ``group`` the ep group (None: every process),
    ``loss_group`` the processes whose tokens make the global batch (None: the default group, i.e.
    the whole job). ``device_type`` (``"cpu"``, ``"cuda"``) builds the 1-D ``DeviceMesh`` that
    makes sharded experts DTensors; None keeps them plain tensors. Local (no data moves:
    ``DeviceMesh.from_group`` reads the group's ranks), called on every process of ``group``. In a
    job without torch.distributed it returns the one-process group. Temporary builder until the N-D
    mesh object names these groups."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return ExpertGroup()
    group = group if group is not None else dist.group.WORLD
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    mesh = None
    if device_type is not None and size > 1:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=("ep",))
    loss = loss_group if loss_group is not None else dist.group.WORLD
    return ExpertGroup(group=group, size=size, rank=rank, mesh=mesh, loss_group=loss,
                       loss_size=dist.get_world_size(loss))


def check_divisible(num_experts: int, ep_size: int, where: str = "the experts") -> int:
    """``num_experts // ep_size``, or a ``ValueError`` naming both numbers when ``ep_size`` does not
    divide ``num_experts`` (each ep rank holds the same number of whole experts). ``where`` names
    the module in the message. Local."""
    if num_experts < 1 or ep_size < 1 or num_experts % ep_size:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0] if num_experts >= 1 else []
        raise ValueError(f"expert parallelism: {where} hold {num_experts} experts, which ep_size={ep_size} does not "
                         f"divide (each ep rank holds num_experts / ep_size whole experts). Choose an ep_size among "
                         f"{divisors}")
    return num_experts // ep_size


def local_experts(num_experts: int, ep: ExpertGroup) -> range:
    """The global ids of the experts this process holds: a contiguous block of
    ``num_experts / ep.size``, the ``ep.rank``-th. Local."""
    per_rank = check_divisible(num_experts, ep.size)
    return range(ep.rank * per_rank, (ep.rank + 1) * per_rank)
