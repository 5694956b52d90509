"""The ``Accelerator``'s options, resolved once: :class:`AcceleratorOptions` and :func:`resolve_options`.

Every option follows one precedence rule, applied in one place (:func:`resolve_options`):

    the argument given to ``Accelerator(...)``  >  what the launcher passed (config file or
    ``anyaccel launch`` flag, through :mod:`anyaccel.envvars`)  >  the default

Which options the launcher can set, their variables and defaults are the option table's
(:mod:`anyaccel.optionspec`: every row with an ``argument`` and a ``variable``); :data:`PRECEDENCE`
is made from it, and ``docs/concepts/options.md`` shows it as a table (:func:`precedence_table`;
a test keeps the two equal). Each value is checked where it enters: an argument here, by its
row's check (the message names the argument); the launcher's values when they are read
(:func:`anyaccel.envvars.worker_settings`, the message names the variable).

A strategy's options travel typed: ``strategy=`` takes a name or an options object
(``FSDPOptions(...)``, ``ParallelismConfig(...)``, a third-party strategy's own; Fabric's
``Union[str, Strategy]``), and ``fsdp_plugin=`` / ``parallelism_config=`` / ``deepspeed_plugin=``
(Accelerate's spellings; the last also built from the launcher's DeepSpeed settings) become the
same object: :attr:`AcceleratorOptions.strategy_options`, which the strategy receives.
``handlers`` holds only Accelerate's kwargs handlers.

The result is a frozen object, validated in ``__post_init__``: what the ``Accelerator`` and its
:class:`~anyaccel.runtime.Runtime` are built from; nothing reads the arguments again afterwards.
The launcher's variables are read here, and in two more places on purpose: a
``ParallelismConfig`` built in the script takes ``PARALLELISM_CONFIG_*`` for the fields it left
None, and ``PartialState()`` (no ``Accelerator``) reads ``cpu`` and ``mixed_precision``. Local;
pure (the launcher's settings are an argument).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from . import envvars, optionspec
from .data import DataLoaderConfiguration, resolve_dataloader_config
from .kwargs import (AutocastKwargs, DistributedDataParallelKwargs, GradientAccumulationPlugin, GradScalerKwargs,
                     InitProcessGroupKwargs, ProfileKwargs)
from .plugins import FullyShardedDataParallelPlugin, TorchDynamoPlugin
from .preemption import parse_signals
from .strategies import choose_strategy, strategy_entry
from .strategies.deepspeed_config import DeepSpeedOptions
from .strategies.options import FSDPOptions, ParallelismConfig, StrategyOptions

__all__ = ["AcceleratorOptions", "PRECEDENCE", "resolve_options", "precedence_table"]

_HANDLER_TYPES = (DistributedDataParallelKwargs, GradScalerKwargs, InitProcessGroupKwargs, AutocastKwargs, ProfileKwargs)

#: ``Accelerator`` argument -> the option rows the launcher fills it from (the N-D sizes all fill
#: ``parallelism_config``). Made from the option table; the one table of the precedence rule.
PRECEDENCE: Mapping[str, Tuple[optionspec.Option, ...]] = types.MappingProxyType({
    argument: tuple(row for row in optionspec.options_with("argument") if row.argument == argument)
    for argument in dict.fromkeys(row.argument for row in optionspec.options_with("argument") if row.argument)})

_ROW = optionspec.option


def _pick(name: str, argument: Any, launcher: envvars.WorkerSettings) -> Any:
    """``argument`` (checked; the message names it), else the launcher's value of option
    ``name`` (checked when read), else the option's default."""
    row = _ROW(name)
    if argument is not None:
        return optionspec.check(row, argument, row.argument or name)
    told = getattr(launcher, name)
    return told if told is not None else row.default


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AcceleratorOptions:
    """What an ``Accelerator`` was asked for, after the precedence rule (see the module docstring).
    Read-only; validated when made."""

    device_placement: bool = True
    cpu: bool = _ROW("cpu").default
    mixed_precision: str = _ROW("mixed_precision").default
    gradient_accumulation_steps: int = _ROW("gradient_accumulation_steps").default
    accumulation: GradientAccumulationPlugin = dataclasses.field(default_factory=GradientAccumulationPlugin)
    strategy: Optional[str] = None  # None: the device's default (create_strategy)
    strategy_options: Optional[StrategyOptions] = None  # the strategy's typed options (None: its defaults)
    fsdp_plugin: Optional[FullyShardedDataParallelPlugin] = None  # Accelerate's spelling, as given (state.fsdp_plugin)
    deepspeed_plugin: Any = None  # anyaccel.utils.DeepSpeedPlugin as given (its module imports torch)
    dynamo_plugin: Optional[TorchDynamoPlugin] = None
    hang_timeout: float = _ROW("hang_timeout").default
    preemption_signals: Tuple[str, ...] = parse_signals(_ROW("preemption_signals").default)
    handlers: Tuple[Any, ...] = ()  # Accelerate's kwargs handlers, one per type (a tuple: it pickles)
    dataloader_config: DataLoaderConfiguration = dataclasses.field(default_factory=DataLoaderConfiguration)
    step_scheduler_with_optimizer: bool = True
    step_scheduler_per_process: bool = True

    def __post_init__(self) -> None:
        optionspec.check(_ROW("hang_timeout"), self.hang_timeout, "hang_timeout")
        if self.strategy_options is not None and self.strategy != self.strategy_options.strategy:
            raise ValueError(f"strategy={self.strategy!r} but strategy_options configure "
                             f"{self.strategy_options.strategy!r}")

    @property
    def process_group(self) -> Optional[InitProcessGroupKwargs]:
        """The ``InitProcessGroupKwargs`` handler, if one was given."""
        return self.handlers_by_type().get(InitProcessGroupKwargs)

    def handlers_by_type(self) -> Dict[type, Any]:
        """The kwargs handlers as ``{type: handler}``."""
        return {type(h): h for h in self.handlers}

    def handler(self, kind: type) -> Any:
        """The kwargs handler of type ``kind``, or its defaults."""
        found = self.handlers_by_type().get(kind)
        return found if found is not None else kind()


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
    loaders = resolve_dataloader_config(dataloader_config, split_batches=split_batches, even_batches=even_batches,
                                        dispatch_batches=dispatch_batches)
    name, typed, fsdp_plugin = _strategy(strategy, fsdp_plugin, parallelism_config, launcher)
    deepspeed_plugin = _launcher_deepspeed(deepspeed_plugin, name, typed, launcher)
    if deepspeed_plugin is not None:  # DeepSpeed's options imply the deepspeed strategy
        name, typed = _deepspeed(deepspeed_plugin, strategy, typed, fsdp_plugin)
        gradient_accumulation_steps = _deepspeed_accumulation(typed, gradient_accumulation_steps)
    accumulation, steps = _accumulation(gradient_accumulation_plugin, gradient_accumulation_steps, launcher)
    return AcceleratorOptions(
        device_placement=device_placement, cpu=bool(_pick("cpu", cpu, launcher)),
        mixed_precision=_pick("mixed_precision", mixed_precision, launcher), gradient_accumulation_steps=steps,
        accumulation=accumulation, strategy=name, strategy_options=typed, fsdp_plugin=fsdp_plugin,
        deepspeed_plugin=deepspeed_plugin,
        dynamo_plugin=_dynamo(dynamo_plugin, dynamo_backend, launcher),
        hang_timeout=_pick("hang_timeout", hang_timeout, launcher),
        preemption_signals=parse_signals(_pick("preemption_signals", preemption_signals, launcher)),
        handlers=handlers, dataloader_config=loaders, step_scheduler_with_optimizer=step_scheduler_with_optimizer,
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
    picked = _pick("strategy", argument, launcher)
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
    from .plugins import fsdp_plugin_from_dict

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


def _dynamo(plugin: Any, backend: Optional[str], launcher: envvars.WorkerSettings) -> Any:
    if plugin is not None and backend is not None:
        raise ValueError("give dynamo_backend or dynamo_plugin, not both")
    if plugin is not None:
        return plugin
    if backend is not None:  # any torch.compile backend, as before (the launcher's are the table's choices)
        return TorchDynamoPlugin(backend=backend)
    if launcher.dynamo_backend:
        return TorchDynamoPlugin(backend=launcher.dynamo_backend, mode=launcher.dynamo_mode)
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
    return accumulation, int(_pick("gradient_accumulation_steps", steps, launcher))


def precedence_table() -> str:
    """The precedence rule as a Markdown table (what ``docs/concepts/options.md`` shows), one
    line per option the launcher can set for an ``Accelerator`` argument, made from the option
    table."""
    rows = ["| `Accelerator(...)` argument | launcher variable | `anyaccel launch` flag | config key | default |",
            "|---|---|---|---|---|"]
    for argument, options in PRECEDENCE.items():
        for row in options:
            key = f"`{row.section}: {row.key}`" if row.section else f"`{row.key}`" if row.key else "—"
            default = "none" if row.default is None else f"`{row.default}`"
            flag = f"`{row.flag}`" if row.flag else "—"
            rows.append(f"| `{argument}` | `{row.variable}` | {flag} | {key} | {default} |")
    return "\n".join(rows)
