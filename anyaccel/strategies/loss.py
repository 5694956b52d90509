"""The loss of one global batch, for every strategy: the token mean over the processes whose
tokens make the batch, and a causal LM's labels shifted across sequence slices.

* :func:`global_token_mean`: the loss is the sum of per-token losses over every token of the
  global batch (all sequence slices, all data-parallel ranks) divided by the number of counted
  tokens (``ignore_index`` left out), the same number on every rank; its backward scales the
  gradient so that the gradient averaging over the same processes (DDP's all-reduce, FSDP2's
  reduce-scatter over ``dp_shard x sp``) gives exactly the one-process gradient.
* :func:`shift_labels`: a causal LM predicts token ``i + 1`` at position ``i``; under sequence
  parallelism the label of a slice's last position lives on the next ``sp`` rank (one small
  all-gather of the first label column).
* :func:`causal_lm_loss`: both, for next-token cross entropy.

Which processes: a :class:`SequenceGroup`, made by the strategy from its
:class:`~anyaccel.strategies.mesh.ProcessMesh` (the ``loss`` and ``gradients`` groups; the ``sp``
group under sequence parallelism). ``Accelerator.causal_lm_loss`` and ``global_token_mean`` reach
these through :meth:`Strategy.causal_lm_loss <anyaccel.strategies.base.Strategy.causal_lm_loss>`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

import torch

__all__ = ["SequenceGroup", "shift_labels", "global_token_mean", "causal_lm_loss"]


@dataclasses.dataclass(frozen=True)
class SequenceGroup:
    """Where this process stands in sequence parallelism. ``group``/``size``/``rank``: the ``sp``
    process group, its size and this process's slice index; ``loss_group``/``loss_size``: the
    processes whose tokens make one global batch and over which gradients are averaged (data
    parallel x ``sp``; None and 1 for one process). Local."""

    group: Any
    size: int
    rank: int
    loss_group: Any = None
    loss_size: int = 1
    #: the attention a transformers model runs per head slice (None: the model's own setting)
    attention: Optional[str] = None
    #: every batch's sequence length, when the user declared it constant (sp_handler)
    seq_length: Optional[int] = None


def shift_labels(labels: torch.Tensor, sp: Optional[SequenceGroup], ignore_index: int = -100) -> torch.Tensor:
    """The label each position of this rank's slice predicts (a causal LM's ``labels[..., 1:]``
    over the whole sequence): the slice's own labels shifted by one, and at its last position the
    first label of the next ``sp`` rank's slice (``ignore_index`` on the last rank: nothing
    follows). ``labels`` is ``(batch, local sequence)``. Collective over the ``sp`` group (one
    all-gather of ``batch`` labels) when ``sp.size > 1``; local otherwise."""
    if sp is None or sp.size == 1:
        following = torch.full_like(labels[..., :1], ignore_index)
    else:
        import torch.distributed as dist

        firsts = [torch.empty_like(labels[..., :1]) for _ in range(sp.size)]
        dist.all_gather(firsts, labels[..., :1].contiguous(), group=sp.group)
        following = firsts[sp.rank + 1] if sp.rank + 1 < sp.size else torch.full_like(labels[..., :1], ignore_index)
    return torch.cat([labels[..., 1:], following], dim=-1)


class _GlobalMean(torch.autograd.Function):
    """sum over the loss group / count over the loss group; backward: ``scale / count``."""

    @staticmethod
    def forward(ctx: Any, local_sum: torch.Tensor, count: torch.Tensor, group: Any, scale: int) -> torch.Tensor:
        totals = torch.stack([local_sum.detach().to(torch.float64), count.detach().to(torch.float64)])
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(totals, group=group)
        ctx.factor = scale / totals[1]
        return (totals[0] / totals[1]).to(local_sum.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        return grad * ctx.factor.to(grad.dtype), None, None, None


def global_token_mean(local_sum: torch.Tensor, count: Any, sp: Optional[SequenceGroup]) -> torch.Tensor:
    """The mean per-token loss over the global batch: ``local_sum`` (this rank's summed per-token
    loss) and ``count`` (its counted tokens) added over the data-parallel x ``sp`` processes, so
    every rank gets the number one process computes on the whole batch. Its gradient is scaled by
    the number of those processes: averaging gradients over them (what FSDP2/DDP do) then gives
    the gradient of that one number. No counted token anywhere gives NaN, as ``cross_entropy`` does.
    Collective over the loss group (one all-reduce of two numbers); local without one."""
    count = torch.as_tensor(count, device=local_sum.device)
    group, scale = (sp.loss_group, sp.loss_size) if sp is not None else (None, 1)
    mean: torch.Tensor = _GlobalMean.apply(local_sum, count, group, scale)  # type: ignore[no-untyped-call]
    return mean


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, sp: Optional[SequenceGroup],
                   ignore_index: int = -100) -> torch.Tensor:
    """Next-token cross entropy of a causal LM, as one process computes it on the whole global
    batch: ``logits`` ``(batch, local sequence, vocabulary)`` and ``labels`` ``(batch, local
    sequence)`` are this rank's slice; labels are shifted across the slice border
    (:func:`shift_labels`), ``ignore_index`` tokens are left out, and the mean is token-weighted
    over all slices and data-parallel ranks (:func:`global_token_mean`). Collective over the
    ``sp`` and loss groups."""
    targets = shift_labels(labels, sp, ignore_index)
    summed = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                               ignore_index=ignore_index, reduction="sum")
    return global_token_mean(summed, (targets != ignore_index).sum(), sp)
