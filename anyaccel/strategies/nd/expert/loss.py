"""The router's load-balancing loss over the global batch (Switch Transformer's, as transformers
computes it for Qwen3-MoE and Mixtral: ``load_balancing_loss_func``).

For ``E`` experts and top-``K`` routing over every layer's router logits:
``aux = E * sum_e f_e * P_e`` with ``f_e`` the (token, expert) pairs routed to ``e`` per token and
``P_e`` the mean router probability of ``e``, both over all tokens of all layers (padding left out
when an attention mask is given). It is a product of two means, so the mean of per-rank losses is
*not* the loss of the global batch: :func:`load_balancing_loss` sums the three statistics (pairs
per expert, probability per expert, tokens) over the loss group first — the processes whose tokens
make the global batch, see :mod:`.group` — and every rank gets the one-process value. Only the
probabilities carry a gradient (the counts come from ``topk``); the backward of their sum passes
each rank's share through, scaled by the loss group's size, so that the gradient averaging of
DDP/FSDP over those processes leaves exactly the one-process gradient.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import torch

from .group import ExpertGroup

__all__ = ["load_balancing_loss", "with_global_aux_loss"]


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over ``group``. Backward: this rank's gradient times ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, scale: int) -> torch.Tensor:
        import torch.distributed as dist

        total = x.detach().clone()
        dist.all_reduce(total, group=group)
        ctx.scale = scale
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        return grad * ctx.scale, None, None


def _statistics(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                attention_mask: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    device = router_logits[0].device
    pairs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probability = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for logits in router_logits:
        weights = torch.nn.functional.softmax(logits.to(device), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        if mask is None:
            pairs = pairs + torch.bincount(chosen.reshape(-1), minlength=num_experts).float()
            probability = probability + weights.float().sum(dim=0)
            rows = rows + weights.shape[0]
        else:
            pairs = pairs + torch.zeros_like(pairs).scatter_add_(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
            probability = probability + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + mask.sum()
    return pairs, probability, rows


def load_balancing_loss(router_logits: Union[torch.Tensor, Sequence[torch.Tensor], None], num_experts: int,
                        top_k: int, attention_mask: Optional[torch.Tensor] = None,
                        ep: Optional[ExpertGroup] = None) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` over the global batch: ``router_logits`` one
    ``(tokens, num_experts)`` tensor per MoE layer (a tuple, as a model returns them with
    ``output_router_logits=True``), ``attention_mask`` ``(batch, sequence)`` or None. With ``ep``
    (and its ``loss_group``), the statistics are summed over the loss group first, and the
    backward is scaled by ``ep.loss_size`` (see the module's docstring). Collective over the loss
    group (one all-reduce of ``num_experts + 1`` numbers without gradient, one of ``num_experts``
    with); local without one. Returns a float32 scalar."""
    if router_logits is None or (isinstance(router_logits, (tuple, list)) and not router_logits):
        raise ValueError("load_balancing_loss: no router logits; call the model with output_router_logits=True")
    layers = [router_logits] if isinstance(router_logits, torch.Tensor) else list(router_logits)
    pairs, probability, rows = _statistics(layers, num_experts, top_k, attention_mask)
    if ep is not None and ep.loss_group is not None and ep.loss_size > 1:
        import torch.distributed as dist

        counts = torch.cat([pairs, rows.reshape(1)]).detach()
        dist.all_reduce(counts, group=ep.loss_group)
        pairs, rows = counts[:-1], counts[-1]
        probability = _SumOverGroup.apply(probability, ep.loss_group, ep.loss_size)  # type: ignore[no-untyped-call]
    return torch.sum((pairs / rows) * (probability / rows)) * num_experts


def with_global_aux_loss(outputs: Any, model: torch.nn.Module, ep: Optional[ExpertGroup],
                         attention_mask: Optional[torch.Tensor] = None, add: bool = True) -> Any:
    """A transformers MoE causal LM's outputs (``output_router_logits=True``) with ``aux_loss``
    computed over the global batch and ``loss`` = the model's loss with its per-rank auxiliary term
    replaced by the global one (``router_aux_loss_coef`` times each; with ``add=False`` only
    taken out: the caller adds it once the loss is the global batch's, as under sequence
    parallelism, whose sliced loss is a sum until then). Reads ``model.num_experts``,
    ``model.num_experts_per_tok`` and ``model.router_aux_loss_coef`` (Qwen3-MoE, Mixtral). Pass
    the ``attention_mask`` the model was called with. Collective over the loss group."""
    inner: Any = model
    for attr in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef"):
        if getattr(inner, attr, None) is None:
            raise ValueError(f"with_global_aux_loss: {type(model).__name__} has no {attr}; it takes a transformers "
                             "MoE causal LM (Qwen3MoeForCausalLM, MixtralForCausalLM); use load_balancing_loss "
                             "for your own model")
    aux = load_balancing_loss(outputs.router_logits, inner.num_experts, inner.num_experts_per_tok, attention_mask, ep)
    if outputs.loss is not None and outputs.aux_loss is not None:
        coef = inner.router_aux_loss_coef
        outputs.loss = outputs.loss - coef * outputs.aux_loss.to(outputs.loss.device)
        if add:
            outputs.loss = outputs.loss + coef * aux.to(outputs.loss.device)
    outputs.aux_loss = aux
    return outputs
