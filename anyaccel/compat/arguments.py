"""Accelerate's arguments to ``Accelerator(...)``, converted into the core's :class:`~anyaccel.options.AcceleratorOptions`.

:func:`resolve_options` applies the precedence rule (:func:`anyaccel.options.pick`: the argument >
the launcher's setting > the default) to every argument, and turns the ones given in Accelerate's
formats into the typed objects the core reads:

* ``kwargs_handlers`` (:mod:`anyaccel.compat.kwargs`): one per type, kept as given for the façade;
  ``InitProcessGroupKwargs`` becomes the :class:`~anyaccel.process_group.ProcessGroupOptions`;
  ``DistributedDataParallelKwargs`` is found by the DDP strategy through its ``to_options()``;
* ``fsdp_plugin`` / ``parallelism_config`` / ``deepspeed_plugin`` (and the launcher's
  ``fsdp_config``, N-D sizes and DeepSpeed settings) become one strategy name and its typed
  :class:`~anyaccel.strategies.options.StrategyOptions`; options given alone select their
  strategy (the registry's rule, :func:`anyaccel.strategies.choose_strategy`), two sets of them
  are refused;
* ``gradient_accumulation_plugin`` becomes the steps and the
  :class:`~anyaccel.accumulation.AccumulationOptions`;
* ``dynamo_plugin`` / ``dynamo_backend`` (and the launcher's) become the
  :class:`~anyaccel.strategies.compile.CompileOptions`;
* under ``mixed_precision="fp8"``, the fp8 recipe handler (``AORecipeKwargs``, ``TERecipeKwargs``,
  ``FP8RecipeKwargs``; its fields left None take the launcher's ``fp8_config`` settings,
  Accelerate's rule) or else the launcher's settings become the
  :class:`~anyaccel.precision_fp8.Fp8Options`.

The plugins are kept as given too (``accelerator.state.fsdp_plugin``, ...). Local and pure: the
launcher's settings are an argument. Errors name the argument and the value.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Sequence, Tuple

from .. import envvars
from ..data import DataLoaderConfiguration, resolve_dataloader_config
from ..options import AcceleratorOptions, pick
from ..training.precision_fp8 import Fp8Options, options_from_settings
from ..process.preemption import parse_signals
from ..process.process_group import ProcessGroupOptions
from ..strategies import choose_strategy, strategy_entry
from ..strategies.deepspeed.config import DeepSpeedOptions
from ..strategies.fsdp.options import FSDPOptions
from ..strategies.nd.options import ParallelismConfig
from ..strategies.options import StrategyOptions
from .kwargs import (AORecipeKwargs, AutocastKwargs, DistributedDataParallelKwargs, FP8RecipeKwargs,
                     GradientAccumulationPlugin, GradScalerKwargs, InitProcessGroupKwargs, ProfileKwargs, TERecipeKwargs)
from .plugins import FullyShardedDataParallelPlugin, TorchDynamoPlugin, fsdp_plugin_from_dict

__all__ = ["resolve_options"]

_FP8_TYPES = (AORecipeKwargs, TERecipeKwargs, FP8RecipeKwargs)
_HANDLER_TYPES = (DistributedDataParallelKwargs, GradScalerKwargs, InitProcessGroupKwargs, AutocastKwargs, ProfileKwargs,
                  *_FP8_TYPES)

def resolve_options(launcher: envvars.WorkerSettings, *, device_placement: bool = True,
                    split_batches: Optional[bool] = None, mixed_precision: Optional[str] = None,
                    gradient_accumulation_steps: Optional[int] = None, cpu: Optional[bool] = None,
                    step_scheduler_with_optimizer: bool = True, kwargs_handlers: Optional[Sequence[Any]] = None,
                    even_batches: Optional[bool] = None, strategy: Any = None, fsdp_plugin: Any = None,
                    dynamo_backend: Optional[str] = None, dynamo_plugin: Any = None,
                    dispatch_batches: Optional[bool] = None,
                    dataloader_config: Optional[DataLoaderConfiguration] = None,
                    step_scheduler_per_process: bool = True, hang_timeout: Optional[float] = None,
                    preemption_signals: Any = None, gradient_accumulation_plugin: Any = None,
                    parallelism_config: Any = None, deepspeed_plugin: Any = None) -> AcceleratorOptions:
    """Apply the precedence rule to ``Accelerator``'s arguments (same names) and the launcher's
    settings (:func:`anyaccel.envvars.worker_settings`). Local and pure. Raises ``TypeError`` /
    ``ValueError`` / :class:`~anyaccel.errors.ConfigError` naming the bad value."""
    handlers = _handlers(kwargs_handlers)
    whole_last_batches = bool(pick("whole_last_batches", None, launcher))  # for a field left None
    loaders = resolve_dataloader_config(dataloader_config, split_batches=split_batches, even_batches=even_batches,
                                        dispatch_batches=dispatch_batches, whole_last_batches=whole_last_batches)
    name, typed, fsdp_plugin = _strategy(strategy, fsdp_plugin, parallelism_config, launcher)
    deepspeed_plugin = _launcher_deepspeed(deepspeed_plugin, name, typed, launcher)
    if deepspeed_plugin is not None:  # DeepSpeed's options imply the deepspeed strategy
        name, typed = _deepspeed(deepspeed_plugin, strategy, typed, fsdp_plugin)
        gradient_accumulation_steps = _deepspeed_accumulation(typed, gradient_accumulation_steps)
    accumulation, steps = _accumulation(gradient_accumulation_plugin, gradient_accumulation_steps, launcher)
    dynamo = _dynamo(dynamo_plugin, dynamo_backend, launcher)
    group = {type(h): h for h in handlers}.get(InitProcessGroupKwargs)
    precision = pick("mixed_precision", mixed_precision, launcher)
    return AcceleratorOptions(
        device_placement=device_placement, cpu=bool(pick("cpu", cpu, launcher)),
        mixed_precision=precision, fp8=_fp8(handlers, precision, name, launcher), gradient_accumulation_steps=steps,
        accumulation=accumulation.to_options(), gradient_accumulation_plugin=accumulation, strategy=name,
        strategy_options=typed, fsdp_plugin=fsdp_plugin, deepspeed_plugin=deepspeed_plugin,
        process_group=group.to_options() if group is not None else ProcessGroupOptions(),
        dynamo_plugin=dynamo, compile_options=dynamo.to_options() if dynamo is not None else None,
        hang_timeout=pick("hang_timeout", hang_timeout, launcher),
        preemption_signals=parse_signals(pick("preemption_signals", preemption_signals, launcher)),
        handlers=handlers, dataloader_config=loaders, whole_last_batches=whole_last_batches,
        step_scheduler_with_optimizer=step_scheduler_with_optimizer,
        step_scheduler_per_process=bool(step_scheduler_per_process))


def _handlers(given: Optional[Sequence[Any]]) -> Tuple[Any, ...]:
    handlers = {type(h): h for h in (given or [])}
    for h in handlers.values():
        if not isinstance(h, _HANDLER_TYPES):
            hint = (f"; {type(h).__name__} configures strategy {h.strategy!r}: pass it as Accelerator(strategy=...)"
                    if isinstance(h, StrategyOptions) else "")
            raise TypeError(f"kwargs_handlers accepts {', '.join(c.__name__ for c in _HANDLER_TYPES)}; "
                            f"got {type(h).__name__}{hint}")
    return tuple(handlers.values())


def _fp8(handlers: Tuple[Any, ...], precision: str, strategy: Optional[str],
         launcher: envvars.WorkerSettings) -> Optional[Fp8Options]:
    """The fp8 options under ``mixed_precision="fp8"`` (None otherwise): the one recipe handler
    given, its fields left None filled from the launcher's ``fp8_config`` settings, else the
    launcher's settings alone. A recipe handler without fp8, two of them, or fp8 under DeepSpeed
    is a ``ValueError``; launcher settings no argument uses are named by a warning."""
    given = [h for h in handlers if isinstance(h, _FP8_TYPES)]
    told = launcher.section_fields("fp8_config")
    if len(given) > 1:
        raise ValueError(f"kwargs_handlers has {' and '.join(type(h).__name__ for h in given)}: give one fp8 recipe "
                         "handler")
    if given and precision != "fp8":
        raise ValueError(f"kwargs_handlers has {type(given[0]).__name__}, an fp8 recipe, but mixed_precision="
                         f"{precision!r}; pass mixed_precision='fp8' (or drop the handler)")
    if precision != "fp8":
        if told:
            import warnings

            warnings.warn(f"the launcher's fp8 settings {told} are not used: mixed_precision is {precision!r}",
                          stacklevel=5)
        return None
    if strategy == "deepspeed":
        raise ValueError("mixed_precision='fp8' with the deepspeed strategy: DeepSpeed's engine keeps its own "
                         "bf16/fp16 copies and anyaccel has not verified fp8 layers inside it; use strategy 'fsdp' "
                         "(FSDP2 all-gathers in fp8) or 'ddp'")
    base = options_from_settings(told)
    if not given:
        return base
    handler = given[0]
    options: Fp8Options = handler.to_options(base)
    unused = [name for name, value in told.items() if not _uses(options, name, value)]
    if unused:
        import warnings

        warnings.warn(f"the launcher's fp8 settings {', '.join(unused)} are not used: Accelerator(kwargs_handlers="
                      f"[{type(handler).__name__}(...)]) chose backend {options.backend}", stacklevel=5)
    return options


#: the launcher's fp8 settings that are torchao's, by the Fp8Options field they fill
_TORCHAO_SETTINGS = {"fp8_backend": "backend", "fp8_recipe": "recipe", "fp8_emulate": "emulate",
                     "fp8_pad_inner_dim": "pad_inner_dim", "fp8_enable_fsdp_float8_all_gather": "fsdp_float8_all_gather"}


def _uses(options: Fp8Options, setting: str, value: Any) -> bool:
    """Whether the launcher's fp8 ``setting`` (an option name) with ``value`` reached ``options``
    (a torchao setting: the field has that value; a Transformer Engine one: the backend is TE)."""
    field = _TORCHAO_SETTINGS.get(setting)
    return bool(getattr(options, field) == value) if field else options.backend == "TE"


def _strategy(argument: Any, fsdp_plugin: Any, parallelism_config: Any,
              launcher: envvars.WorkerSettings) -> Tuple[Optional[str], Optional[StrategyOptions], Any]:
    """(strategy name, its typed options, the FSDP plugin as given): ``strategy`` as an options
    object (it names its strategy), else a name (argument, else the launcher's), with the
    registry's rule for options that select their strategy (``fsdp_plugin``: ``fsdp``;
    ``parallelism_config``: ``nd``)."""
    if isinstance(argument, StrategyOptions):
        return _typed(argument, fsdp_plugin, parallelism_config), argument, None
    if fsdp_plugin is not None and not isinstance(fsdp_plugin, FullyShardedDataParallelPlugin):
        raise TypeError(f"fsdp_plugin must be a FullyShardedDataParallelPlugin; got {type(fsdp_plugin).__name__}")
    picked = pick("strategy", argument, launcher)
    chosen = None if picked == "auto" else picked
    if fsdp_plugin is None and launcher.fsdp_config is not None and chosen == FSDPOptions.strategy:
        fsdp_plugin = _launcher_fsdp(launcher)
    typed: Optional[StrategyOptions] = None
    if fsdp_plugin is not None:  # FSDP options imply FSDP (over the launcher's strategy too): the registry's rule
        chosen = choose_strategy(argument, FSDPOptions.strategy, options_source="fsdp_plugin")
        typed = fsdp_plugin.to_options()
    config = _parallelism(parallelism_config, argument, chosen, fsdp_plugin, launcher)
    if config is not None:  # a ParallelismConfig selects the 'nd' strategy
        chosen = choose_strategy(argument, ParallelismConfig.strategy, options_source="parallelism_config")
        typed = config
    return chosen, typed, fsdp_plugin


def _typed(options: StrategyOptions, fsdp_plugin: Any, parallelism_config: Any) -> str:
    """The strategy an options object configures, which must be registered; the Accelerate
    spellings next to it would be a second set of options: refused."""
    for given, name in ((fsdp_plugin, "fsdp_plugin"), (parallelism_config, "parallelism_config")):
        if given is not None:
            raise ValueError(f"strategy={type(options).__name__}(...) and {name} both configure the strategy; "
                             "give one of them")
    name = type(options).strategy
    if not name or strategy_entry(name) is None:
        raise ValueError(f"strategy={type(options).__name__}(...) configures strategy {name!r}, which is not "
                         "registered; register it first (anyaccel.strategies.register_strategy or an "
                         "anyaccel.strategies entry point)")
    return name


def _launcher_fsdp(launcher: envvars.WorkerSettings) -> FullyShardedDataParallelPlugin:
    return fsdp_plugin_from_dict(launcher.fsdp_config, source=envvars.WORKER_VARS["fsdp_config"].name)


def _parallelism(argument: Any, strategy: Any, chosen: Optional[str], fsdp_plugin: Any,
                 launcher: envvars.WorkerSettings) -> Optional[ParallelismConfig]:
    """The ``parallelism_config`` argument, else the launcher's N-D sizes
    (``PARALLELISM_CONFIG_*_SIZE``: the config file's ``parallelism_config`` or ``anyaccel launch
    --parallelism_config_*``; sizes not set are 1) as a :class:`ParallelismConfig`; else None.
    Its FSDP part is the ``fsdp_plugin`` argument's, else the launcher's ``fsdp_config``. A
    ``strategy`` argument other than ``nd`` wins over the launcher's sizes (a warning says they
    are not used)."""
    if argument is not None:
        if not isinstance(argument, ParallelismConfig):
            raise TypeError(f"parallelism_config must be anyaccel's ParallelismConfig (from anyaccel import "
                            f"ParallelismConfig); got {type(argument).__module__}.{type(argument).__name__}")
        return _with_fsdp_plugin(argument, fsdp_plugin)
    sizes = launcher.parallelism_fields()
    if not (sizes or chosen == ParallelismConfig.strategy):
        return None
    if strategy not in (None, "auto", ParallelismConfig.strategy):
        if sizes:
            import warnings

            warnings.warn(f"the launcher's N-D parallelism sizes {sizes} (PARALLELISM_CONFIG_*_SIZE) are not used: "
                          f"Accelerator(strategy={strategy!r}) was given; drop it to train with them, or launch "
                          "without parallelism_config", stacklevel=5)
        return None
    if fsdp_plugin is None and launcher.fsdp_config is not None:
        fsdp_plugin = _launcher_fsdp(launcher)
    fsdp = fsdp_plugin.to_options() if fsdp_plugin is not None else None
    told: Dict[str, Any] = {name: 1 for name in envvars.PARALLELISM_SIZES}  # sizes not told are 1
    told.update(sizes)
    return ParallelismConfig(**told, fsdp=fsdp)


def _with_fsdp_plugin(config: ParallelismConfig, fsdp_plugin: Any) -> ParallelismConfig:
    """``config`` with the ``fsdp_plugin`` argument as its FSDP part (Accelerate's scripts pass
    both: the plugin configures how the data-parallel dimensions shard). A ``config.fsdp`` of its
    own that differs from the plugin's is a ``ValueError``: one of them would be ignored."""
    if fsdp_plugin is None:
        return config
    options = fsdp_plugin.to_options()
    if config.fsdp not in (FSDPOptions(), options):
        raise ValueError(f"fsdp_plugin and parallelism_config.fsdp both configure how the data-parallel dimensions "
                         f"are sharded, differently ({options} vs {config.fsdp}); give one of them")
    return dataclasses.replace(config, fsdp=options)


def _launcher_deepspeed(plugin: Any, chosen: Optional[str], typed: Optional[StrategyOptions],
                        launcher: envvars.WorkerSettings) -> Any:
    """The ``deepspeed_plugin`` argument, else the ``DeepSpeedPlugin`` of the launcher's DeepSpeed
    settings (``anyaccel launch --use_deepspeed --zero_stage 2``, a config file's
    ``deepspeed_config``: Accelerate's ``ACCELERATE_DEEPSPEED_*`` variables) when the deepspeed
    strategy was chosen without typed options, the plugin's defaults for what was not set: a plain
    ``Accelerator()`` trains as under ``accelerate launch --use_deepspeed``. A plugin argument takes
    the launcher's settings for the fields its script left None (Accelerate's rule). Settings the
    launcher passed that an argument overrides (a field the plugin sets, another strategy) are named
    by a warning."""
    told = launcher.section_fields("deepspeed_config")
    if plugin is None and chosen == DeepSpeedOptions.strategy and typed is None:
        from .utils.deepspeed import deepspeed_plugin_from_settings

        return deepspeed_plugin_from_settings(told, source="the launcher's DeepSpeed settings")
    if plugin is not None and told and typed is None and hasattr(plugin, "_given"):
        from .utils.deepspeed import with_launcher_settings

        plugin, unused = with_launcher_settings(plugin, told)  # fields the script left None: Accelerate's rule
        told = {name: told[name] for name in unused}
    if told:
        import warnings

        given = "Accelerator(deepspeed_plugin=...)" if plugin is not None else \
            f"Accelerator(strategy={type(typed).__name__}(...))" if typed is not None else \
            f"Accelerator(strategy={chosen!r})"
        warnings.warn(f"the launcher's DeepSpeed settings {told} ({', '.join(envvars.WORKER_VARS[n].name for n in told)})"
                      f" are not used: {given} was given; drop it to train with them", stacklevel=5)
    return plugin


def _deepspeed(plugin: Any, strategy: Any, typed: Optional[StrategyOptions],
               fsdp_plugin: Any) -> Tuple[Optional[str], DeepSpeedOptions]:
    """(``deepspeed``, the options) of a ``deepspeed_plugin`` (``TypeError`` for anything else);
    another set of sharding options beside it is a ``ValueError``: one of them would be ignored."""
    convert = getattr(plugin, "to_options", None)
    options = convert() if callable(convert) else None
    if not isinstance(options, DeepSpeedOptions):
        raise TypeError(f"deepspeed_plugin must be a DeepSpeedPlugin (from anyaccel.utils import DeepSpeedPlugin); got "
                        f"{type(plugin).__module__}.{type(plugin).__name__}")
    if fsdp_plugin is not None or typed is not None:
        other = ("fsdp_plugin" if fsdp_plugin is not None else "parallelism_config"
                 if isinstance(typed, ParallelismConfig) else f"strategy={type(typed).__name__}(...)")
        raise ValueError(f"deepspeed_plugin and {other} both choose how the model is sharded; give one of them")
    return choose_strategy(strategy, DeepSpeedOptions.strategy, options_source="deepspeed_plugin"), options


def _deepspeed_accumulation(options: DeepSpeedOptions, steps: Optional[int]) -> Optional[int]:
    """The accumulation steps: the argument, else a number the DeepSpeed config sets (Accelerate
    takes DeepSpeed's); both given and different is a ``ValueError``."""
    configured = options.config.get("gradient_accumulation_steps", "auto")
    if configured in ("auto", None):
        return steps
    if steps is not None and int(steps) != int(configured):
        raise ValueError(f"gradient_accumulation_steps={steps} and the DeepSpeed config's gradient_accumulation_steps="
                         f"{configured} disagree; give one of them (or set the config's to \"auto\")")
    return int(configured)


def _dynamo(plugin: Any, backend: Optional[str], launcher: envvars.WorkerSettings) -> Optional[TorchDynamoPlugin]:
    """The ``dynamo_plugin`` argument, else one made of ``dynamo_backend``, else of the launcher's
    ``dynamo_backend``/``dynamo_mode``/``dynamo_use_fullgraph``/``dynamo_use_dynamic``; None: models
    are not compiled."""
    if plugin is not None and backend is not None:
        raise ValueError("give dynamo_backend or dynamo_plugin, not both")
    if plugin is not None:
        if not isinstance(plugin, TorchDynamoPlugin):
            raise TypeError(f"dynamo_plugin must be a TorchDynamoPlugin (from anyaccel.utils import TorchDynamoPlugin); "
                            f"got {type(plugin).__module__}.{type(plugin).__name__}")
        return plugin
    if backend is not None:  # any torch.compile backend, as before (the launcher's are the table's choices)
        return TorchDynamoPlugin(backend=backend)
    if launcher.dynamo_backend:
        return TorchDynamoPlugin(backend=launcher.dynamo_backend, mode=launcher.dynamo_mode,
                                 fullgraph=launcher.dynamo_use_fullgraph, dynamic=launcher.dynamo_use_dynamic)
    return None


def _accumulation(plugin: Any, steps: Optional[int],
                  launcher: envvars.WorkerSettings) -> Tuple[GradientAccumulationPlugin, int]:
    accumulation = plugin or GradientAccumulationPlugin()
    if not isinstance(accumulation, GradientAccumulationPlugin):
        raise TypeError(f"gradient_accumulation_plugin must be a GradientAccumulationPlugin; got "
                        f"{type(accumulation).__name__}")
    if plugin is not None and accumulation.num_steps is not None:
        if steps is not None and steps != accumulation.num_steps:
            raise ValueError(f"gradient_accumulation_steps={steps} and gradient_accumulation_plugin.num_steps="
                             f"{accumulation.num_steps} disagree; give one of them")
        steps = accumulation.num_steps
    return accumulation, int(pick("gradient_accumulation_steps", steps, launcher))
