"""Expert parallelism: the experts of each mixture-of-experts layer split over processes (``ep``),
tokens sent to their experts and back by a dropless all-to-all dispatcher.

The pieces, each usable alone (they need only torch and torch.distributed):

* :mod:`.group` — :class:`ExpertGroup`: the ep process group and the loss group (which processes'
  statistics make the global batch), and the divisibility rule;
* :mod:`.dispatch` — :func:`moe_forward`: route, exchange counts, dispatch, run the local
  experts, combine; gradients through our own autograd all-to-all with uneven splits;
* :mod:`.experts` — the experts interface (transformers 5's contract:
  ``forward(hidden_states, top_k_index, top_k_weights)``, ``num_experts``, fused weights or a list)
  and anyaccel's :class:`FusedExperts` / :class:`ExpertList`;
* :mod:`.shard` — :func:`shard_experts`: each ep rank keeps ``num_experts / ep_size`` experts,
  parameter names unchanged (fused weights as DTensors ``Shard(0)`` on the ep mesh);
* :mod:`.loss` — the router's load-balancing loss over the global batch.

The rules that make ep train like one process (tested on 4 CPU processes against one):

1. **routing** is the router's, computed on each token where it lives; the dispatcher moves
   hidden states, never changes a choice, and drops nothing;
2. **the auxiliary loss** sums its statistics over the *loss group* (every process whose tokens
   differ: replicas x FSDP shards, ep included, x sequence slices), not over the ep group;
3. **gradients**: non-expert weights are averaged over the loss group as usual (DDP/FSDP).
   An expert weight's gradient on ep rank ``r`` already sums the contributions of the tokens of
   every rank of its ep group (the backward all-to-all brought them), so it is summed — not
   averaged — over the ep group's replicas and divided by the loss group's size: averaging over
   the ``n / ep`` processes that hold the same experts (what FSDP2 on that mesh divides by) must
   be followed by a division by ``ep`` (``ExpertParallel.gradient_divide``, which the ``nd``
   strategy sets: :mod:`.parallelize`).
"""

from __future__ import annotations

from .dispatch import DispatchStats, RoutePlan, dense_moe, exchange, expert_major_order, moe_forward, plan_routes
from .experts import ExpertList, FusedExperts, RemoteExpert, local_parameters
from .group import ExpertGroup, check_divisible, expert_group, local_experts
from .loss import load_balancing_loss, with_global_aux_loss
from .shard import ExpertParallel, expert_parameters, find_experts, is_sharded, shard_experts

__all__ = ["ExpertGroup", "expert_group", "check_divisible", "local_experts", "DispatchStats", "RoutePlan",
           "moe_forward", "exchange", "plan_routes", "expert_major_order", "dense_moe", "FusedExperts",
           "ExpertList", "RemoteExpert", "local_parameters", "shard_experts", "find_experts", "ExpertParallel",
           "expert_parameters", "is_sharded", "load_balancing_loss", "with_global_aux_loss"]
