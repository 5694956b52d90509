"""Sequence parallelism for transformers models: Ulysses around their attention, and their
``labels=`` loss as one process computes it. anyaccel imports transformers only when it is given
a transformers model (it is then imported already).

How it hooks in, without copying any model code:

* **Attention**: transformers looks up its attention function by name on every forward
  (``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``). ``prepare``
  registers one more, ``"anyaccel_ulysses"``, and points the model's config at it; each attention
  module remembers the kernel it used before (``"sdpa"`` or ``"eager"``, or ``sp_handler``'s
  ``sp_attn_implementation``). The registered function exchanges query/key/value from sequence
  slices to head slices (:func:`~.sequence.ulysses_attention`), calls that kernel on the whole
  sequence with the causal mask it needs (SDPA: ``is_causal``; eager: a full causal mask, as the
  model's own mask was built for the local slice), and exchanges the output back. A name unknown
  to transformers' mask registry makes the model skip building masks for the local slice.
* **Model inputs** (a forward pre-hook on the prepared model): position ids default to this
  slice's global positions (rotary embeddings as in one process); an all-ones attention mask is
  dropped (the loader has replaced right padding with ones), any other is refused — except, under
  expert parallelism (``keep_padding``), right padding checked across the slices, dropped for
  attention and kept for the router statistics (:func:`padding_of`); ``labels``
  get their ``shift_labels`` across the slice border (:func:`~.sequence.shift_labels`), and the
  model's loss becomes a per-token sum (``num_items_in_batch=1``).
* **The loss** (a forward hook): ``output.loss`` becomes the token mean over the global batch
  (:func:`~.sequence.global_token_mean`), the same on every rank, equal to what one process
  computes on the whole batch, with gradients scaled for the data-parallel x sp averaging.

Refused with a reason: attention implementations other than SDPA and eager (flash kernels and
flex attention need their own masks; not tested here), sliding-window or linear-attention
layers (their masks or recurrent state do not survive the exchange), composite models with
sub-configs (vision towers do not see a sliced sequence), a cache (generation), and
``num_items_in_batch`` given by the caller (the model counts the tokens itself).
:func:`restore` undoes everything (the strategy's teardown).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .ulysses import SequenceGroup, check_heads, check_positions, global_token_mean, shift_labels, ulysses_attention

__all__ = ["ATTENTION_NAME", "is_transformers_model", "install", "restore", "padding_of"]

#: the attention implementation name registered in transformers' ``ALL_ATTENTION_FUNCTIONS``
ATTENTION_NAME = "anyaccel_ulysses"
#: what each attention module remembers: its sp group and the kernel name
_HANDLE = "_anyaccel_sequence"
#: where the prepared model keeps the right padding of its current forward (:func:`padding_of`)
_PADDING = "_anyaccel_padding"


def is_transformers_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries a transformers config with an attention implementation. Local."""
    config = getattr(model, "config", None)
    return config is not None and hasattr(config, "_attn_implementation") and "transformers" in sys.modules


def install(model: torch.nn.Module, sp: SequenceGroup, tp_size: int = 1, keep_padding: bool = False) -> Callable[[], None]:
    """Make ``model`` (a transformers model, already wrapped by TP/FSDP or not) run Ulysses
    attention over ``sp`` and return its ``labels=`` loss as one process would; returns the
    function that undoes it. ``tp_size``: the tensor-parallel degree (attention then sees
    ``heads / tp_size`` heads per process). ``keep_padding``: a right-padding mask is accepted
    (checked across the slices: collective over sp), dropped for attention and kept for
    :func:`padding_of` (expert parallelism's router statistics). Raises ``ValueError`` for what
    it cannot run (see the module's docstring). Local."""
    config: Any = model.config
    if config._attn_implementation == ATTENTION_NAME:  # prepared already (the same model twice)
        return lambda: None
    core: str = sp.attention or config._attn_implementation
    _check_model(model, config, core, sp, tp_size)
    _register()
    previous = config._attn_implementation
    modules = [m for m in model.modules() if getattr(m, "config", None) is config]
    for module in modules:
        setattr(module, _HANDLE, (sp, core))
    config._attn_implementation = ATTENTION_NAME
    causal_lm = getattr(model, "loss_type", None) == "ForCausalLM"
    hooks = [model.register_forward_pre_hook(_inputs_hook(sp, _accepts_use_cache(model), causal_lm,
                                                          name=type(model).__name__, keep_padding=keep_padding),
                                             with_kwargs=True),
             model.register_forward_hook(_loss_hook(sp), with_kwargs=True)]

    def undo() -> None:
        for hook in hooks:
            hook.remove()
        for module in modules:
            if hasattr(module, _HANDLE):
                delattr(module, _HANDLE)
        config._attn_implementation = previous

    return undo


def restore(undo: List[Callable[[], None]]) -> None:
    """Run and forget the undo functions :func:`install` returned. Local."""
    while undo:
        undo.pop()()


# ---- checks -----------------------------------------------------------------------------------------
def _check_model(model: torch.nn.Module, config: Any, core: str, sp: SequenceGroup, tp_size: int) -> None:
    name = type(model).__name__
    if core not in ("sdpa", "eager"):
        raise ValueError(f"sequence parallelism: {name} uses attn_implementation={core!r}; anyaccel's Ulysses runs "
                         "'sdpa' or 'eager' attention per head slice. Load the model with attn_implementation='sdpa' "
                         "(or set ParallelismConfig(sp_handler={'sp_attn_implementation': 'sdpa'}))")
    if getattr(config, "sub_configs", None):
        raise ValueError(f"sequence parallelism: {name} is a composite model (sub-configs "
                         f"{sorted(config.sub_configs)}); only text models whose every attention sees the sliced "
                         "sequence are supported")
    kinds = sorted({str(t) for t in (getattr(config, "layer_types", None) or ()) if t != "full_attention"})
    window = getattr(config, "sliding_window", None)
    if kinds or (window and getattr(config, "use_sliding_window", True)):
        what = f"layer types {kinds}" if kinds else f"sliding_window={window}"
        raise ValueError(f"sequence parallelism: {name} has {what}; its masks (or recurrent state) are built for the "
                         "whole sequence and cannot be rebuilt after the head exchange here. Use a model with full "
                         "causal attention, or sp_size=1")
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if isinstance(heads, int) and isinstance(kv_heads, int):
        per_tp = f" ({heads} and {kv_heads} over tp_size={tp_size})" if tp_size > 1 else ""
        check_heads(max(heads // tp_size, 1), max(kv_heads // tp_size, 1), sp.size,
                    where=f"{name}: config.num_attention_heads={heads}, num_key_value_heads={kv_heads}{per_tp}")


def _accepts_use_cache(model: torch.nn.Module) -> bool:
    import inspect

    try:
        return "use_cache" in inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return False


# ---- the attention function ---------------------------------------------------------------------------
def _register() -> None:
    from transformers import AttentionInterface

    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, _attention)


def _kernel(module: torch.nn.Module, core: str) -> Callable[..., Any]:
    if core == "eager":  # each model file defines its own eager function
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise ValueError(f"sequence parallelism: {type(module).__name__}'s module defines no "
                             "eager_attention_forward; use attn_implementation='sdpa'")
        return fn  # type: ignore[no-any-return]
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[core]  # type: ignore[no-any-return]


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], **kwargs: Any) -> Tuple[torch.Tensor, Any]:
    """transformers' attention-function signature: ``query``/``key``/``value`` are
    ``(batch, heads, local sequence, head_dim)``; returns ``(batch, local sequence, heads,
    head_dim)`` and the attention weights (eager: of this rank's heads). Collective over sp."""
    handle = getattr(module, _HANDLE, None)
    if handle is None:
        raise RuntimeError(f"{type(module).__name__} runs attention {ATTENTION_NAME!r} but was not prepared for "
                           "sequence parallelism by this process (a copy of a prepared model?); prepare the model, or "
                           "set its config._attn_implementation back to 'sdpa'")
    sp, core = handle
    if key.shape[2] != query.shape[2]:
        raise ValueError("sequence parallelism: attention got a cache (keys longer than queries); generation with a "
                         "cache is not supported under sp_size > 1: unwrap the model and generate in one process")
    kernel = _kernel(module, core)
    causal = getattr(module, "is_causal", True)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        mask = None
        if core == "eager" and causal:  # the model's mask was for the local slice: the whole one
            length = q.shape[2]
            mask = torch.full((length, length), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device)
            mask = mask.triu(1)[None, None]
        groups = q.shape[1] // k.shape[1]
        owner: Any = module  # transformers' attention modules carry num_key_value_groups
        before = getattr(owner, "num_key_value_groups", groups)
        if before != groups:  # key/value heads repeated for fewer kv heads than sp ranks
            owner.num_key_value_groups = groups
        try:
            return kernel(module, q, k, v, mask, **kwargs)
        finally:
            if before != groups:
                owner.num_key_value_groups = before

    result: Tuple[torch.Tensor, Any] = ulysses_attention(query, key, value, attend, sp, head_dim=1, seq_dim=2,
                                                         out_head_dim=2, out_seq_dim=1)
    return result


# ---- inputs and loss ----------------------------------------------------------------------------------
def padding_of(model: torch.nn.Module) -> Optional[torch.Tensor]:
    """The right-padding mask of this slice that ``model``'s current forward was called with
    (``install(..., keep_padding=True)``), or None (no padding, or not installed so). Local."""
    return getattr(model, _PADDING, None)


def _right_padding(mask: torch.Tensor, labels: Any, sp: SequenceGroup, ignore_index: int = -100) -> Optional[torch.Tensor]:
    """``mask`` (this slice's) when the whole rows are right padding with ignored labels at the
    padding, None when every slice's rows are all ones; else a ``ValueError`` on every sp rank
    alike (the facts of each slice are all-gathered first). Collective over sp."""
    import torch.distributed as dist

    keep = mask.bool()
    hole = (keep[:, 1:] & ~keep[:, :-1]).any(1)  # a 1 after a 0 inside this slice
    scored = isinstance(labels, torch.Tensor) and labels.shape == mask.shape
    counted = ((labels != ignore_index) & ~keep).any(1) if scored else torch.zeros_like(hole)
    facts = torch.stack([(~keep).any(1), keep.any(1), hole, counted], 1).long()
    every = [torch.empty_like(facts) for _ in range(sp.size)]
    dist.all_gather(every, facts, group=sp.group)
    zero, one, holes, counts = (torch.stack([f[:, i] for f in every]).bool() for i in range(4))  # (slices, rows)
    later_one = one.flip(0).cumsum(0).flip(0) - one.long()  # 1s in later slices
    if bool(holes.any() or (zero & (later_one > 0)).any()):
        raise ValueError("sequence parallelism: attention_mask has padding before real tokens (left padding, or holes); "
                         "under sp_size > 1 attention is causal over the whole sequence and cannot skip them. Pad on "
                         "the right (tokenizer padding_side='right') with labels -100 at the padding")
    if bool(counts.any()):
        raise ValueError(f"sequence parallelism: right padding is accepted only when its labels are ignored "
                         f"({ignore_index}): then no counted token attends to padding, mask or not. Set labels to "
                         f"{ignore_index} where attention_mask is 0")
    return mask if bool(zero.any()) else None


def _inputs_hook(sp: SequenceGroup, accepts_use_cache: bool, causal_lm: bool, name: str,
                 keep_padding: bool = False) -> Callable[..., Any]:
    def before(module: torch.nn.Module, args: Tuple[Any, ...],
               kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        setattr(module, _PADDING, None)
        if len(args) > 1:
            raise ValueError("sequence parallelism: call the prepared model with keyword arguments "
                             "(model(**batch) or model(input_ids=..., labels=...)); positional arguments after "
                             "input_ids are not supported")
        ids = args[0] if args else kwargs.get("input_ids")
        ref = ids if ids is not None else kwargs.get("inputs_embeds")
        if ref is None:
            return args, kwargs
        length = ref.shape[1]
        positions = kwargs.get("position_ids")
        if positions is None:  # this slice's global positions
            kwargs["position_ids"] = (torch.arange(length, device=ref.device) + sp.rank * length)[None]
        else:  # within this slice; the loader checked whole rows
            check_positions(positions)
        for what in ("cache", "past_key_values"):  # the local refusals first: before any collective below
            if kwargs.get(what) is not None:
                raise ValueError(f"sequence parallelism: {what}= is not supported under sp_size > 1 (generation "
                                 "with a cache); unwrap the model and generate in one process")
        if kwargs.get("labels") is not None:
            if not causal_lm:
                raise ValueError(f"sequence parallelism: labels= is supported for causal LMs (…ForCausalLM); {name}'s "
                                 "loss needs the whole sequence. Compute the loss yourself from the outputs (e.g. "
                                 "accelerator.global_token_mean for a per-token loss)")
            if kwargs.get("num_items_in_batch") is not None:
                raise ValueError("sequence parallelism: num_items_in_batch is computed by anyaccel under sp_size > 1 "
                                 "(every counted token of the global batch); do not pass it")
        mask = kwargs.get("attention_mask")
        if keep_padding and isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] == length:
            padding = _right_padding(mask, kwargs.get("labels"), sp, kwargs.get("ignore_index", -100))
            setattr(module, _PADDING, padding)
            mask = torch.ones_like(mask)  # dropped for attention, below
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not bool(mask.bool().all()):
                raise ValueError("sequence parallelism: the model got an attention_mask with padding (or a custom "
                                 "mask); attention under sp_size > 1 is causal over the whole sequence. Let the "
                                 "prepared loader cut the batch (it accepts right padding with labels -100), or pass "
                                 "no mask")
            kwargs["attention_mask"] = None
        if accepts_use_cache:
            kwargs.setdefault("use_cache", False)
        if kwargs.get("labels") is not None:
            if kwargs.get("shift_labels") is None:
                kwargs["shift_labels"] = shift_labels(kwargs["labels"], sp, kwargs.get("ignore_index", -100))
            kwargs["num_items_in_batch"] = 1  # the model's loss is then a sum over this slice's tokens
        return args, kwargs

    return before


def _loss_hook(sp: SequenceGroup) -> Callable[..., Any]:
    def after(module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> Any:
        targets = kwargs.get("shift_labels")
        if kwargs.get("labels") is None or targets is None:
            return output
        loss = output["loss"] if isinstance(output, dict) or hasattr(output, "keys") else output[0]
        if loss is None:
            raise ValueError(f"sequence parallelism: {type(module).__name__} was given labels but returned no loss")
        count = (targets != kwargs.get("ignore_index", -100)).sum()
        combined = global_token_mean(loss, count, sp)
        if isinstance(output, tuple):
            return (combined,) + output[1:]
        output["loss"] = combined
        return output

    return after
