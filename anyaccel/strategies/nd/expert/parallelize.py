"""Expert parallelism as one step of the ``nd`` strategy's composition (``ParallelismConfig(ep_size=N)``):
what :meth:`NDStrategy._parallelize <anyaccel.strategies.nd.strategy.NDStrategy._parallelize>` calls,
in its order — tensor parallel, **experts split** (:func:`split_experts`), sequence parallel,
activation checkpointing, **experts FSDP-sharded** (:func:`shard_experts_fsdp`, before the blocks
that hold them), then the blocks and the root.

Which processes, from the job's :class:`~anyaccel.strategies.mesh.ProcessMesh` (:func:`expert_group_of`):

* the experts of each MoE layer are split over the mesh's ``experts`` group (``ep`` neighbouring
  shard ranks; each keeps ``num_experts / ep`` whole experts, DTensors ``Shard(0)`` on that mesh);
* FSDP2 shards each experts module over ``expert_sharding`` (``dp_replicate x efsdp``: the
  processes holding the same experts), every other parameter over ``sharding`` as without ep;
* an expert's gradient already sums the tokens of its whole ep group (the backward all-to-all
  brought them), so it must be divided by the ``loss`` group's size, not only by the
  ``dp_replicate x efsdp`` processes FSDP2 averages it over: the experts divide their weights'
  gradients by ``ep`` more (``gradient_divide``, an autograd scale around the experts' own
  computation; FSDP2's ``set_gradient_divide_factor`` would need ``PREMUL_SUM``, which gloo lacks);
* a transformers MoE causal LM's auxiliary (load-balancing) loss is recomputed over the ``loss``
  group by a forward hook (:func:`~.loss.with_global_aux_loss`): the router statistics of the
  global batch, as one process computes them.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional

import torch

from .group import ExpertGroup
from .loss import with_global_aux_loss
from .experts import ExpertList
from .shard import ExpertParallel, find_experts, no_experts_message, shard_experts

__all__ = ["expert_group_of", "split_experts", "check_has_experts", "split_for_evaluation", "shard_experts_fsdp",
           "install_global_aux_loss", "install_sequence_aux_loss", "add_aux_term", "refuse_aux_loss", "full_state_problem"]

def expert_group_of(mesh: Any) -> ExpertGroup:
    """This process's :class:`~.group.ExpertGroup` from the job's ``ProcessMesh``: the ``experts``
    group and its mesh, and the ``loss`` group (whose router statistics make the global batch).
    Collective the first time (the mesh builds its groups)."""
    return ExpertGroup(group=mesh.group("experts"), size=mesh.size("experts"), rank=mesh.rank_in("experts"),
                       mesh=mesh.experts, loss_group=mesh.group("loss"), loss_size=mesh.size("loss"))


def split_experts(model: torch.nn.Module, ep: ExpertGroup, stage: bool = False) -> List[str]:
    """Every experts module of ``model`` split over ``ep`` in place (:func:`~.shard.shard_experts`:
    anyaccel's experts classes and those transformers' ``base_model_ep_plan`` names); their names.
    A model without one is a ``ValueError`` saying how to give one — unless ``stage`` (``model``
    is one pipeline stage, whose layers may all be dense: transformers' ``mlp_only_layers``,
    DeepSeek's dense first layers; :func:`check_has_experts` checked the whole model), which
    leaves it as it is and returns ``[]``. Local (each process cuts its own copy of the same
    weights)."""
    if stage and not find_experts(model):
        return []
    try:
        return shard_experts(model, ep)
    except ValueError as exc:
        raise ValueError(f"ParallelismConfig(ep_size={ep.size}): {exc}") from None


def check_has_experts(model: torch.nn.Module, ep_size: int) -> None:
    """A ``ValueError`` (:func:`split_experts`'s) when ``model`` — the whole model, before the
    pipeline cut — has no experts module: under ``pp_size`` > 1 a stage of dense layers only is
    left as it is, so the whole model is where one MoE layer must be. Local (the same answer on
    every rank)."""
    if not find_experts(model):
        raise ValueError(f"ParallelismConfig(ep_size={ep_size}): {no_experts_message(model)}")


def split_for_evaluation(model: torch.nn.Module, ep: ExpertGroup) -> List[str]:
    """A model prepared for evaluation only (no optimizer, or nothing to train) under ep: its
    experts split over ``ep`` like a trained model's (:func:`split_experts`), so that it holds
    ``1/ep`` of them and runs the same dispatcher on the tokens of each process (its forward is
    then collective over the ep group: every process calls it, on its own batch). A model without
    experts (a dense reward model, a teacher) and one split already (``shard_experts`` by hand)
    are left as they are: ``[]``. Local (each process cuts its own copy of the same weights: load
    or seed them alike)."""
    if any(isinstance(m, ExpertParallel) for m in model.modules()) or not find_experts(model):
        return []
    return split_experts(model, ep)


def shard_experts_fsdp(model: torch.nn.Module, fully_shard: Callable[..., Any], kwargs: Mapping[str, Any],
                       mesh: Any, loss_size: int) -> int:
    """``fully_shard`` on every experts module :func:`split_experts` made, over ``mesh`` (the
    ``expert_sharding`` sub-mesh), with ``kwargs`` (the other units' policies), each dividing its
    weights' gradients by ``loss_size / mesh.size()`` on top of FSDP2's averaging over ``mesh``
    (the gradient of one process on the global batch); to be called before the blocks that hold
    them are sharded (FSDP2 then leaves the experts to their own unit). Returns how many.
    Collective."""
    count = 0
    for module in model.modules():
        if isinstance(module, ExpertParallel):
            fully_shard(module, **dict(kwargs, mesh=mesh))
            module.gradient_divide = loss_size // mesh.size()
            count += 1
    return count


_TO_ADD = "_anyaccel_aux_to_add"  # set on the model by a sliced global_aux hook: the term add_aux_term adds


def install_global_aux_loss(model: torch.nn.Module, ep: ExpertGroup, sliced: bool = False,
                            padding: Optional[Callable[[torch.nn.Module], Optional[torch.Tensor]]] = None) -> Optional[Any]:
    """For a transformers MoE causal LM (it has ``router_aux_loss_coef``): a forward hook that
    replaces its ``aux_loss`` (and the auxiliary term of ``loss``) by the global batch's whenever
    it returns router logits (``output_router_logits=True``); the hook's handle (``.remove()``),
    or None for another model. ``sliced`` (sequence parallelism, installed before its hooks): the
    padding is ``padding(model)``, the slice's the sequence hooks kept (the strategy passes
    ``sequence.transformers.padding_of``: this package does not import sequence's), and the term is only taken
    out of the model's loss (a per-slice sum until the sequence hook makes it the global mean):
    :func:`add_aux_term`, installed after the sequence hooks, adds it. ``ep`` may carry only the
    loss group (``ExpertGroup(loss_group=..., loss_size=...)``: sequence parallelism without
    ep). A forward asking for router logits with ``return_dict=False`` is a ``ValueError`` (a
    tuple's terms cannot be replaced), on every process alike. Local to install; the hooked
    forward is collective over the loss group."""
    if getattr(model, "router_aux_loss_coef", None) is None or getattr(model, "num_experts", None) is None:
        return None

    def global_aux(module: torch.nn.Module, args: Any, kwargs: Dict[str, Any], outputs: Any) -> Any:
        if isinstance(outputs, tuple) and _asks_router_logits(module, kwargs):
            raise ValueError(f"{type(module).__name__}(..., return_dict=False) with output_router_logits: its auxiliary "
                             "load-balancing loss is computed over the global batch only in a ModelOutput (a tuple's "
                             "aux_loss and loss would be this process's alone); call the prepared model with "
                             "return_dict=True (the default)")
        if getattr(outputs, "router_logits", None) is None or getattr(outputs, "aux_loss", None) is None:
            return outputs
        mask = _attention_mask(module, args, kwargs)
        if sliced and mask is None and padding is not None:
            mask = padding(module)
        if sliced:
            setattr(module, _TO_ADD, getattr(outputs, "loss", None) is not None)  # add_aux_term's cue
        return with_global_aux_loss(outputs, module, ep, mask, add=not sliced)

    return model.register_forward_hook(global_aux, with_kwargs=True)


def install_sequence_aux_loss(model: torch.nn.Module, mesh: Any) -> Optional[Any]:
    """Under sequence parallelism without ep (``mesh``: the job's ``ProcessMesh``), a transformers
    MoE causal LM's auxiliary (load-balancing) loss as under ep: :func:`install_global_aux_loss`
    (``sliced``) over the mesh's ``loss`` group, so that the sliced loss (a per-slice sum the
    sequence hook divides by the global token count) no longer divides the term; to be installed
    before the sequence hooks, with :func:`add_aux_term` after. The loader has replaced right
    padding by ones there, so the router statistics count padding tokens (ep_size > 1 leaves them
    out). The hook's handle, or None for a model without an auxiliary loss. Collective the first
    time (the mesh builds the loss group); the hooked forward is collective over it."""
    if getattr(model, "router_aux_loss_coef", None) is None or getattr(model, "num_experts", None) is None:
        return None
    return install_global_aux_loss(model, ExpertGroup(loss_group=mesh.group("loss"), loss_size=mesh.size("loss")),
                                   sliced=True)


def add_aux_term(model: torch.nn.Module) -> Optional[Any]:
    """Under sequence parallelism, after its loss hook: ``loss`` plus ``router_aux_loss_coef``
    times the global ``aux_loss`` (:func:`install_global_aux_loss` with ``sliced`` took the
    per-slice term out); the hook's handle, or None for a model without an auxiliary loss. Local."""
    if getattr(model, "router_aux_loss_coef", None) is None or getattr(model, "num_experts", None) is None:
        return None

    def add(module: torch.nn.Module, args: Any, outputs: Any) -> Any:
        if getattr(module, _TO_ADD, False):  # this forward's term was taken out
            setattr(module, _TO_ADD, False)
            coef = module.router_aux_loss_coef  # read now, as the model and global_aux do (a schedule may change it)
            outputs.loss = outputs.loss + coef * outputs.aux_loss.to(outputs.loss.device)
        return outputs

    return model.register_forward_hook(add)


_NOT_YET = {
    "pp": "across pipeline stages yet (a stage has no outputs of the whole model)",
}


def refuse_aux_loss(model: torch.nn.Module, sizes: str, dim: str, hook: bool = True) -> Optional[Any]:
    """Under a composition whose auxiliary (load-balancing) loss anyaccel cannot compute as one
    process yet (``dim``: ``"pp"``, the one key of ``_NOT_YET``; ``sizes``: the config's values, for the
    message): a ``ValueError`` naming them and the fix when ``model.config.output_router_logits``
    is on; with ``hook``, also a forward hook raising the same when a call asks for router logits
    (``model(..., output_router_logits=True)``), so that a wrong loss is never returned. Returns
    the hook's handle, or None (no hook, or a model without an auxiliary loss). Local to check; the
    hook raises on every process alike (the same call)."""
    message = (f"ParallelismConfig({sizes}): the auxiliary load-balancing loss of {type(model).__name__} is not "
               f"computed {_NOT_YET[dim]}; set config.output_router_logits=False and do not pass "
               f"output_router_logits=True for {dim} x ep, or use {dim}_size=1 with ep (its processes as dp_shard_size)")
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        raise ValueError(message)
    if not hook or getattr(model, "router_aux_loss_coef", None) is None:
        return None

    def refuse(module: torch.nn.Module, args: Any, outputs: Any) -> Any:
        if getattr(outputs, "router_logits", None) is not None or getattr(outputs, "aux_loss", None) is not None:
            raise ValueError(message)
        return outputs

    return model.register_forward_hook(refuse)


def _asks_router_logits(module: torch.nn.Module, kwargs: Dict[str, Any]) -> bool:
    """Whether this forward returns router logits: its ``output_router_logits`` argument, else the
    model config's. Local."""
    asked = kwargs.get("output_router_logits")
    if asked is None:
        asked = getattr(getattr(module, "config", None), "output_router_logits", False)
    return bool(asked)


def _attention_mask(module: torch.nn.Module, args: Any, kwargs: Dict[str, Any]) -> Optional[torch.Tensor]:
    """The ``attention_mask`` the model was called with, by keyword or by position (transformers'
    ``forward(input_ids, attention_mask, ...)``): the one-process auxiliary loss leaves padding out. Local."""
    if "attention_mask" in kwargs or not args:
        return kwargs.get("attention_mask")
    import inspect

    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    mask: Optional[torch.Tensor] = bound.arguments.get("attention_mask")
    return mask



def full_state_problem(model: torch.nn.Module, what: str) -> Optional[str]:
    """Why ``what`` (a full, unsharded state dict: ``save_model``, ``get_state_dict``, loading a
    full state, the full optimizer state) cannot be done on ``model``, or None. A split
    :class:`~.experts.ExpertList` holds only this ep rank's experts (the others are placeholders
    without parameters), so a gathered state dict would silently miss the experts of the other ep
    ranks (and their optimizer state), and a full one would not load (its other experts' keys are
    unexpected here). Local (the same answer on every rank:
    checked before any collective)."""
    split = [name for name, m in model.named_modules() if isinstance(m, ExpertList) and isinstance(m, ExpertParallel)]
    if not split:
        return None
    return (f"{what}: {split[:3]} {'is an ExpertList' if len(split) == 1 else 'are ExpertLists'} split over ep "
            "ranks; each process holds only its own experts' parameters, so a full state dict would miss the "
            "other ep ranks' experts. Use save_state/load_state (torch.distributed.checkpoint: every expert "
            "under its own name) and load that checkpoint into an unsplit model, or hold the experts in fused "
            "weights (FusedExperts: one DTensor per weight, gathered whole)")
