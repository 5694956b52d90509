"""Sequence parallelism, Ulysses style (``ParallelismConfig(sp_size=...)``): the pieces that do not
depend on any model library.

The ``sp`` ranks of one data-parallel group read the same batch and each keeps one contiguous
slice of every sequence (:mod:`.loader` cuts it). Everything outside attention is
per token, so it runs on the slice as it is. Around attention, one all-to-all over the ``sp``
group turns "all heads, my slice of the sequence" into "my slice of the heads, the whole sequence"
(:func:`all_to_all`), the attention kernel runs unchanged on whole sequences (CPU SDPA, eager,
any function the user has), and a second all-to-all turns the result back
(:func:`ulysses_attention`). The sequence dimension is the one split; the number of query heads
must be divisible by ``sp_size``; key/value heads too, or ``sp_size`` divisible by them (then each
rank receives copies of the one key/value head its query heads use: grouped-query attention with
fewer key/value heads than ranks).

The loss of the whole sequence (labels shifted across the slice border, the token mean over the
global batch) is every strategy's (:mod:`anyaccel.strategies.loss`, re-exported here: its
``SequenceGroup`` says where this process stands in sequence parallelism).

A user's own attention uses :class:`SequenceParallelAttention` (the documented hook); the
transformers integration is :mod:`.transformers`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch

from ...loss import SequenceGroup, causal_lm_loss, global_token_mean, shift_labels

__all__ = ["SequenceGroup", "SequenceParallelAttention", "all_to_all", "ulysses_attention", "check_heads",
           "check_positions",
           "shift_labels", "global_token_mean", "causal_lm_loss", "bind_attention"]


# ---- the all-to-all ------------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """Split ``x`` into ``size`` chunks along ``scatter``, send chunk ``j`` to rank ``j``, and
    concatenate what arrives along ``gather`` (in rank order). Its gradient is the same exchange
    the other way round."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter: int, gather: int, group: Any, size: int) -> torch.Tensor:
        ctx.args = (scatter, gather, group, size)
        return _exchange(x, scatter, gather, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        scatter, gather, group, size = ctx.args
        return _exchange(grad, gather, scatter, group, size), None, None, None, None


def _exchange(x: torch.Tensor, scatter: int, gather: int, group: Any, size: int) -> torch.Tensor:
    import torch.distributed as dist

    shape = list(x.shape)
    chunks = x.reshape(shape[:scatter] + [size, shape[scatter] // size] + shape[scatter + 1:])
    send = chunks.movedim(scatter, 0).contiguous()  # (size, ...): row j goes to rank j
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    # row j came from rank j: it is block j along the gathered dimension
    out = received.movedim(0, gather)
    out_shape = list(out.shape)
    return out.reshape(out_shape[:gather] + [out_shape[gather] * out_shape[gather + 1]] + out_shape[gather + 2:])


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any, size: int) -> torch.Tensor:
    """Differentiable all-to-all over ``group`` (``size`` processes): ``x`` is cut into ``size``
    equal chunks along ``scatter_dim`` (which ``size`` must divide), chunk ``j`` goes to rank ``j``,
    and the chunks received are concatenated along ``gather_dim`` in rank order. With
    ``scatter_dim`` the heads and ``gather_dim`` the sequence, a slice of the sequence with every
    head becomes the whole sequence with a slice of the heads. Collective over ``group``."""
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    if x.shape[scatter_dim] % size:
        raise ValueError(f"all_to_all: dimension {scatter_dim} of a tensor of shape {tuple(x.shape)} is not divisible "
                         f"by the group size {size}")
    out: torch.Tensor = _AllToAll.apply(x, scatter_dim, gather_dim, group, size)  # type: ignore[no-untyped-call]
    return out


# ---- attention -------------------------------------------------------------------------------------
def check_heads(query_heads: int, kv_heads: int, size: int, where: str = "attention") -> None:
    """Raise ``ValueError`` naming the head counts when Ulysses cannot split them over ``size``
    ranks: query heads must be divisible by ``size``; key/value heads too, or ``size`` by them
    (grouped-query attention, each rank then gets copies of one key/value head). ``where`` names
    the model or module in the message (with tensor parallelism, the counts are per TP rank). Local."""
    problems = []
    if query_heads % size:
        problems.append(f"{query_heads} query heads are not divisible by sp_size={size}")
    if kv_heads % size and size % kv_heads:
        problems.append(f"{kv_heads} key/value heads neither divide nor are divisible by sp_size={size}")
    if problems:
        raise ValueError(f"sequence parallelism ({where}): {'; '.join(problems)}. Each sp rank computes attention "
                         "for a slice of the heads: choose an sp_size that divides the number of query heads (and the "
                         "key/value heads, or is a multiple of them)")


def check_positions(positions: torch.Tensor) -> None:
    """Refuse position ids that restart inside a row (packed sequences): attention under sequence
    parallelism is causal over the whole row, so one document would attend to the one before it,
    where one process (transformers' packed-sequence mask) keeps them apart. Local."""
    if positions.dim() >= 2 and positions.shape[-1] > 1 and bool((positions.diff(dim=-1) != 1).any()):
        raise ValueError("sequence parallelism: position_ids restart inside a row (packed sequences); under sp_size > 1 "
                         "attention is causal over the whole row, so the documents would see each other. Put one "
                         "sequence per row (pad on the right with labels -100)")


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attend: Callable[..., Any], sp: SequenceGroup, head_dim: int = 1, seq_dim: int = 2,
                      out_head_dim: Optional[int] = None, out_seq_dim: Optional[int] = None,
                      **kwargs: Any) -> Any:
    """``attend(query, key, value, **kwargs)`` over whole sequences, each ``sp`` rank for a slice of
    the heads: ``query``/``key``/``value`` hold this rank's slice of the sequence (dimension
    ``seq_dim``) with every head (``head_dim``); they are exchanged (all-to-all) into the whole
    sequence with ``heads / sp_size`` heads, ``attend`` runs, and its output (the first element
    when it returns a tuple, laid out with ``out_head_dim``/``out_seq_dim``, default the input's)
    is exchanged back into this rank's slice of the sequence with every head. Key/value heads
    fewer than ``sp_size`` are repeated so that each rank gets the one its query heads use.
    Collective over the ``sp`` group."""
    size = sp.size
    query_heads, kv_heads = query.shape[head_dim], key.shape[head_dim]
    check_heads(query_heads, kv_heads, size)
    if kv_heads < size:  # GQA/MQA with fewer kv heads than ranks: rank r needs kv head r * kv / size
        key = key.repeat_interleave(size // kv_heads, dim=head_dim)
        value = value.repeat_interleave(size // kv_heads, dim=head_dim)
    query, key, value = (all_to_all(t, head_dim, seq_dim, sp.group, size) for t in (query, key, value))
    result = attend(query, key, value, **kwargs)
    out = result[0] if isinstance(result, tuple) else result
    out_head = head_dim if out_head_dim is None else out_head_dim
    out_seq = seq_dim if out_seq_dim is None else out_seq_dim
    out = all_to_all(out, out_seq, out_head, sp.group, size)
    return (out,) + tuple(result[1:]) if isinstance(result, tuple) else out


class SequenceParallelAttention(torch.nn.Module):
    """The hook for your own attention: put the attention kernel of your module behind this one,
    and under ``ParallelismConfig(sp_size=N)`` it runs on whole sequences for ``1/N`` of the heads
    (Ulysses); otherwise (one process, ``sp_size=1``, before ``prepare``) it calls ``fn`` as it is.

    ``fn(query, key, value, **kwargs)`` is the kernel, by default
    ``torch.nn.functional.scaled_dot_product_attention``; tensors are laid out ``(batch, heads,
    sequence, head_dim)`` (``head_dim``/``seq_dim`` say otherwise) and the output has the
    query's layout. ``prepare`` binds every instance in the model to the ``sp`` group; nothing is
    copied, no parameter is added::

        class Attention(nn.Module):
            def __init__(self):
                ...
                self.attend = SequenceParallelAttention()          # F.scaled_dot_product_attention

            def forward(self, x):
                q, k, v = ...                                      # (batch, heads, local seq, dim)
                return self.out(self.attend(q, k, v, is_causal=True).transpose(1, 2).flatten(2))

    Each call is collective over the ``sp`` group once bound: every ``sp`` rank runs the model
    on its slice, as the prepared loader hands them out."""

    def __init__(self, fn: Optional[Callable[..., Any]] = None, head_dim: int = 1, seq_dim: int = 2):
        super().__init__()
        self.fn = fn if fn is not None else torch.nn.functional.scaled_dot_product_attention
        self.head_dim, self.seq_dim = head_dim, seq_dim
        self.sequence_group: Optional[SequenceGroup] = None  # set by prepare under sp_size > 1

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> Any:
        sp = self.sequence_group
        if sp is None or sp.size == 1:
            return self.fn(query, key, value, **kwargs)
        return ulysses_attention(query, key, value, self.fn, sp, self.head_dim, self.seq_dim, **kwargs)

    def extra_repr(self) -> str:
        bound = f"sp_size={self.sequence_group.size}" if self.sequence_group is not None else "not bound"
        return f"fn={getattr(self.fn, '__name__', self.fn)!s}, {bound}"


def bind_attention(model: torch.nn.Module, sp: SequenceGroup) -> int:
    """Bind every :class:`SequenceParallelAttention` in ``model`` to ``sp``; returns how many. Local."""
    found = [m for m in model.modules() if isinstance(m, SequenceParallelAttention)]
    for module in found:
        module.sequence_group = sp
    return len(found)
