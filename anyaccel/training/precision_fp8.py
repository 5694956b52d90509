"""fp8 training (``mixed_precision="fp8"``): linear layers converted to compute in fp8 before the model is wrapped.

What happens to a model ``prepare`` trains, in order (:class:`Fp8Training`, one per ``Accelerator``):

1. **Which layers** (:func:`layer_decisions`): every ``nn.Linear`` of the model, decided by the
   user's filter (``AORecipeKwargs(module_filter_func=...)``, ``(module, name) -> bool``) when one
   is given, else by Accelerate's default: the first and the last linear layer stay in high
   precision (the layers next to the embedding and the output are the most sensitive), and a layer
   whose ``in_features`` or ``out_features`` is not a multiple of 16 is skipped (fp8 matmuls need
   it). ``nn.MultiheadAttention``'s ``out_proj`` is always skipped: the attention reads its weight
   directly, so converting it would change nothing.
2. **Conversion**, by the backend: torchao's ``convert_to_float8_training`` (``"AO"``, the
   default; ``Float8Linear`` keeps the module's own parameters, so names, state dicts and
   checkpoints are those of the plain model) or NVIDIA Transformer Engine (``"TE"``,
   :mod:`anyaccel.precision_te`, CUDA only).
3. **One report** per model on the main process (stderr, ``[anyaccel] fp8: ...``): how many linear
   layers compute in fp8, which stay in high precision and why, the recipe, whether fp8 is emulated
   and whether FSDP2 all-gathers the weights in fp8; :func:`report` returns it. A model in which no
   layer could be converted gets a warning instead (it would train as in bf16): never a silent no-op.
4. The strategy then wraps the converted model (tensor parallel, compile, FSDP2 or DDP): the
   ``Accelerator`` converts before it hands the model over, so every wrapper sees ``Float8Linear``.

The rest computes under bf16 autocast (Accelerate's rule: :mod:`anyaccel.precision`); weights,
gradients and optimizer state stay in fp32: only the converted layers' matmuls cast to fp8.

torchao's config (:meth:`Fp8Training.torchao_config`): the user's ``Float8LinearConfig``
(``AORecipeKwargs(config=...)``) or the recipe's (``tensorwise``, the default; ``rowwise``;
``rowwise_with_gw_hp``), with ``pad_inner_dim`` on (Accelerate's default), and

* ``emulate`` (fp8 numerics computed in higher precision): as the device backend answers
  (:meth:`~anyaccel.backends.base.Backend.fp8_support`): on the CPU by default, where it is what
  makes fp8 testable at all, said once in the report; a GPU without fp8 matmuls (CUDA before
  compute capability 8.9) is refused unless the user asked for emulation (it would be slower than
  bf16); ``emulate=False`` where there is no fp8 matmul is refused too.
* ``enable_fsdp_float8_all_gather``: on when FSDP2 shards the model and the recipe scales weights
  tensorwise (the only fp8 all-gather torchao has); then an optimizer step hook precomputes every
  weight's scale in one all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``, as
  Accelerate does). Asked for without FSDP2 it is turned off, saying so (its weight type would
  leak into state dicts); asked for with a rowwise recipe it is an error.

Optimizers built before ``prepare`` are pointed at parameters a conversion replaced
(:meth:`Fp8Training.remap`). Local; torchao is imported (seconds) at the first conversion.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
import warnings
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from .. import optionspec

__all__ = ["Fp8Options", "Fp8Report", "Fp8Training", "options_from_settings", "layer_decisions", "report", "INSTALL",
           "CPU"]

#: what to install for each backend, in every message that needs it
INSTALL = {"AO": "pip install 'anyaccel[fp8]' (torchao 0.18)",
           "TE": "pip install 'transformer-engine[pytorch]' on a machine with CUDA"}
_FILTER = Callable[[torch.nn.Module, str], bool]
#: what the CPU backend answers to ``fp8_support()`` (:meth:`anyaccel.backends.base.Backend.fp8_support`)
CPU = ("emulate", "the CPU has no fp8 matmul")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Fp8Options:
    """How to train in fp8 (what ``AORecipeKwargs``/``TERecipeKwargs``/``FP8RecipeKwargs`` and the
    launcher's ``fp8_config`` convert into). ``None`` everywhere: the defaults described in the
    module docstring.

    Fields: ``backend`` (``"AO"`` torchao, ``"TE"`` Transformer Engine; None: torchao when
    installed, else Transformer Engine where it runs; a library's own settings given alone choose
    it); ``recipe`` (torchao's recipe name; None:
    tensorwise) or ``config`` (a torchao ``Float8LinearConfig``, instead of the recipe);
    ``module_filter`` (``(module, name) -> bool``: which ``nn.Linear`` layers to convert, instead
    of the default rule); ``emulate``, ``pad_inner_dim``, ``fsdp_float8_all_gather`` (torchao's
    settings); ``te`` (Transformer Engine's recipe settings: ``margin``, ``interval``,
    ``fp8_format``, ``amax_history_len``, ``amax_compute_algo``, ``override_linear_precision``,
    ``use_autocast_during_eval``). Checked when made: a ``ValueError`` names the field."""

    backend: Optional[str] = None
    recipe: Optional[str] = None
    config: Any = None
    module_filter: Optional[_FILTER] = None
    emulate: Optional[bool] = None
    pad_inner_dim: Optional[bool] = None
    fsdp_float8_all_gather: Optional[bool] = None
    te: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.backend is not None:
            object.__setattr__(self, "backend", optionspec.check(optionspec.option("fp8_backend"), self.backend,
                                                                 "fp8 backend"))
        if self.recipe is not None:
            optionspec.check(optionspec.option("fp8_recipe"), self.recipe, "fp8 recipe")
        if self.config is not None and self.recipe is not None:
            raise ValueError(f"fp8: both a torchao config and recipe={self.recipe!r} were given; give one of them (a "
                             "Float8LinearConfig already says how it scales)")
        if self.module_filter is not None and not callable(self.module_filter):
            raise ValueError(f"fp8: module_filter_func must be a function (module, name) -> bool; got "
                             f"{type(self.module_filter).__name__}")
        if self.fsdp_float8_all_gather and self.recipe not in (None, "tensorwise"):
            raise ValueError(f"fp8: enable_fsdp_float8_all_gather=True with recipe={self.recipe!r}: torchao all-gathers "
                             "in fp8 only with the tensorwise recipe; use recipe tensorwise, or leave the all-gather "
                             "unset (it is on only where it can be)")
        torchao_only = [name for name in ("recipe", "config", "emulate", "pad_inner_dim", "fsdp_float8_all_gather")
                        if getattr(self, name) is not None]
        if self.backend is None and (self.te or torchao_only):  # a library's own settings choose it
            object.__setattr__(self, "backend", "TE" if self.te and not torchao_only else "AO")
        if self.backend == "TE" and torchao_only:
            raise ValueError(f"fp8: {', '.join(torchao_only)} are torchao's settings but backend is TE (Transformer "
                             "Engine); drop them, or use backend AO")
        if self.te and self.backend == "AO":
            raise ValueError(f"fp8: {', '.join(sorted(self.te))} are Transformer Engine's settings but backend is AO "
                             "(torchao); drop them, or use backend TE")


#: the launcher's fp8 settings (option names) that are Transformer Engine's recipe fields, by field
_TE_FIELDS = {"fp8_margin": "margin", "fp8_interval": "interval", "fp8_format": "fp8_format",
              "fp8_amax_history_len": "amax_history_len", "fp8_amax_compute_algo": "amax_compute_algo",
              "fp8_override_linear_precision": "override_linear_precision",
              "fp8_use_autocast_during_eval": "use_autocast_during_eval"}


def options_from_settings(settings: Mapping[str, Any]) -> Fp8Options:
    """The :class:`Fp8Options` of the launcher's fp8 settings (``{option name: value}``, the rows
    of the ``fp8_config`` section: ``anyaccel launch --fp8_recipe rowwise``, a config file's
    ``fp8_config``), each already checked by its row. The section's check (all the settings
    together) and a plain ``Accelerator(mixed_precision="fp8")`` call it. Local."""
    te = {field: settings[name] for name, field in _TE_FIELDS.items() if settings.get(name) is not None}
    if "override_linear_precision" in te:  # the row keeps it as text: "true,false,false"
        te["override_linear_precision"] = tuple(w == "true" for w in str(te["override_linear_precision"]).split(","))
    return Fp8Options(backend=settings.get("fp8_backend"), recipe=settings.get("fp8_recipe"),
                      emulate=settings.get("fp8_emulate"), pad_inner_dim=settings.get("fp8_pad_inner_dim"),
                      fsdp_float8_all_gather=settings.get("fp8_enable_fsdp_float8_all_gather"), te=te)


def choose_backend(options: Fp8Options, support: Tuple[str, str]) -> str:
    """The backend to train with: the one asked for, which must be installed (Transformer Engine
    also needs a GPU with fp8 matmuls: ``support``, the device backend's ``fp8_support()``), else
    torchao when installed, else Transformer Engine when installed there. Raises ``ImportError``
    saying what to install. Local."""
    has_ao = importlib.util.find_spec("torchao") is not None
    has_te = importlib.util.find_spec("transformer_engine") is not None
    if options.backend == "TE" or (options.backend is None and not has_ao and has_te and support[0] == "matmul"):
        if not has_te or support[0] != "matmul":
            missing = "NVIDIA Transformer Engine is not installed" if not has_te else \
                f"Transformer Engine needs a GPU with fp8 matmuls, and {support[1]}"
            raise ImportError(f"mixed_precision='fp8' with backend TE: {missing}; {INSTALL['TE']}, or use backend AO "
                              f"(torchao: {INSTALL['AO']})")
        return "TE"
    if not has_ao:
        raise ImportError(f"mixed_precision='fp8' needs torchao: {INSTALL['AO']} (or NVIDIA Transformer Engine on a "
                          f"CUDA machine: {INSTALL['TE']})")
    return "AO"


@dataclasses.dataclass(frozen=True)
class Fp8Report:
    """What the conversion did to one model: ``converted`` (layer names), ``kept`` (``{name: why it
    stays in high precision}``), the ``backend``, the ``recipe`` in words, ``emulated``,
    ``fsdp_float8_all_gather`` (None: the model is not sharded by FSDP2) and ``notes`` (settings
    changed, and why). :meth:`message` is the line printed at ``prepare``."""

    model: str
    backend: str
    recipe: str
    converted: Tuple[str, ...]
    kept: Mapping[str, str]
    emulated: bool
    fsdp_float8_all_gather: Optional[bool] = None
    notes: Tuple[str, ...] = ()

    def message(self, shown: int = 6) -> str:
        """One paragraph: counts, the first ``shown`` layers kept with their reasons, the rest."""
        total = len(self.converted) + len(self.kept)
        library = "torchao" if self.backend == "AO" else "Transformer Engine"
        text = (f"fp8 ({library}, {self.recipe}{', emulated' if self.emulated else ''}): {len(self.converted)} of "
                f"{total} linear layers of {self.model} compute in fp8")
        if self.kept:
            items = [f"{name or '(the model)'} ({why})" for name, why in list(self.kept.items())[:shown]]
            more = f" and {len(self.kept) - shown} more" if len(self.kept) > shown else ""
            text += f"; kept in high precision: {', '.join(items)}{more}"
        if self.fsdp_float8_all_gather is not None:
            text += "; FSDP2 all-gathers their weights in fp8" if self.fsdp_float8_all_gather else \
                "; FSDP2 all-gathers their weights in bf16"
        return text + "".join(f". {note}" for note in self.notes)


_REPORTS: "weakref.WeakKeyDictionary[torch.nn.Module, Fp8Report]" = weakref.WeakKeyDictionary()


def report(model: torch.nn.Module) -> Optional[Fp8Report]:
    """The :class:`Fp8Report` of ``model`` (the user's module, or the prepared model wrapping it)
    if ``prepare`` converted it under ``mixed_precision="fp8"``, else None. Local."""
    from ..strategies.base import unwrap_module

    return _REPORTS.get(unwrap_module(model))


def layer_decisions(model: torch.nn.Module, module_filter: Optional[_FILTER] = None) -> Dict[str, Optional[str]]:
    """``{name: None}`` for every ``nn.Linear`` of ``model`` to convert, ``{name: why not}`` for
    every other one, in module order: ``module_filter(module, name)`` decides when given (Accelerate's
    ``module_filter_func``), else Accelerate's default rule (first and last linear layer kept, sizes
    that are not multiples of 16 skipped). Local; nothing is changed."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    first, last = (linears[0][0], linears[-1][0]) if linears else ("", "")
    decisions: Dict[str, Optional[str]] = {}
    for name, module in linears:
        decisions[name] = _why_not(name, module, first, last, module_filter)
    return decisions


def _why_not(name: str, module: torch.nn.Linear, first: str, last: str, module_filter: Optional[_FILTER]) -> Optional[str]:
    converted = sys.modules.get("torchao.float8.float8_linear")  # only a model made after torchao's import has one
    if converted is not None and isinstance(module, converted.Float8Linear):
        return "already a Float8Linear"
    if isinstance(module, torch.nn.modules.linear.NonDynamicallyQuantizableLinear):
        return "nn.MultiheadAttention's out_proj, whose weight the attention reads directly"
    if name == "":
        return "the model itself is one linear layer; fp8 converts the layers inside a model"
    if module_filter is not None:
        return None if module_filter(module, name) else "module_filter_func returned False"
    if name == first:
        return "the first linear layer"
    if name == last:
        return "the last linear layer"
    for what in ("in_features", "out_features"):
        size = getattr(module, what)
        if size % 16:
            return f"{what}={size} is not a multiple of 16"
    return None


class Fp8Training:
    """fp8 for one ``Accelerator``: made once (the backend and the emulation decided, with their
    errors) and asked by ``prepare`` to :meth:`convert` each model it trains, before wrapping;
    :meth:`remap` and :meth:`attach` for optimizers; :meth:`wrap_forward` after wrapping. Local,
    except the fp8 all-gather's step hook (a collective all-reduce, on every rank alike).

    ``support``: the device backend's :meth:`~anyaccel.backends.base.Backend.fp8_support`
    (:data:`CPU` for the CPU's). ``sharded``: FSDP2 will shard the models (the strategy reports
    ``DistributedType.FSDP``). ``is_main_process``: print the reports here."""

    def __init__(self, options: Optional[Fp8Options], support: Tuple[str, str], *, sharded: bool = False,
                 is_main_process: bool = True):
        self.options = options or Fp8Options()
        self.support = support
        self.sharded = sharded
        self.is_main_process = is_main_process
        self.backend = choose_backend(self.options, support)
        self.emulate, self._emulate_note = self._emulation()
        self.replaced: Dict[int, torch.nn.Parameter] = {}  # id(parameter before conversion) -> the one after
        self._all_gather_models: List[torch.nn.Module] = []
        self._hooked: Dict[Tuple[int, int], Any] = {}  # (id(optimizer), id(model)) -> hook handle

    def _emulation(self) -> Tuple[bool, str]:
        """(emulate?, the note that says why) from the option and the device (module docstring)."""
        kind, what = self.support
        asked = self.options.emulate
        if self.options.config is not None and asked is None and getattr(self.options.config, "emulate", False):
            asked = True
        if asked is False and kind != "matmul":
            raise ValueError(f"fp8 emulate=False, but {what}: leave emulate unset (on this device fp8 is emulated) or "
                             "train on a GPU with fp8 matmuls")
        if self.backend == "TE":
            return False, ""
        if asked is None and kind == "none":
            raise ValueError(f"mixed_precision='fp8': {what}, where emulated fp8 is slower than bf16; use "
                             "mixed_precision='bf16' there, or set fp8_config emulate: true (AORecipeKwargs(emulate=True)) "
                             "to test fp8 numerics")
        if asked is None and kind == "emulate":
            return True, (f"{what[0].upper()}{what[1:]}, so fp8 is emulated (computed in higher precision with fp8 "
                          "rounding): for testing, never faster than bf16")
        return bool(asked), ""

    # ---- conversion --------------------------------------------------------------------------
    def convert(self, model: torch.nn.Module) -> Fp8Report:
        """Convert ``model``'s chosen linear layers in place (the user's module, not a wrapper),
        remember replaced parameters, print the report on the main process (or warn when nothing
        was converted) and return it; a model converted before is left as it is (its report
        again). Local."""
        if model in _REPORTS:
            return _REPORTS[model]
        decisions = layer_decisions(model, self.options.module_filter)
        wanted = {name for name, why in decisions.items() if why is None}
        before = dict(model.named_parameters())
        notes: List[str] = []
        if self.backend == "TE":
            from . import precision_te

            recipe = precision_te.convert(model, wanted, self.options.te)
            all_gather: Optional[bool] = None
        else:
            recipe = self.options.recipe or ("your Float8LinearConfig" if self.options.config is not None else "tensorwise")
            all_gather = None
            if wanted:
                config, all_gather, notes = self.torchao_config()
                _torchao(quiet=self.support[0] != "matmul").convert_to_float8_training(
                    model, config=config, module_filter_fn=functools.partial(_named, wanted))
                for name, module in model.named_modules():  # torchao follows CUDA's autocast only: every device's
                    if name in wanted:
                        module.register_forward_pre_hook(_autocast_input)
            if all_gather:
                self._all_gather_models.append(model)
        after = dict(model.named_parameters())
        self.replaced.update({id(p): after[n] for n, p in before.items() if n in after and after[n] is not p})
        if self._emulate_note:
            notes.insert(0, self._emulate_note)
        result = Fp8Report(model=type(model).__name__, backend=self.backend, recipe=recipe,
                           converted=tuple(n for n in decisions if n in wanted),
                           kept={n: why for n, why in decisions.items() if why is not None}, emulated=self.emulate,
                           fsdp_float8_all_gather=all_gather if self.sharded and wanted else None, notes=tuple(notes))
        _REPORTS[model] = result
        if self.is_main_process and not wanted:
            warnings.warn(f"mixed_precision='fp8': no linear layer of {type(model).__name__} was converted, so it trains "
                          f"in bf16 autocast: {result.message()}. Pass a module_filter_func (AORecipeKwargs) to choose "
                          "layers, or use mixed_precision='bf16'", stacklevel=4)
        elif self.is_main_process:
            print(f"[anyaccel] {result.message()}", file=sys.stderr, flush=True)
        return result

    def torchao_config(self) -> Tuple[Any, bool, List[str]]:
        """(the ``Float8LinearConfig`` to convert with, whether FSDP2 all-gathers in fp8, notes on
        settings changed): see the module docstring. Imports torchao. Local."""
        ao = _torchao(quiet=self.support[0] != "matmul")
        given = self.options.config
        if given is not None and not isinstance(given, ao.Float8LinearConfig):
            raise TypeError(f"AORecipeKwargs(config=...) must be a torchao.float8.Float8LinearConfig; got "
                            f"{type(given).__module__}.{type(given).__name__}")
        config = given if given is not None else ao.Float8LinearConfig.from_recipe_name(self.options.recipe or "tensorwise")
        changes: Dict[str, Any] = {"emulate": self.emulate}
        if given is None:
            changes["pad_inner_dim"] = True if self.options.pad_inner_dim is None else self.options.pad_inner_dim
        elif self.options.pad_inner_dim is not None:
            changes["pad_inner_dim"] = self.options.pad_inner_dim
        tensorwise = config.cast_config_weight.scaling_granularity is ao.ScalingGranularity.TENSORWISE
        asked = self.options.fsdp_float8_all_gather
        if asked is None:
            asked = config.enable_fsdp_float8_all_gather if given is not None else None
        notes = []
        if asked and not self.sharded:
            notes.append("enable_fsdp_float8_all_gather is off: it works under FSDP2 only, which does not shard this "
                         "model")
        all_gather = bool(self.sharded and tensorwise and asked is not False)
        changes["enable_fsdp_float8_all_gather"] = all_gather
        if self.sharded and not tensorwise:
            notes.append("FSDP2 all-gathers in bf16: torchao's fp8 all-gather needs tensorwise weight scales")
        return dataclasses.replace(config, **changes), all_gather, notes

    # ---- optimizers and the wrapped model ----------------------------------------------------
    def remap(self, optimizer: torch.optim.Optimizer) -> None:
        """Point ``optimizer`` (built on the model before ``prepare``) at the parameters a
        conversion replaced. Refuses one that already holds state for them. Local."""
        if not self.replaced:
            return
        stale = [p for group in optimizer.param_groups for p in group["params"] if id(p) in self.replaced]
        if stale and any(p in optimizer.state for p in stale):
            raise ValueError("this optimizer already holds state for parameters that the fp8 conversion replaced; "
                             "create it before training and pass it to prepare() with the model")
        for group in optimizer.param_groups:
            group["params"] = [self.replaced.get(id(p), p) for p in group["params"]]

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Under FSDP2's fp8 all-gather: after each step of ``optimizer``, precompute the fp8 scales
        of the models whose parameters it updates (torchao's
        ``precompute_float8_dynamic_scale_for_fsdp``: one all-reduce). Local registration;
        the hook is collective (every rank steps alike)."""
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for model in self._all_gather_models:
            key = (id(optimizer), id(model))
            if key in self._hooked or not any(id(p) in mine for p in model.parameters()):
                continue
            self._hooked[key] = optimizer.register_step_post_hook(functools.partial(_precompute_scales, model))

    def refresh(self) -> None:
        """Recompute the precomputed fp8 scales from the weights as they are now (after
        ``load_state`` replaced them). Collective under FSDP2's fp8 all-gather; nothing otherwise."""
        for model in self._all_gather_models:
            _precompute_scales(model)

    def wrap_forward(self, wrapped: torch.nn.Module) -> None:
        """After wrapping: Transformer Engine runs the prepared model's forward under its
        ``fp8_autocast`` (torchao needs nothing). Local."""
        if self.backend == "TE":
            from . import precision_te

            precision_te.wrap_forward(wrapped, self.options.te)

    def release(self) -> None:
        """Remove the step hooks and forget the models (``Accelerator.free_memory``). Local."""
        for handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
        self._all_gather_models.clear()
        self.replaced.clear()


def _precompute_scales(model: torch.nn.Module, *_: Any) -> None:
    """Step hook: ``model``'s fp8 weight scales for FSDP2's next all-gather (one all-reduce). Collective."""
    _torchao().precompute_float8_dynamic_scale_for_fsdp(model)


def _named(wanted: Any, module: torch.nn.Module, fqn: str) -> bool:
    return fqn in wanted


def _autocast_input(module: torch.nn.Module, args: Tuple[Any, ...]) -> Optional[Tuple[Any, ...]]:
    """A converted layer's input in its device's autocast dtype when autocast is on: what
    ``Float8Linear.forward`` does for CUDA's autocast only, for every device's (emulated fp8 on the
    CPU sees the bf16 inputs a GPU run sees; on CUDA it is the same cast, done once). Local."""
    if not args or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point():
        return None
    device = args[0].device.type
    if not torch.is_autocast_enabled(device):
        return None
    return (args[0].to(torch.get_autocast_dtype(device)), *args[1:])


def _torchao(quiet: bool = False) -> Any:
    """``torchao.float8``, imported on first use. ``quiet`` (a device without fp8 matmuls): torchao's
    CUDA kernels cannot load there and say so at import (and torch warns about an enum torchao
    registers): those lines are dropped; nothing else is."""
    if "torchao.float8" in sys.modules:
        return sys.modules["torchao.float8"]
    import logging

    class _Expected(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            text = record.getMessage()
            return not (("Failed to load" in text and ".so" in text) or "KernelPreference" in text)

    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")] if quiet else []
    expected = _Expected()
    for logger in loggers:
        logger.addFilter(expected)
    try:
        ao = importlib.import_module("torchao.float8")  # (torchao ships no type information)
    except Exception as exc:  # an installed torchao that does not work with this torch
        raise ImportError(f"mixed_precision='fp8': torchao could not be imported with torch {torch.__version__} "
                          f"({type(exc).__name__}: {exc}); {INSTALL['AO']} needs torch 2.11 or newer") from exc
    finally:
        for logger in loggers:
            logger.removeFilter(expected)
    return ao
