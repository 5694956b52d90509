"""Tensor parallelism for the N-D family: a plan (module-name patterns to styles) applied with
torch's ``parallelize_module`` on the mesh's ``tp`` sub-mesh, or the user's ``parallelize_fn``.

Where the plan comes from (:func:`find_plan`): ``ParallelismConfig(tp_plan=...)``, else the
model's own (transformers' ``_tp_plan`` / ``config.base_model_tp_plan``). Before anything is cut,
:func:`check_tp_divisibility` names every module whose cut dimension ``tp_size`` does not divide.
Under pipeline stages the plan is checked on the whole model and each stage applies the entries it
holds (the strategy passes that filter in). Local, except :func:`apply` (collective over ``tp``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

__all__ = ["apply", "check_whole_plan", "check_tp_divisibility", "find_plan", "tp_styles"]


def check_whole_plan(model: torch.nn.Module, config: Any) -> None:
    """The tensor-parallel plan checked against the whole ``model`` (before a pipeline cut), when
    ``config.tp_size`` > 1 and no ``parallelize_fn`` applies it. Local."""
    if config.tp_size > 1 and config.parallelize_fn is None:
        plan, root = find_plan(model, config.tp_plan)
        check_tp_divisibility(root, plan, config.tp_size, all_must_match=config.tp_plan is not None)


def apply(model: torch.nn.Module, config: Any, mesh: Any,
          stage_plan: Optional[Callable[[torch.nn.Module, Mapping[str, Any]], Dict[str, Any]]] = None) -> None:
    """Tensor parallelism on ``model`` in place: ``config.parallelize_fn(model, mesh.device_mesh)``,
    or the plan applied on ``mesh.tp`` (``mesh``: the job's
    :class:`~anyaccel.strategies.mesh.ProcessMesh`) after checking that ``tp_size`` divides every
    dimension it cuts; ``stage_plan(root, plan)``: under pipeline stages, the entries this stage
    holds (the plan was checked on the whole model). Collective over the ``tp`` group."""
    if config.parallelize_fn is not None:
        result = config.parallelize_fn(model, mesh.device_mesh)
        if result is not None and result is not model:
            raise ValueError("parallelize_fn must parallelize the model in place and return it (or None); it "
                             "returned another object")
        return
    from torch.distributed.tensor.parallel import parallelize_module

    plan, root = find_plan(model, config.tp_plan)
    if stage_plan is not None:
        plan = stage_plan(root, plan)
    else:
        check_tp_divisibility(root, plan, config.tp_size, all_must_match=config.tp_plan is not None)
    styles = {pattern: _style(style) for pattern, style in plan.items()}
    parallelize_module(root, mesh.tp, styles)


def tp_styles() -> Dict[str, Any]:
    """transformers' ``tp_plan`` style strings as torch ``ParallelStyle`` objects. Local."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(),
            "colwise_rep": ColwiseParallel(output_layouts=Replicate()),
            "rowwise_rep": RowwiseParallel(input_layouts=Replicate()),
            "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),  # transformers 5 names
            "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),
            "sequence_parallel": SequenceParallel(), "replicate": None}


def _style(style: Any) -> Any:
    if not isinstance(style, str):
        return style
    found = tp_styles().get(style, "unknown")
    if found == "unknown" or found is None:
        raise ValueError(f"tensor-parallel style {style!r} is not supported; use one of "
                         f"{', '.join(k for k, v in tp_styles().items() if v is not None)} or a torch ParallelStyle "
                         "(leave replicated modules out of the plan)")
    return found


def find_plan(model: torch.nn.Module, given: Optional[Mapping[str, Any]]) -> Tuple[Mapping[str, Any], torch.nn.Module]:
    """The plan and the module its names are relative to: the given plan on the model; else the
    model's own (transformers: ``_tp_plan`` on the model, else ``config.base_model_tp_plan`` on
    its ``base_model``)."""
    if given is not None:
        return {k: v for k, v in given.items() if v != "replicate"}, model
    own = getattr(model, "_tp_plan", None)
    if own:
        return {k: v for k, v in dict(own).items() if v != "replicate"}, model
    base_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if base_plan:
        return dict(base_plan), getattr(model, "base_model", model)
    raise ValueError("tp_size > 1 but there is no tensor-parallel plan: pass ParallelismConfig(tp_plan={...}) "
                     "(module-name patterns to 'colwise'/'rowwise'/...), or parallelize_fn(model, mesh), or use a "
                     "model that carries one (transformers: config.base_model_tp_plan)")


def check_tp_divisibility(root: torch.nn.Module, plan: Mapping[str, Any], tp_size: int,
                          all_must_match: bool = True) -> None:
    """Raise one ``ValueError`` listing every module whose cut dimension ``tp_size`` does not
    divide (colwise: output features; rowwise: input features; embeddings likewise), and the
    attention head counts of a transformers config; with ``all_must_match``, a pattern that
    matches no module is an error too (a typo would leave layers replicated). Local."""
    from fnmatch import fnmatch

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    bad: List[str] = []
    config = getattr(root, "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and heads % tp_size:
            bad.append(f"config.{attr}={heads}")
    matched = set()
    for name, module in root.named_modules():
        for pattern, style in plan.items():
            if not fnmatch(name, pattern):
                continue
            matched.add(pattern)
            style = _style(style)
            weight = getattr(module, "weight", None)
            if weight is None or weight.dim() != 2:
                continue
            # nn.Linear: weight (out, in); nn.Embedding: (num, dim) — torch's cut dims per style
            colwise = isinstance(style, ColwiseParallel)
            if not colwise and not isinstance(style, RowwiseParallel):
                continue
            is_embedding = isinstance(module, torch.nn.Embedding)
            dim = (1 if is_embedding else 0) if colwise else (0 if is_embedding else 1)
            if weight.shape[dim] % tp_size:
                kind = "colwise" if colwise else "rowwise"
                bad.append(f"{name} ({type(module).__name__} {tuple(weight.shape)}, {kind}: dim {dim} of size "
                           f"{weight.shape[dim]})")
    if bad:
        raise ValueError(f"tp_size={tp_size} does not divide: {'; '.join(bad)}. Choose a tp_size that divides these "
                         "sizes, or leave those modules out of the plan")
    unmatched = [p for p in plan if p not in matched]
    if unmatched and all_must_match:
        raise ValueError(f"tensor-parallel plan pattern(s) {unmatched} match no module of "
                         f"{type(root).__name__}; module names look like "
                         f"{[n for n, _ in root.named_modules() if n][:6]}")
