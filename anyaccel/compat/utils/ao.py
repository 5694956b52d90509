"""``anyaccel.utils.ao``: Accelerate's torchao fp8 helpers (``accelerate.utils.ao``), on anyaccel's rule.

``Accelerator(mixed_precision="fp8")`` converts models itself when it prepares them
(:mod:`anyaccel.precision_fp8`); these are for scripts that call Accelerate's helpers directly.
The filters are Accelerate's rule, which :func:`anyaccel.precision_fp8.layer_decisions` applies
(the first and last ``nn.Linear`` kept, sizes not multiples of 16 skipped). Local.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Tuple

import torch

from ...training.precision_fp8 import layer_decisions
from .imports import torchao_required

__all__ = ["find_first_last_linear_layers", "filter_linear_layers", "filter_first_and_last_linear_layers",
           "has_ao_layers", "convert_model_to_fp8_ao"]


def find_first_last_linear_layers(model: torch.nn.Module) -> Tuple[Optional[str], Optional[str]]:
    """The names of the first and last ``nn.Linear`` of ``model`` (None, None without one). Local."""
    names = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return (names[0], names[-1]) if names else (None, None)


def filter_linear_layers(module: torch.nn.Module, fqn: str, layers_to_filter: List[str]) -> bool:
    """Accelerate's filter: False for a ``nn.Linear`` whose sizes are not multiples of 16 and for
    the names in ``layers_to_filter``; True otherwise. Local."""
    if isinstance(module, torch.nn.Linear) and (module.in_features % 16 or module.out_features % 16):
        return False
    return fqn not in layers_to_filter


def filter_first_and_last_linear_layers(module: torch.nn.Module, fqn: str) -> bool:
    """Accelerate's filter of the first and last linear layers of ``module`` itself (as Accelerate,
    it looks for them inside the module it is given). Local."""
    first, last = find_first_last_linear_layers(module)
    return filter_linear_layers(module, fqn, layers_to_filter=[n for n in (first, last) if n is not None])


@torchao_required
def has_ao_layers(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a torchao ``Float8Linear``. Local."""
    from torchao.float8.float8_linear import Float8Linear

    return any(isinstance(m, Float8Linear) for m in model.modules())


@torchao_required
def convert_model_to_fp8_ao(model: torch.nn.Module, config: Any = None,
                            module_filter_func: Optional[Callable[..., bool]] = None) -> None:
    """Convert ``model``'s linear layers to torchao's ``Float8Linear`` in place, as Accelerate's
    function: ``module_filter_func(module, name)`` chooses them (default: all but the first and
    last, sizes multiples of 16); ``config``: a ``Float8LinearConfig`` (default torchao's). Local.
    ``Accelerator(mixed_precision="fp8")`` does this itself in ``prepare``, with a report."""
    from torchao.float8 import convert_to_float8_training

    wanted = {name for name, why in layer_decisions(model, module_filter_func).items() if why is None}
    convert_to_float8_training(model, module_filter_fn=functools.partial(_named, wanted), config=config)


def _named(wanted: Any, module: torch.nn.Module, fqn: str) -> bool:
    return fqn in wanted
