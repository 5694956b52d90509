"""The dropless all-to-all token dispatcher: every (token, chosen expert) pair travels to the ep rank
that holds the expert, the experts run on what they received, and the results travel back to be
weighted and summed per token. No capacity, no token dropped: the split sizes are whatever the
router chose, different on every rank and every call (``all_to_all_single`` with uneven splits;
the same code on gloo and NCCL).

One call of :func:`moe_forward` on ``T`` tokens, top-``K`` routing, ``E`` experts over ``P`` ep
ranks (``L = E / P`` each; expert ``e`` on rank ``e // L``):

1. **route** (local): the ``N = T * K`` pairs are sorted by expert id (stable), which also sorts
   them by destination rank; ``counts[e]`` pairs go to expert ``e``.
2. **count exchange** (collective, no gradient): an all-to-all of the ``(P, L)`` count matrix
   tells each rank how many rows it receives from every rank for each of its experts; the split
   sizes come to the host once (the layer's one device-to-host sync).
3. **dispatch** (collective): the rows, sorted, go out in one uneven all-to-all; they arrive
   rank-major (from rank 0: its rows for my expert 0, 1, ...; from rank 1: ...) and are permuted
   to expert-major, so each local expert's rows are contiguous.
4. **experts** (local): ``run(rows, counts_per_local_expert, local_ids)``.
5. **combine** (collective): the inverse permutation, the reverse all-to-all, the inverse sort;
   each token's ``K`` results are weighted by the router's weights (on the token's own rank: the
   weights never travel) and summed.

Gradients take the same way back: the backward of each exchange is the exchange with the splits
swapped (:class:`_Exchange`, an autograd Function of ours over ``torch.distributed``'s
``all_to_all_single``; ``torch.distributed.nn.functional.all_to_all_single`` is deprecated in torch
2.13). Every rank runs both exchanges forward and backward on every call, also a rank that receives
no row (its experts run on one zero-weight dummy row cut to nothing, which keeps its exchanges and
its expert weights in the backward graph, so no peer waits for it and every expert weight has a
gradient, as FSDP's reduction needs).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Tuple

import torch

from .group import ExpertGroup, check_divisible

__all__ = ["DispatchStats", "RoutePlan", "moe_forward", "exchange", "plan_routes", "expert_major_order",
           "dense_moe"]

#: ``run(rows, counts, local_ids) -> outputs``: the local experts on their rows (expert-major,
#: ``counts[l]`` rows for local expert ``l``, ``local_ids[i]`` the local expert of row ``i``)
RunExperts = Callable[[torch.Tensor, List[int], torch.Tensor], torch.Tensor]


@dataclasses.dataclass
class DispatchStats:
    """What the dispatcher did on this rank, for tests and benchmarks. Local.

    ``calls``: forward calls. ``bytes_sent``: bytes this rank handed to the all-to-alls for *other*
    ranks (rows to itself are a local copy), forward and backward, dispatch and combine; the count
    exchanges are in ``count_bytes``. ``tokens_per_expert``: the last call's (token, expert) pairs
    per global expert chosen on this rank (the router's counts, on the host);
    ``rows_per_local_expert``: rows the last call's local experts received from the whole ep group."""

    calls: int = 0
    bytes_sent: int = 0
    count_bytes: int = 0
    tokens_per_expert: List[int] = dataclasses.field(default_factory=list)
    rows_per_local_expert: List[int] = dataclasses.field(default_factory=list)

    def reset(self) -> None:
        """Zero the counters. Local."""
        self.calls = self.bytes_sent = self.count_bytes = 0
        self.tokens_per_expert, self.rows_per_local_expert = [], []


# ---- the exchange -------------------------------------------------------------------------------
def _all_to_all(x: torch.Tensor, out_splits: List[int], in_splits: List[int], group: Any,
                stats: Optional[DispatchStats], rank: int) -> torch.Tensor:
    import torch.distributed as dist

    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    if stats is not None:
        row = x.stride(0) * x.element_size() if x.dim() > 1 else x.element_size()  # contiguous: one row
        stats.bytes_sent += (sum(in_splits) - in_splits[rank]) * row
    return out


class _Exchange(torch.autograd.Function):
    """Rows ``[sum(in_splits[:j]), sum(in_splits[:j+1]))`` go to rank ``j``; ``out_splits[j]`` rows
    arrive from rank ``j``, in rank order. Backward: the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: List[int], in_splits: List[int], group: Any,
                stats: Optional[DispatchStats], rank: int) -> torch.Tensor:
        ctx.args = (out_splits, in_splits, group, stats, rank)
        return _all_to_all(x, out_splits, in_splits, group, stats, rank)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        out_splits, in_splits, group, stats, rank = ctx.args
        return _all_to_all(grad, in_splits, out_splits, group, stats, rank), None, None, None, None, None


def exchange(x: torch.Tensor, out_splits: List[int], in_splits: List[int], ep: ExpertGroup,
             stats: Optional[DispatchStats] = None) -> torch.Tensor:
    """Differentiable uneven all-to-all over the ep group: ``x``'s first ``in_splits[0]`` rows go to
    ep rank 0, the next ``in_splits[1]`` to rank 1, ...; the result holds ``out_splits[j]`` rows
    from rank ``j``, in rank order. Its gradient is the exchange back. Collective over ``ep.group``
    (every rank calls it with matching splits: rank ``i``'s ``in_splits[j]`` is rank ``j``'s
    ``out_splits[i]``); one process: ``x`` itself."""
    if ep.size == 1:
        return x
    out: torch.Tensor = _Exchange.apply(x, out_splits, in_splits, ep.group, stats,  # type: ignore[no-untyped-call]
                                        ep.rank)
    return out


# ---- the routing plan ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RoutePlan:
    """One call's routing, shared by dispatch and combine. Local (a value).

    ``order``: the pairs sorted by expert (indices into the ``N = T * K`` flattened pairs);
    ``unorder``: its inverse. ``send_splits``/``recv_splits``: rows to / from each ep rank.
    ``to_experts``/``from_experts``: the permutation of received rows from rank-major to
    expert-major and back. ``local_counts``: rows per local expert (host); ``local_ids``: the local
    expert of each expert-major row. ``tokens_per_expert``: this rank's pairs per global expert."""

    order: torch.Tensor
    unorder: torch.Tensor
    send_splits: List[int]
    recv_splits: List[int]
    to_experts: torch.Tensor
    from_experts: torch.Tensor
    local_counts: List[int]
    local_ids: torch.Tensor
    tokens_per_expert: torch.Tensor


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return inverse


def expert_major_order(recv_counts: torch.Tensor) -> torch.Tensor:
    """For rows received rank-major — from rank 0 its rows for local expert 0, 1, ..., then from
    rank 1, ... (``recv_counts[p, l]`` rows from rank ``p`` for local expert ``l``) — the indices
    that put them expert-major: all of local expert 0's rows (from rank 0, then 1, ...), then local
    expert 1's, ... (``rows[order]``). Local."""
    ranks, experts = recv_counts.shape
    flat = recv_counts.reshape(-1)
    starts = (flat.cumsum(0) - flat).view(ranks, experts)
    lengths = recv_counts.t().reshape(-1)  # segments in (expert, rank) order
    firsts = starts.t().reshape(-1)
    total = int(flat.sum())
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=flat.device), lengths, output_size=total)
    out_starts = lengths.cumsum(0) - lengths
    return firsts[segment] + torch.arange(total, device=flat.device) - out_starts[segment]


def _exchange_counts(send_counts: torch.Tensor, ep: ExpertGroup, stats: Optional[DispatchStats]) -> torch.Tensor:
    if ep.size == 1:
        return send_counts
    import torch.distributed as dist

    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=ep.group)
    if stats is not None:
        stats.count_bytes += (ep.size - 1) * send_counts.shape[1] * send_counts.element_size()
    return recv_counts


def plan_routes(top_k_index: torch.Tensor, num_experts: int, ep: ExpertGroup,
                stats: Optional[DispatchStats] = None) -> RoutePlan:
    """The routing of one call: ``top_k_index`` ``(T, K)`` holds global expert ids in
    ``range(num_experts)``. Collective over the ep group (one all-to-all of ``ep.size x L``
    counts, and its result read on the host); local for one process."""
    per_rank = check_divisible(num_experts, ep.size)
    with torch.no_grad():
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens_per_expert = torch.bincount(flat, minlength=num_experts)
        if tokens_per_expert.numel() != num_experts:
            raise ValueError(f"expert parallelism: the router chose expert {int(flat.max())}, but the layer has "
                             f"{num_experts} experts (ids 0..{num_experts - 1})")
        send_counts = tokens_per_expert.view(ep.size, per_rank)
        recv_counts = _exchange_counts(send_counts, ep, stats)
        host_send, host_recv = torch.stack([send_counts, recv_counts]).tolist()
        to_experts = expert_major_order(recv_counts)
        local_counts = [sum(column) for column in zip(*host_recv)]
        local_ids = torch.repeat_interleave(torch.arange(per_rank, device=flat.device),
                                            torch.tensor(local_counts, device=flat.device),
                                            output_size=sum(local_counts))
        return RoutePlan(order=order, unorder=_inverse(order), send_splits=[sum(r) for r in host_send],
                         recv_splits=[sum(r) for r in host_recv], to_experts=to_experts,
                         from_experts=_inverse(to_experts), local_counts=local_counts, local_ids=local_ids,
                         tokens_per_expert=tokens_per_expert)


# ---- the whole layer ------------------------------------------------------------------------------
def moe_forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                run: RunExperts, num_experts: int, ep: ExpertGroup,
                stats: Optional[DispatchStats] = None) -> torch.Tensor:
    """``sum_k top_k_weights[t, k] * expert[top_k_index[t, k]](hidden_states[t])`` for every token
    ``t`` of ``hidden_states`` ``(T, D)``, the experts split over ``ep`` and run by ``run`` on this
    rank's share of them (see the module's docstring). ``top_k_index`` ``(T, K)``: global expert
    ids; ``top_k_weights`` ``(T, K)``: the router's weights. Returns ``(T, D)`` in
    ``hidden_states``' dtype. Collective over the ep group (forward and backward: two all-to-alls
    each, plus the count exchange); local for one process."""
    tokens, top_k = top_k_index.shape
    plan = plan_routes(top_k_index, num_experts, ep, stats)
    sent = hidden_states.index_select(0, torch.div(plan.order, top_k, rounding_mode="floor"))
    received = exchange(sent, plan.recv_splits, plan.send_splits, ep, stats)
    rows = received.index_select(0, plan.to_experts)
    if rows.shape[0]:
        out = run(rows, plan.local_counts, plan.local_ids)
    else:  # one dummy row through local expert 0, cut to nothing: keeps this rank's backward exchanges
        dummy = rows.sum(dim=0, keepdim=True)
        out = run(dummy, [1] + [0] * (len(plan.local_counts) - 1), plan.local_ids.new_zeros(1))[:0]
    returned = exchange(out.index_select(0, plan.from_experts), plan.send_splits, plan.recv_splits, ep, stats)
    pairs = returned.index_select(0, plan.unorder).view(tokens, top_k, -1)
    combined = (pairs * top_k_weights.unsqueeze(-1).to(pairs.dtype)).sum(dim=1)
    if stats is not None:
        stats.calls += 1
        stats.tokens_per_expert = plan.tokens_per_expert.tolist()
        stats.rows_per_local_expert = list(plan.local_counts)
    return combined.to(hidden_states.dtype)


def dense_moe(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
              expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The reference: for each token and each of its ``K`` choices, ``expert(e, rows)`` on the
    rows of expert ``e``, weighted and summed — what one process computes, written plainly (tests
    compare :func:`moe_forward` with it). Local."""
    out = torch.zeros_like(hidden_states)
    for e in torch.unique(top_k_index).tolist():
        token, slot = torch.where(top_k_index == e)
        out.index_add_(0, token, expert(e, hidden_states[token]) * top_k_weights[token, slot, None])
    return out
