"""Splitting a model's experts over the ep group, in place: :func:`shard_experts`.

Each experts module (the interface of :mod:`.experts`) keeps ``num_experts / ep_size`` whole
experts — ep rank ``r`` the ``r``-th contiguous block — and its class is swapped for a subclass
whose forward is the all-to-all dispatcher (:func:`~.dispatch.moe_forward`) around the class's own
computation, FSDP2's way: the object, its class's behaviour for the experts it holds, the router
and every parameter name stay the user's.

Which modules: the names or patterns given (``fnmatch``, ``*`` any run of characters, relative
to the model), else every :class:`~.experts.FusedExperts` / :class:`~.experts.ExpertList` in the
model and, for a transformers model, the modules its configuration's ``base_model_ep_plan`` marks
``"ep_dispatch_experts"`` (transformers 5: ``layers.*.mlp.experts`` in Qwen3-MoE and Mixtral; the
plan is read as data, transformers is never imported).

Checkpoints move between ep and non-ep layouts because names and global shapes do not change:

* fused weights become DTensors ``Shard(0)`` on the ep mesh (when :class:`~.group.ExpertGroup`
  has one): ``(E, ...)`` globally, ``(E / ep, ...)`` here. torch.distributed.checkpoint writes each
  rank's block at its offset and reads any block back; ``get_model_state_dict(...,
  full_state_dict=True)`` gathers the full tensor, which loads into the unsharded model;
* an :class:`~.experts.ExpertList` keeps its own experts under their unsharded names
  (``experts.5.w1.weight`` on the rank holding expert 5) and placeholders without parameters for
  the others: each key lives on exactly one ep rank (per replica), which DCP saves and loads as it
  is; a full state dict needs the keys of every ep rank gathered (the N-D checkpoint code's job).
"""

from __future__ import annotations

from fnmatch import fnmatch
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from .dispatch import DispatchStats, moe_forward
from .experts import ExpertList, FusedExperts, RemoteExpert, local_parameters
from .group import ExpertGroup, check_divisible

__all__ = ["shard_experts", "find_experts", "ExpertParallel", "expert_parameters", "is_sharded", "no_experts_message"]


class ExpertParallel:
    """Mixed into an experts module's class by :func:`shard_experts`: its forward sends each token
    to the ep rank of each chosen expert and back (collective over the ep group, forward and
    backward). Attributes: ``expert_group``, ``num_global_experts``, ``held`` (the global ids held
    here), ``dispatch_stats`` (:class:`~.dispatch.DispatchStats`), ``gradient_divide``: what the
    expert weights' gradients are divided by on top of the data-parallel averaging (1; the ``nd``
    strategy sets ``ep``: each such gradient sums the tokens of the whole ep group, and FSDP2
    averages it only over the processes holding the same experts)."""

    expert_group: ExpertGroup
    num_global_experts: int
    held: range
    dispatch_stats: DispatchStats
    gradient_divide: int = 1

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """The experts forward over the ep group. Collective over the ep group (and its backward)."""
        return moe_forward(hidden_states, top_k_index, top_k_weights, self._run_held, self.num_global_experts,
                           self.expert_group, self.dispatch_stats)

    def _run_held(self, rows: torch.Tensor, counts: List[int], local_ids: torch.Tensor) -> torch.Tensor:
        if self.gradient_divide == 1:
            return self._run_local(rows, counts, local_ids)
        # the weights' gradients divided, the rows' (the tokens') not: in x d, out x 1/d (any backend: no PREMUL_SUM)
        rows = _ScaleGradient.apply(rows, float(self.gradient_divide))  # type: ignore[no-untyped-call]
        out = self._run_local(rows, counts, local_ids)
        scaled: torch.Tensor = _ScaleGradient.apply(out, 1.0 / self.gradient_divide)  # type: ignore[no-untyped-call]
        return scaled

    def _run_local(self, rows: torch.Tensor, counts: List[int], local_ids: torch.Tensor) -> torch.Tensor:
        module: Any = self
        with local_parameters(module):
            grouped = getattr(module, "forward_grouped", None)
            if grouped is not None:
                out: torch.Tensor = grouped(rows, counts)
                return out
            # the experts contract: ids counted from this block's first expert, each row its own expert
            weights = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
            out = super().forward(rows, local_ids.unsqueeze(-1), weights)  # type: ignore[misc]
            return out

    def extra_repr(self) -> str:
        own = super().extra_repr()  # type: ignore[misc]
        ep = self.expert_group
        text = (f"expert parallel: rank {ep.rank} of {ep.size} holds experts {self.held.start}..{self.held.stop - 1} "
                f"of {self.num_global_experts}")
        return f"{own}, {text}" if own else text


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None]:
        return grad * ctx.scale, None


_CLASSES: Dict[type, type] = {}


def _ep_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]


def is_sharded(module: torch.nn.Module) -> bool:
    """True when ``module`` is an experts module :func:`shard_experts` split. Local."""
    return isinstance(module, ExpertParallel)


# ---- finding the experts ------------------------------------------------------------------------------
def _plan_patterns(model: torch.nn.Module) -> Tuple[List[str], str]:
    """transformers' ``base_model_ep_plan`` patterns of dispatched experts, made relative to
    ``model`` (the plan's names are relative to the base model)."""
    plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
    patterns = [p for p, style in dict(plan).items() if style == "ep_dispatch_experts"]
    base = getattr(model, "base_model", model)
    prefix = next((name for name, m in model.named_modules() if m is base), "")
    return [f"{prefix}.{p}" if prefix else p for p in patterns], prefix


def find_experts(model: torch.nn.Module,
                 modules: Optional[Union[str, Sequence[str]]] = None) -> List[Tuple[str, torch.nn.Module]]:
    """The experts modules of ``model`` as ``(name, module)``: those whose names match ``modules``
    (patterns), else anyaccel's experts classes and the modules transformers' ``base_model_ep_plan``
    names. Raises ``ValueError`` when a given pattern matches nothing. Local."""
    named = list(model.named_modules())
    if modules is not None:
        patterns = [modules] if isinstance(modules, str) else list(modules)
        found = [(n, m) for n, m in named if any(fnmatch(n, p) for p in patterns)]
        unmatched = [p for p in patterns if not any(fnmatch(n, p) for n, _ in named)]
        if unmatched:
            raise ValueError(f"expert parallelism: pattern(s) {unmatched} match no module of {type(model).__name__}; "
                             f"module names look like {[n for n, _ in named if n][:6]}")
        return found
    patterns, _ = _plan_patterns(model)
    return [(n, m) for n, m in named
            if isinstance(m, (FusedExperts, ExpertList, ExpertParallel)) or any(fnmatch(n, p) for p in patterns)]


def expert_parameters(model: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of every expert weight :func:`shard_experts` split (the others are
    replicated over ep). Their gradients collect every ep rank's tokens: averaged over the
    processes that hold the same experts they must be divided by the whole loss group's size, not
    by that group's (see the package's docstring). Local."""
    for name, module in model.named_modules():
        if isinstance(module, ExpertParallel):
            for pname, param in module.named_parameters():  # type: ignore[attr-defined]
                yield (f"{name}.{pname}" if name else pname), param


# ---- splitting ----------------------------------------------------------------------------------------
def _shard_fused(name: str, module: torch.nn.Module, ep: ExpertGroup, per_rank: int, num: int) -> None:
    if any(True for _ in module.children() if any(True for _ in _.parameters())):
        raise ValueError(f"expert parallelism: {name} ({type(module).__name__}) keeps parameters in submodules; a "
                         "fused experts module holds them directly, dimension 0 the expert. Use ExpertList for "
                         "a list of expert modules")
    first = ep.rank * per_rank
    for pname, param in list(module._parameters.items()):
        if param is None:
            continue
        if param.dim() == 0 or param.shape[0] != num:
            raise ValueError(f"expert parallelism: {name}.{pname} has shape {tuple(param.shape)}, but its dimension "
                             f"0 must be the {num} experts (fused layout) to be split over ep ranks; keep shared "
                             "weights outside the experts module")
        if hasattr(param, "to_local"):
            raise ValueError(f"expert parallelism: {name}.{pname} is already a DTensor ({param.placements}); "  # type: ignore[attr-defined]
                             "shard_experts takes the plain (unsharded) experts")
        block = param.detach()[first:first + per_rank].clone()
        if ep.mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            block = DTensor.from_local(block, ep.mesh, [Shard(0)], run_check=False, shape=param.shape,
                                       stride=param.stride())
        module._parameters[pname] = torch.nn.Parameter(block, requires_grad=param.requires_grad)
    if isinstance(getattr(module, "num_experts", None), int):
        module.num_experts = per_rank  # type: ignore[assignment]  # transformers': the forward counts its experts


def _shard_list(module: ExpertList, ep: ExpertGroup, per_rank: int) -> None:
    for index in range(len(module)):
        owner = index // per_rank
        if owner != ep.rank:
            module[index] = RemoteExpert(index, owner)


def _shard_one(name: str, module: torch.nn.Module, ep: ExpertGroup) -> None:
    if isinstance(module, ExpertParallel):
        raise ValueError(f"expert parallelism: {name} is already split over ep ranks (shard_experts was called "
                         "twice on it)")
    num = getattr(module, "num_experts", None)
    if not isinstance(num, int):
        raise ValueError(f"expert parallelism: {name} ({type(module).__name__}) has no integer num_experts; an "
                         "experts module says how many experts it holds (see anyaccel.strategies.nd.expert.experts)")
    per_rank = check_divisible(num, ep.size, where=name or type(module).__name__)
    held = range(ep.rank * per_rank, (ep.rank + 1) * per_rank)
    if isinstance(module, ExpertList):
        _shard_list(module, ep, per_rank)
    else:
        _shard_fused(name, module, ep, per_rank, num)
    module.__class__ = _ep_class(type(module))
    module.expert_group, module.num_global_experts = ep, num  # type: ignore[assignment]
    module.held, module.dispatch_stats = held, DispatchStats()  # type: ignore[assignment]


def no_experts_message(model: torch.nn.Module) -> str:
    """What :func:`shard_experts` says of a model in which :func:`find_experts` finds no experts
    module, and how to give one. Local."""
    return (f"expert parallelism: {type(model).__name__} has no experts module: give "
            "modules=['layers.*.mlp.experts'] (the modules with the experts forward), use "
            "anyaccel's FusedExperts / ExpertList, or a transformers MoE model whose config has "
            "base_model_ep_plan")


def shard_experts(model: torch.nn.Module, ep: ExpertGroup,
                  modules: Optional[Union[str, Iterable[str]]] = None) -> List[str]:
    """Split the experts of ``model`` over the ep group in place and return the names of the experts
    modules split. ``modules``: name patterns of the experts modules (default: see
    :func:`find_experts`). Every process of the ep group calls it on the same unsharded model (the
    same weights everywhere, e.g. seeded alike or loaded); each keeps its block. Afterwards the
    experts' forward is collective over the ep group. Raises ``ValueError`` — before changing
    anything — when no experts module is found, when ``ep.size`` does not divide a module's
    experts (naming both numbers), or when a module is not in one of the interface's layouts.
    Local (no data moves; each process cuts its own copy)."""
    found = find_experts(model, modules if modules is None or isinstance(modules, str) else list(modules))
    if not found:
        raise ValueError(no_experts_message(model))
    for name, module in found:  # every check before the first change
        num = getattr(module, "num_experts", None)
        if isinstance(num, int) and not isinstance(module, ExpertParallel):
            check_divisible(num, ep.size, where=name or type(module).__name__)
    for name, module in found:
        _shard_one(name, module, ep)
    return [name for name, _ in found]
