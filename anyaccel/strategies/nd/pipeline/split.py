"""Cutting a model into pipeline stages that keep the user's parameter names.

One idea: from a whole model to the modules of each stage. The model is read as a *spine* of
units in execution order — the modules before the repeated blocks (an embedding), the blocks, the
modules after them (a final norm, a head) — and cut at block boundaries into contiguous stages
(the user's ``pp_split_points``, else evenly). Three kinds of model are understood:

* ``"sequential"``: an ``nn.Sequential``; its children are the units, the children of its most
  frequent class with parameters are the blocks, and every other child goes with the block before
  it (activations, norms, a head), or with the first block (an embedding before it).
  A stage is the same ``nn.Sequential`` holding only its children: its own forward runs them.
* ``"transformers"``: a transformers model with a pipeline plan (``_pp_plan`` /
  ``config.base_model_pp_plan``: embeddings, decoder layers, norm, head) whose forward takes
  ``inputs_embeds``. Every stage runs the model's own forward on its layers only: the first stage
  from ``input_ids``, the others from the hidden states as ``inputs_embeds``; on all but the last,
  the norm and the head are identities. Checked once at ``prepare`` against the whole model's
  forward on a small input (a model whose forward does more around its layers — a scaled
  embedding, say — is refused instead of trained wrongly).
* ``"blocks"``: any other model with a list of repeated blocks (the ``_no_split_modules``
  classes, else the largest ``ModuleList``/``ModuleDict`` of one class). Its forward is kept, so it
  must run with the modules of other stages missing — torchtitan's convention: the units of other
  stages are ``None`` (``h = self.embed(x) if self.embed is not None else x``), the blocks of other
  stages are absent from their list.

A stage module is a *view*: a shallow copy of the containers along the path to its units, sharing
the units themselves (and every parameter-free module, e.g. rotary embeddings) with the model,
so every parameter keeps its fully qualified name — what checkpoints, ``save_model`` and the
tensor-parallel plan are keyed by. The user's model object itself is pruned in place to the units
of the stages this process holds. Local; nothing here communicates.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

__all__ = ["StagePlan", "plan_stages", "stage_module", "prune", "check_transformers_split"]

_LISTS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """Which units (module names) each stage holds, in order, and how stages run."""

    kind: str  #: "sequential", "transformers" or "blocks"
    units: Tuple[str, ...]  #: every unit, in execution order
    blocks: Tuple[str, ...]  #: the units a stage may begin with (the repeated blocks)
    stages: Tuple[Tuple[str, ...], ...]  #: the units of each stage

    def stage_of(self, module_name: str) -> int:
        """The stage holding ``module_name`` (a unit or anything inside one); -1 for a module
        every stage shares (no parameters)."""
        for index, units in enumerate(self.stages):
            if any(module_name == u or module_name.startswith(u + ".") for u in units):
                return index
        return -1


def _has_params(module: Optional[torch.nn.Module]) -> bool:
    return module is not None and next(module.parameters(), None) is not None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_transformers(model: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    plan = getattr(model, "_pp_plan", None) or getattr(config, "base_model_pp_plan", None)
    if not plan or not hasattr(model, "base_model"):
        return False
    try:
        return "inputs_embeds" in inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return False


def _block_list(model: torch.nn.Module) -> Tuple[str, torch.nn.Module]:
    """The name and module of the container holding the repeated blocks."""
    wanted = set(getattr(model, "_no_split_modules", None) or ())
    best: Optional[Tuple[int, str, torch.nn.Module]] = None
    for name, module in model.named_modules():
        if not name or not isinstance(module, _LISTS):
            continue
        children = [c for c in module.children()]
        if len(children) < 2:
            continue
        classes = Counter(type(c) for c in children)
        cls, count = classes.most_common(1)[0]
        if count != len(children):
            continue
        score = count + (10**6 if cls.__name__ in wanted else 0)  # the model's own block class first
        if best is None or score > best[0]:
            best = (score, name, module)
    if best is None:
        raise ValueError(f"pp_size > 1: cannot find the repeated blocks of {type(model).__name__} to cut into pipeline "
                         "stages (no ModuleList/ModuleDict/Sequential of two or more modules of one class); build the "
                         "model as an nn.Sequential, or keep its blocks in one ModuleList (e.g. self.layers)")
    return best[1], best[2]


def _spine(model: torch.nn.Module) -> Tuple[List[List[str]], str]:
    """The units in execution order, grouped so that a stage may begin at any group; and the kind."""
    if isinstance(model, torch.nn.Sequential):
        children = list(model.named_children())
        classes = Counter(type(c) for _, c in children if _has_params(c))
        if not classes:
            raise ValueError("pp_size > 1: this nn.Sequential has no parameters to cut into pipeline stages")
        block = classes.most_common(1)[0][0]  # the repeated block (the first class of the most frequent)
        groups: List[List[str]] = []
        before: List[str] = []
        for name, child in children:
            if type(child) is block:
                groups.append([name])
            elif groups:
                groups[-1].append(name)  # activations, norms, a head: with the block before them
            else:
                before.append(name)  # an embedding: with the first block
        groups[0][:0] = before
        return groups, "sequential"
    kind = "transformers" if _is_transformers(model) else "blocks"
    if kind == "blocks" and hasattr(model, "config") and hasattr(model, "base_model") and \
            hasattr(type(model), "_no_split_modules"):
        raise ValueError(f"pp_size > 1: {type(model).__name__} is a transformers model without a pipeline plan "
                         "(_pp_plan / config.base_model_pp_plan) or whose forward takes no inputs_embeds; anyaccel "
                         "cuts the transformers models that declare one (Llama, Mistral, Qwen, Gemma, ...). Use "
                         "pp_size=1 for this one")
    list_name, blocks = _block_list(model)
    pre: List[str] = []
    post_levels: List[List[str]] = []  # per level of the path: the modules after it, in order
    module, prefix = model, ""
    path = list_name.split(".")
    for step in path:
        stray = [_join(prefix, n) for n, p in module.named_parameters(recurse=False)]
        if stray:
            raise ValueError(f"pp_size > 1: parameter(s) {stray} of {type(model).__name__} belong to no block or "
                             "module that a pipeline stage can hold; move them into a submodule")
        after: List[str] = []
        seen = False
        for name, child in module.named_children():
            if name == step:
                seen = True
            elif _has_params(child):
                (after if seen else pre).append(_join(prefix, name))
        post_levels.append(after)
        module, prefix = getattr(module, step), _join(prefix, step)
    post = [name for level in reversed(post_levels) for name in level]  # inner levels' modules run first
    block_names = [_join(list_name, n) for n, _ in blocks.named_children()]
    groups = [[b] for b in block_names]
    groups[0][:0] = pre
    groups[-1].extend(post)
    return groups, kind


def plan_stages(model: torch.nn.Module, num_stages: int, split_points: Optional[Sequence[str]] = None) -> StagePlan:
    """Cut ``model`` into ``num_stages`` stages at block boundaries: at ``split_points`` (the
    names of the blocks that begin stages 1, 2, ...), else evenly (earlier stages take one block
    more when the count does not divide). Raises ``ValueError`` naming the blocks. Local."""
    groups, kind = _spine(model)
    starts = [g[0] for g in groups]
    if len(groups) < num_stages:
        raise ValueError(f"pp_size x pp_stages_per_rank = {num_stages} pipeline stages, but {type(model).__name__} has "
                         f"only {len(groups)} block(s) to cut at ({', '.join(starts)}); use fewer stages")
    if split_points:
        unknown = [p for p in split_points if p not in starts[1:]]
        if unknown:
            raise ValueError(f"pp_split_points={tuple(split_points)}: {unknown} do not name a block where a stage can "
                             f"begin; choose from {starts[1:]}")
        cuts = [starts.index(p) for p in split_points]
        if cuts != sorted(set(cuts)):
            raise ValueError(f"pp_split_points={tuple(split_points)} must name distinct blocks in model order")
    else:
        base, extra = divmod(len(groups), num_stages)
        sizes = [base + (1 if i < extra else 0) for i in range(num_stages)]
        cuts = [sum(sizes[:i]) for i in range(1, num_stages)]
    bounds = [0, *cuts, len(groups)]
    stages = tuple(tuple(u for g in groups[bounds[i]:bounds[i + 1]] for u in g) for i in range(num_stages))
    block_starts = tuple(starts)
    return StagePlan(kind=kind, units=tuple(u for g in groups for u in g), blocks=block_starts, stages=stages)


# ---- the modules of a stage ------------------------------------------------------------------------
def _placeholder(plan: StagePlan, name: str) -> Optional[torch.nn.Module]:
    """What stands where a unit of another stage was: nothing in a list; ``None`` (torchtitan's
    convention) for a model's own attribute; an identity for a transformers model's norm and head,
    whose forward calls them unconditionally (its embedding is skipped through ``inputs_embeds``)."""
    if plan.kind == "transformers" and plan.units.index(name) > plan.units.index(plan.blocks[-1]):
        return torch.nn.Identity()
    return None


def _select(module: torch.nn.Module, prefix: str, keep: Set[str], plan: StagePlan, inplace: bool) -> Any:
    """``module`` holding only the units in ``keep`` (and every parameter-free module): itself,
    pruned, when ``inplace``; else a shallow copy of each container on the way. Returns
    ``_DROP`` for a unit that is not kept."""
    if prefix in keep:
        return module
    if prefix in plan.units:  # another stage's (a parameter-free entry of a Sequential too: it runs in order)
        return _DROP
    if not _has_params(module):  # shared by every stage (rotary embeddings, activations)
        return module
    target = module if inplace else _shallow_copy(module)
    children: Dict[str, Any] = {}
    for name, child in module._modules.items():
        full = _join(prefix, name)
        chosen = child if child is None else _select(child, full, keep, plan, inplace)
        if chosen is _DROP:
            if isinstance(module, _LISTS):
                continue  # a list keeps the other entries under their own indices
            chosen = _placeholder(plan, full)
        children[name] = chosen
    target._modules = children
    return target


_DROP = object()


def _shallow_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object of the same class sharing parameters, buffers and submodules, with its
    own dictionaries (so hooks and children set on the copy stay off the original)."""
    new = copy.copy(module)
    for key, value in list(vars(new).items()):
        if isinstance(value, dict):
            vars(new)[key] = type(value)(value)
    return new


def stage_module(model: torch.nn.Module, plan: StagePlan, stage: int) -> torch.nn.Module:
    """The module that runs stage ``stage``: a view of ``model`` with the stage's units under
    their own names, and (transformers) a forward that takes ``input_ids`` on the first stage and
    hidden states on the others. Local."""
    view = _select(model, "", set(plan.stages[stage]), plan, inplace=False)
    if plan.kind == "transformers":
        view.forward = _TransformersStage(view, first=stage == 0, last=stage == len(plan.stages) - 1)
    elif plan.kind == "blocks":
        view.forward = _BlocksStage(view, stage)
    return view


def prune(model: torch.nn.Module, plan: StagePlan, stages: Sequence[int]) -> None:
    """Remove from ``model``, in place, every unit outside ``stages`` (see :func:`_placeholder`).
    Local."""
    _select(model, "", {u for s in stages for u in plan.stages[s]}, plan, inplace=True)


class _TransformersStage:
    """A transformers stage's forward: the model's own forward on the stage's layers (see the
    module docstring). Stages before the last run the base model (its norm is an identity there)
    and return its hidden states; the last runs the whole model's forward and returns the logits
    (the head's own output, never a view: zero-bubble schedules detach stage outputs in place)."""

    def __init__(self, view: torch.nn.Module, first: bool, last: bool):
        self.view, self.first, self.last = view, first, last

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        inputs = {"input_ids": hidden} if self.first else {"inputs_embeds": hidden}
        module = self.view if self.last else self.view.base_model
        out = type(module).forward(module, **inputs, use_cache=False)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


class _BlocksStage:
    """A block-list model's stage: its own forward, with what to do when that forward cannot run
    with the other stages' modules missing."""

    def __init__(self, view: torch.nn.Module, stage: int):
        self.view, self.stage = view, stage

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return type(self.view).forward(self.view, *args, **kwargs)
        except (TypeError, AttributeError) as exc:
            raise TypeError(
                f"pipeline stage {self.stage} of {type(self.view).__name__}: its forward failed with the modules of "
                f"the other stages missing ({type(exc).__name__}: {exc}). anyaccel runs a model with a block list by "
                "torchtitan's convention: a stage's forward receives the previous stage's output as its first "
                "argument, the modules of other stages are None (write `h = self.embed(x) if self.embed is not None "
                "else x`) and their blocks are absent from the list; or build the model as an nn.Sequential") from exc


def check_transformers_split(model: torch.nn.Module, plan: StagePlan, tolerance: float = 1e-4) -> None:
    """Run ``model`` and its stages chained, in eval mode on a few tokens, and raise ``ValueError``
    when the stages do not reproduce the model's output (a forward that does more than embed →
    layers → norm → head). Leaves the model's mode and parameters as they were. Local."""
    vocab = int(getattr(model.config, "vocab_size", 0) or 2)
    device = next(model.parameters()).device
    ids = (torch.arange(8, device=device) * 7 % vocab).unsqueeze(0)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            whole = type(model).forward(model, input_ids=ids, use_cache=False)
            whole = whole.logits if hasattr(whole, "logits") else whole.last_hidden_state
            hidden = ids
            for stage in range(len(plan.stages)):
                hidden = stage_module(model, plan, stage)(hidden)
    finally:
        model.train(training)
    diff = float((hidden.float() - whole.float()).abs().max())
    scale = float(whole.float().abs().max()) or 1.0
    if not diff <= tolerance * scale:
        raise ValueError(f"pp_size > 1: {type(model).__name__} cut into {len(plan.stages)} stages at "
                         f"{[s[0] for s in plan.stages]} does not reproduce the whole model's forward (largest "
                         f"difference {diff:.3g} on logits of size {scale:.3g}): its forward does more around its "
                         "layers than the stages can repeat. This model class is not supported for pipeline "
                         "parallelism yet; use pp_size=1")
