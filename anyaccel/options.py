"""The ``Accelerator``'s options, resolved once: :class:`AcceleratorOptions` and :func:`resolve_options`.

Every option follows one precedence rule, applied in one place (:func:`resolve_options`):

    the argument given to ``Accelerator(...)``  >  what the launcher passed (config file or
    ``anyaccel launch`` flag, through :mod:`anyaccel.envvars`)  >  the default

and every default is written once, on its variable in :mod:`anyaccel.envvars` (the config schema
and :mod:`anyaccel.preemption` read it from there). :data:`PRECEDENCE` lists the options that
the launcher can set (the N-D sizes, ``PARALLELISM_CONFIG_*_SIZE``, follow the same rule in
:func:`_parallelism`: a ``parallelism_config`` argument, else the launcher's sizes, else none);
``docs/concepts/options.md`` shows it as a table (a test keeps the two
equal). The result is a frozen object, validated in ``__post_init__``: what the ``Accelerator``
and its :class:`~anyaccel.runtime.Runtime` are built from, and nothing reads the arguments or the
launcher variables again afterwards. Local; pure (the launcher's settings are an argument).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from . import envvars
from . import precision as _precision
from .data import DataLoaderConfiguration, resolve_dataloader_config
from .kwargs import (AutocastKwargs, DistributedDataParallelKwargs, GradientAccumulationPlugin, GradScalerKwargs,
                     InitProcessGroupKwargs, ProfileKwargs)
from .plugins import FullyShardedDataParallelPlugin, TorchDynamoPlugin
from .preemption import parse_signals
from .strategies import choose_strategy
from .strategies.deepspeed_config import DeepSpeedOptions
from .strategies.options import FSDPOptions, ParallelismConfig

__all__ = ["AcceleratorOptions", "PRECEDENCE", "resolve_options", "precedence_table"]

_HANDLER_TYPES = (DistributedDataParallelKwargs, GradScalerKwargs, InitProcessGroupKwargs, AutocastKwargs, ProfileKwargs)

#: option (``Accelerator`` argument) -> (field of :class:`~anyaccel.envvars.WorkerSettings`, its
#: variable, whose ``default`` is the option's default). The one table of the precedence rule.
PRECEDENCE: Mapping[str, Tuple[str, envvars.Var]] = types.MappingProxyType({
    "cpu": ("use_cpu", envvars.USE_CPU),
    "mixed_precision": ("mixed_precision", envvars.MIXED_PRECISION),
    "gradient_accumulation_steps": ("gradient_accumulation_steps", envvars.GRADIENT_ACCUMULATION_STEPS),
    "strategy": ("strategy", envvars.STRATEGY),
    "fsdp_plugin": ("fsdp_config", envvars.FSDP_CONFIG),
    "dynamo_backend": ("dynamo_backend", envvars.DYNAMO_BACKEND),
    "hang_timeout": ("hang_timeout", envvars.HANG_TIMEOUT),
    "preemption_signals": ("preemption_signals", envvars.PREEMPTION_SIGNALS),
})


def _pick(option: str, argument: Any, launcher: envvars.WorkerSettings) -> Any:
    """``argument``, else the launcher's value for ``option``, else its default."""
    if argument is not None:
        return argument
    field, var = PRECEDENCE[option]
    told = getattr(launcher, field)
    return told if told is not None else var.default


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AcceleratorOptions:
    """What an ``Accelerator`` was asked for, after the precedence rule (see the module docstring).
    Read-only; validated when made."""

    device_placement: bool = True
    cpu: bool = envvars.USE_CPU.default
    mixed_precision: str = envvars.MIXED_PRECISION.default
    gradient_accumulation_steps: int = envvars.GRADIENT_ACCUMULATION_STEPS.default
    accumulation: GradientAccumulationPlugin = dataclasses.field(default_factory=GradientAccumulationPlugin)
    strategy: Optional[str] = envvars.STRATEGY.default  # None: the device's default (create_strategy)
    fsdp_plugin: Optional[FullyShardedDataParallelPlugin] = None
    deepspeed_plugin: Any = None  # anyaccel.utils.DeepSpeedPlugin (its module imports torch)
    dynamo_plugin: Optional[TorchDynamoPlugin] = None
    hang_timeout: float = envvars.HANG_TIMEOUT.default
    preemption_signals: Tuple[str, ...] = parse_signals(envvars.PREEMPTION_SIGNALS.default)
    handlers: Tuple[Any, ...] = ()  # kwargs handlers and the FSDP plugin, one per type (a tuple: it pickles)
    dataloader_config: DataLoaderConfiguration = dataclasses.field(default_factory=DataLoaderConfiguration)
    step_scheduler_with_optimizer: bool = True
    step_scheduler_per_process: bool = True

    def __post_init__(self) -> None:
        _check_hang_timeout(self.hang_timeout)
        if self.fsdp_plugin is not None and self.strategy != ParallelismConfig.strategy:  # nd shards with it too
            choose_strategy(self.strategy, FSDPOptions.strategy, options_source="fsdp_plugin")

    @property
    def process_group(self) -> Optional[InitProcessGroupKwargs]:
        """The ``InitProcessGroupKwargs`` handler, if one was given."""
        return self.handlers_by_type().get(InitProcessGroupKwargs)

    def handlers_by_type(self) -> Dict[type, Any]:
        """The handlers as ``{type: handler}`` (what strategies take)."""
        return {type(h): h for h in self.handlers}

    def handler(self, kind: type) -> Any:
        """The kwargs handler of type ``kind``, or its defaults."""
        found = self.handlers_by_type().get(kind)
        return found if found is not None else kind()


def resolve_options(launcher: envvars.WorkerSettings, *, device_placement: bool = True,
                    split_batches: Optional[bool] = None, mixed_precision: Optional[str] = None,
                    gradient_accumulation_steps: Optional[int] = None, cpu: Optional[bool] = None,
                    step_scheduler_with_optimizer: bool = True, kwargs_handlers: Optional[Sequence[Any]] = None,
                    even_batches: Optional[bool] = None,
                    strategy: Optional[str] = None, fsdp_plugin: Any = None, dynamo_backend: Optional[str] = None,
                    dynamo_plugin: Any = None, dispatch_batches: Optional[bool] = None,
                    dataloader_config: Optional[DataLoaderConfiguration] = None,
                    step_scheduler_per_process: bool = True, hang_timeout: Optional[float] = None,
                    preemption_signals: Any = None, gradient_accumulation_plugin: Any = None,
                    parallelism_config: Any = None, deepspeed_plugin: Any = None) -> AcceleratorOptions:
    """Apply the precedence rule to ``Accelerator``'s arguments (same names) and the launcher's
    settings (:func:`anyaccel.envvars.worker_settings`). Local and pure. Raises ``TypeError`` /
    ``ValueError`` / :class:`~anyaccel.errors.ConfigError` naming the bad value."""
    handlers = {type(h): h for h in (kwargs_handlers or [])}
    for h in handlers.values():
        if not isinstance(h, _HANDLER_TYPES):
            raise TypeError(f"kwargs_handlers accepts {', '.join(c.__name__ for c in _HANDLER_TYPES)}; "
                            f"got {type(h).__name__}")
    loaders = resolve_dataloader_config(dataloader_config, split_batches=split_batches, even_batches=even_batches,
                                        dispatch_batches=dispatch_batches)
    timeout = _check_hang_timeout(_pick("hang_timeout", hang_timeout, launcher))
    signals = parse_signals(_pick("preemption_signals", preemption_signals, launcher),
                            source="preemption_signals" if preemption_signals is not None
                            else envvars.PREEMPTION_SIGNALS.name)
    mixed = _precision.normalize(_pick("mixed_precision", mixed_precision, launcher))
    chosen = _pick("strategy", strategy, launcher)
    fsdp_plugin = _fsdp(fsdp_plugin, chosen, launcher)
    if fsdp_plugin is not None:  # FSDP options imply FSDP (over the launcher's strategy too): the registry's rule
        chosen = choose_strategy(strategy, FSDPOptions.strategy, options_source="fsdp_plugin")
        handlers[FullyShardedDataParallelPlugin] = fsdp_plugin
    parallelism_config = _parallelism(parallelism_config, strategy, chosen, fsdp_plugin, launcher)
    if parallelism_config is not None:  # a ParallelismConfig selects the 'nd' strategy
        if not isinstance(parallelism_config, ParallelismConfig):
            raise TypeError(f"parallelism_config must be anyaccel's ParallelismConfig (from anyaccel import "
                            f"ParallelismConfig); got {type(parallelism_config).__module__}."
                            f"{type(parallelism_config).__name__}")
        chosen = choose_strategy(strategy, ParallelismConfig.strategy, options_source="parallelism_config")
        handlers[ParallelismConfig] = parallelism_config
    if deepspeed_plugin is not None:  # DeepSpeed's options imply the deepspeed strategy
        _deepspeed_options(deepspeed_plugin)
        if fsdp_plugin is not None or parallelism_config is not None:
            raise ValueError("deepspeed_plugin and " + ("fsdp_plugin" if fsdp_plugin is not None else "parallelism_config")
                             + " both choose how the model is sharded; give one of them")
        chosen = choose_strategy(strategy, DeepSpeedOptions.strategy, options_source="deepspeed_plugin")
        handlers[type(deepspeed_plugin)] = deepspeed_plugin
        gradient_accumulation_steps = _deepspeed_accumulation(deepspeed_plugin, gradient_accumulation_steps)
    accumulation, steps = _accumulation(gradient_accumulation_plugin, gradient_accumulation_steps, launcher)
    return AcceleratorOptions(
        device_placement=device_placement, cpu=bool(_pick("cpu", cpu, launcher)), mixed_precision=mixed,
        gradient_accumulation_steps=steps, accumulation=accumulation, strategy=chosen, fsdp_plugin=fsdp_plugin,
        deepspeed_plugin=deepspeed_plugin,
        dynamo_plugin=_dynamo(dynamo_plugin, dynamo_backend, launcher), hang_timeout=timeout,
        preemption_signals=signals, handlers=tuple(handlers.values()), dataloader_config=loaders,
        step_scheduler_with_optimizer=step_scheduler_with_optimizer,
        step_scheduler_per_process=bool(step_scheduler_per_process))


def _fsdp(plugin: Any, strategy: Optional[str], launcher: envvars.WorkerSettings) -> Any:
    if plugin is None and launcher.fsdp_config is not None and strategy == FSDPOptions.strategy:
        from .plugins import fsdp_plugin_from_dict

        return fsdp_plugin_from_dict(launcher.fsdp_config, source=envvars.FSDP_CONFIG.name)
    if plugin is not None and not isinstance(plugin, FullyShardedDataParallelPlugin):
        raise TypeError(f"fsdp_plugin must be a FullyShardedDataParallelPlugin; got {type(plugin).__name__}")
    return plugin


def _parallelism(argument: Any, strategy: Optional[str], chosen: Optional[str], fsdp_plugin: Any,
                 launcher: envvars.WorkerSettings) -> Any:
    """The ``parallelism_config`` argument, else the launcher's N-D sizes
    (``PARALLELISM_CONFIG_*_SIZE``: the config file's ``parallelism_config`` or ``anyaccel launch
    --parallelism_config_*``; sizes not set are 1) as a :class:`ParallelismConfig`; else None.
    Its FSDP part is the ``fsdp_plugin`` argument's, else the launcher's ``fsdp_config``. A
    ``strategy`` argument other than ``nd`` wins over the launcher's sizes (a warning says they
    are not used)."""
    if argument is not None:
        return _with_fsdp_plugin(argument, fsdp_plugin)
    sizes = launcher.parallelism_sizes()
    if not (sizes or chosen == ParallelismConfig.strategy):
        return None
    if strategy not in (None, "auto", ParallelismConfig.strategy):
        if sizes:
            import warnings

            warnings.warn(f"the launcher's N-D parallelism sizes {sizes} (PARALLELISM_CONFIG_*_SIZE) are not used: "
                          f"Accelerator(strategy={strategy!r}) was given; drop it to train with them, or launch "
                          "without parallelism_config", stacklevel=4)
        return None
    if fsdp_plugin is None and launcher.fsdp_config is not None:
        from .plugins import fsdp_plugin_from_dict

        fsdp_plugin = fsdp_plugin_from_dict(launcher.fsdp_config, source=envvars.FSDP_CONFIG.name)
    fsdp = fsdp_plugin.to_options() if fsdp_plugin is not None else None
    return ParallelismConfig(dp_replicate_size=sizes.get("dp_replicate_size", 1),
                             dp_shard_size=sizes.get("dp_shard_size", 1), tp_size=sizes.get("tp_size", 1),
                             cp_size=sizes.get("cp_size", 1), fsdp=fsdp)


def _with_fsdp_plugin(config: Any, fsdp_plugin: Any) -> Any:
    """``config`` with the ``fsdp_plugin`` argument as its FSDP part (Accelerate's scripts pass
    both: the plugin configures how the data-parallel dimensions shard). A ``config.fsdp`` of its
    own that differs from the plugin's is a ``ValueError``: one of them would be ignored."""
    if fsdp_plugin is None or not isinstance(config, ParallelismConfig):
        return config
    options = fsdp_plugin.to_options()
    if config.fsdp not in (FSDPOptions(), options):
        raise ValueError(f"fsdp_plugin and parallelism_config.fsdp both configure how the data-parallel dimensions "
                         f"are sharded, differently ({options} vs {config.fsdp}); give one of them")
    return dataclasses.replace(config, fsdp=options)


def _deepspeed_options(plugin: Any) -> DeepSpeedOptions:
    """The strategy options of a ``deepspeed_plugin`` (``TypeError`` for anything else)."""
    convert = getattr(plugin, "to_options", None)
    options = convert() if callable(convert) else None
    if not isinstance(options, DeepSpeedOptions):
        raise TypeError(f"deepspeed_plugin must be a DeepSpeedPlugin (from anyaccel.utils import DeepSpeedPlugin); got "
                        f"{type(plugin).__module__}.{type(plugin).__name__}")
    return options


def _deepspeed_accumulation(plugin: Any, steps: Optional[int]) -> Optional[int]:
    """The accumulation steps: the argument, else a number the DeepSpeed config sets (Accelerate
    takes DeepSpeed's); both given and different is a ``ValueError``."""
    configured = _deepspeed_options(plugin).config.get("gradient_accumulation_steps", "auto")
    if configured in ("auto", None):
        return steps
    if steps is not None and int(steps) != int(configured):
        raise ValueError(f"gradient_accumulation_steps={steps} and the DeepSpeed config's gradient_accumulation_steps="
                         f"{configured} disagree; give one of them (or set the config's to \"auto\")")
    return int(configured)


def _dynamo(plugin: Any, backend: Optional[str], launcher: envvars.WorkerSettings) -> Any:
    if plugin is not None and backend is not None:
        raise ValueError("give dynamo_backend or dynamo_plugin, not both")
    if plugin is None and (backend or launcher.dynamo_backend):
        return TorchDynamoPlugin(backend=backend or launcher.dynamo_backend,
                                 mode=launcher.dynamo_mode if backend is None else None)
    return plugin


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
    if steps is None:  # the launcher's, else the default (a launcher's 0 means "not told"); an argument's 0 is refused
        steps = _pick("gradient_accumulation_steps", None, launcher) or envvars.GRADIENT_ACCUMULATION_STEPS.default
    return accumulation, steps


def _check_hang_timeout(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
        raise ValueError(f"hang_timeout={value!r} is not a number of seconds >= 0; give e.g. 300 (seconds a rank may "
                         "wait in one collective before the hang doctor reports), or 0 to turn the reports off")
    return float(value)


def precedence_table() -> str:
    """The precedence rule as a Markdown table (what ``docs/concepts/options.md`` shows)."""
    rows = ["| `Accelerator(...)` argument | launcher variable (config key / `anyaccel launch` flag) | default |",
            "|---|---|---|"]
    for option, (_, var) in PRECEDENCE.items():
        default = "none" if var.default is None else f"`{var.default}`"
        rows.append(f"| `{option}` | `{var.name}` | {default} |")
    return "\n".join(rows)
