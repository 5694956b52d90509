"""fp8 through NVIDIA Transformer Engine (``FP8RecipeKwargs(backend="TE")``, ``TERecipeKwargs``): CUDA only.

What :class:`~anyaccel.precision_fp8.Fp8Training` asks of it, as Accelerate's
``accelerate.utils.transformer_engine`` does it: :func:`convert` replaces the chosen ``nn.Linear``
layers (the same rule as torchao's: :func:`anyaccel.precision_fp8.layer_decisions`) with
``transformer_engine.pytorch.Linear`` holding the same weights; :func:`wrap_forward` runs the
prepared model's forward under ``transformer_engine.pytorch.fp8_autocast`` with a
``DelayedScaling`` recipe built from the ``TERecipeKwargs`` fields the user set (Transformer
Engine's defaults for the others), in training mode only unless ``use_autocast_during_eval``.

Differences from Accelerate, on purpose: the first and last linear layers stay in high precision
here too (one rule for both backends; Accelerate converts every linear layer whose sizes divide by
16, and stops at the first that does not), and ``LayerNorm`` is left as it is (Accelerate's own
note: Transformer Engine's brings no saving). Transformer Engine's modules keep an ``_extra_state``
entry (its fp8 scaling history) in state dicts, so a checkpoint written under TE loads into a plain
model with ``strict=False`` only; torchao's checkpoints are those of the plain model.

Not run on CPU (Transformer Engine needs CUDA): the GPU check covers it where TE is installed.
Local.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Iterable, Mapping

import torch

__all__ = ["convert", "wrap_forward", "delayed_scaling"]


def convert(model: torch.nn.Module, wanted: Iterable[str], settings: Mapping[str, Any]) -> str:
    """Replace the ``nn.Linear`` layers named in ``wanted`` with Transformer Engine's ``Linear``
    (same sizes, dtype, device and values); returns the recipe in words for the report. Local."""
    import transformer_engine.pytorch as te

    modules = dict(model.named_modules())
    for name in wanted:
        old = modules[name]
        parent_name, _, attr = name.rpartition(".")
        parent = modules[parent_name]
        new = te.Linear(old.in_features, old.out_features, bias=old.bias is not None, params_dtype=old.weight.dtype,
                        device=old.weight.device)
        with torch.no_grad():
            new.weight.copy_(old.weight)
            if old.bias is not None:
                new.bias.copy_(old.bias)
        new.weight.requires_grad_(old.weight.requires_grad)
        setattr(parent, attr, new)
    return f"DelayedScaling {settings.get('fp8_format', 'HYBRID')}"


def delayed_scaling(settings: Mapping[str, Any]) -> Any:
    """Transformer Engine's ``DelayedScaling`` recipe from the ``TERecipeKwargs`` fields that were
    set (``fp8_format`` by name). Local."""
    import transformer_engine.common.recipe as te_recipe

    kwargs: Dict[str, Any] = {k: v for k, v in settings.items() if k != "use_autocast_during_eval"}
    if "fp8_format" in kwargs:
        kwargs["fp8_format"] = getattr(te_recipe.Format, str(kwargs["fp8_format"]).upper())
    return te_recipe.DelayedScaling(**kwargs)


def wrap_forward(model: torch.nn.Module, settings: Mapping[str, Any]) -> None:
    """Run ``model``'s forward (the prepared model: DDP's forward when wrapped) under
    ``fp8_autocast`` while it trains (in eval mode too with ``use_autocast_during_eval``). Local."""
    from transformer_engine.pytorch import fp8_autocast

    recipe = delayed_scaling(settings)
    during_eval = bool(settings.get("use_autocast_during_eval", False))
    forward = model.forward

    @functools.wraps(forward)
    def fp8_forward(*args: Any, **kwargs: Any) -> Any:
        with fp8_autocast(enabled=during_eval or model.training, fp8_recipe=recipe):
            return forward(*args, **kwargs)

    model.forward = fp8_forward
