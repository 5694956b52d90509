"""The ``Accelerator``'s options, resolved once: :class:`AcceleratorOptions` and the precedence rule.

Every option follows one precedence rule, applied by one function (:func:`pick`):

    the argument given to ``Accelerator(...)``  >  what the launcher passed (config file or
    ``anyaccel launch`` flag, through :mod:`anyaccel.envvars`)  >  the default

Which options the launcher can set, their variables and defaults are the option table's
(:mod:`anyaccel.optionspec`: every row with an ``argument`` and a ``variable``); :data:`PRECEDENCE`
is made from it, and ``docs/concepts/options.md`` shows it as a table (:func:`precedence_table`;
a test keeps the two equal). Each value is checked where it enters: an argument by its row's
check in :func:`pick` (the message names the argument); the launcher's values when they are read
(:func:`anyaccel.envvars.worker_settings`, the message names the variable).

``Accelerator(...)`` takes Accelerate's arguments (``kwargs_handlers``, ``fsdp_plugin``,
``deepspeed_plugin``, ``gradient_accumulation_plugin``, ``dynamo_plugin``, ...): they are converted
into these options by :func:`anyaccel.compat.arguments.resolve_options`, in the Accelerate
compatibility layer, which this module never imports. What the core reads is typed here by the
core: the strategy's :class:`~anyaccel.strategies.options.StrategyOptions` (a strategy's options
travel typed: ``strategy=`` takes a name or an options object), the process group's
:class:`~anyaccel.process_group.ProcessGroupOptions`, the compile settings
(:class:`~anyaccel.strategies.compile.CompileOptions`), how gradients accumulate
(:class:`~anyaccel.accumulation.AccumulationOptions`), how to train in fp8
(:class:`~anyaccel.precision_fp8.Fp8Options`). The few fields typed ``Any`` hold
Accelerate's objects *as given*, for the Accelerate-compatible façade only
(``accelerator.state.fsdp_plugin``, the ``GradScalerKwargs``/``AutocastKwargs``/``ProfileKwargs``
handlers); strategies find the handler that configures them by its ``to_options()``.

The result is a frozen object, validated in ``__post_init__``: what the ``Accelerator`` and its
:class:`~anyaccel.runtime.Runtime` are built from; nothing reads the arguments again afterwards.
The launcher's variables are read when the options are resolved, and in two more places on
purpose: a ``ParallelismConfig`` built in the script takes ``PARALLELISM_CONFIG_*`` for the fields
it left None, and ``PartialState()`` (no ``Accelerator``) reads ``cpu`` and ``mixed_precision``.
Local; pure (the launcher's settings are an argument).
"""

from __future__ import annotations

import dataclasses
import types
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple

from . import envvars, lazyclass, optionspec
from .training.accumulation import AccumulationOptions
from .data import DataLoaderConfiguration
from .process.preemption import parse_signals
from .process.process_group import ProcessGroupOptions

if TYPE_CHECKING:  # loaded by whoever builds them (the import budget)
    from .strategies.compile import CompileOptions
    from .strategies.options import StrategyOptions
    from .training.precision_fp8 import Fp8Options

if TYPE_CHECKING:  # the fp8 module is imported under mixed_precision="fp8" only (start-up)
    from .training.precision_fp8 import Fp8Options

__all__ = ["AcceleratorOptions", "PRECEDENCE", "pick", "precedence_table"]

#: ``Accelerator`` argument -> the option rows the launcher fills it from (the N-D sizes all fill
#: ``parallelism_config``). Made from the option table; the one table of the precedence rule.
PRECEDENCE: Mapping[str, Tuple[optionspec.Option, ...]] = types.MappingProxyType({
    argument: tuple(row for row in optionspec.options_with("argument") if row.argument == argument)
    for argument in dict.fromkeys(row.argument for row in optionspec.options_with("argument") if row.argument)})

_ROW = optionspec.option


def pick(name: str, argument: Any, launcher: envvars.WorkerSettings) -> Any:
    """The precedence rule for option ``name``: ``argument`` (checked; the message names it),
    else the launcher's value (checked when read), else the option's default. Local, pure."""
    row = _ROW(name)
    if argument is not None:
        return optionspec.check(row, argument, row.argument or name)
    told = getattr(launcher, name)
    return told if told is not None else row.default


@lazyclass.dataclass(frozen=True, kw_only=True)
class AcceleratorOptions:
    """What an ``Accelerator`` was asked for, after the precedence rule (see the module docstring).
    Read-only; validated when made."""

    device_placement: bool = True
    cpu: bool = _ROW("cpu").default
    mixed_precision: str = _ROW("mixed_precision").default
    gradient_accumulation_steps: int = _ROW("gradient_accumulation_steps").default
    accumulation: AccumulationOptions = dataclasses.field(default_factory=AccumulationOptions)
    strategy: Optional[str] = None  # None: the device's default (create_strategy)
    strategy_options: Optional[StrategyOptions] = None  # the strategy's typed options (None: its defaults)
    process_group: ProcessGroupOptions = dataclasses.field(default_factory=ProcessGroupOptions)
    compile_options: Optional[CompileOptions] = None  # None: models are not compiled
    fp8: Optional[Fp8Options] = None  # how to train in fp8 under mixed_precision="fp8" (None: the defaults)
    hang_timeout: float = _ROW("hang_timeout").default
    preemption_signals: Tuple[str, ...] = parse_signals(_ROW("preemption_signals").default)
    fault_tolerance: str = _ROW("fault_tolerance").default  # off, or a Lighthouse's HOST:PORT (anyaccel.fault_tolerance)
    fault_tolerance_min_replicas: int = _ROW("fault_tolerance_min_replicas").default
    dataloader_config: DataLoaderConfiguration = dataclasses.field(default_factory=DataLoaderConfiguration)
    #: what a ``DataLoaderConfiguration`` whose ``whole_last_batches`` is None gets (the launcher's, else False)
    whole_last_batches: bool = _ROW("whole_last_batches").default
    step_scheduler_with_optimizer: bool = True
    step_scheduler_per_process: bool = True
    # As given, for the Accelerate-compatible façade (accelerator.state.*_plugin,
    # accelerator.gradient_accumulation_plugin); what they configure is in the typed fields above.
    handlers: Tuple[Any, ...] = ()  # Accelerate's kwargs handlers, one per type (a tuple: it pickles)
    fsdp_plugin: Any = None
    deepspeed_plugin: Any = None
    dynamo_plugin: Any = None
    gradient_accumulation_plugin: Any = None

    def __post_init__(self) -> None:
        optionspec.check(_ROW("hang_timeout"), self.hang_timeout, "hang_timeout")
        optionspec.check(_ROW("fault_tolerance"), self.fault_tolerance, "fault_tolerance")
        if self.fp8 is not None and self.mixed_precision != "fp8":
            raise ValueError(f"fp8 options were given but mixed_precision={self.mixed_precision!r}; an fp8 recipe needs "
                             "mixed_precision='fp8'")
        if self.strategy_options is not None and self.strategy != self.strategy_options.strategy:
            raise ValueError(f"strategy={self.strategy!r} but strategy_options configure "
                             f"{self.strategy_options.strategy!r}")

    def handlers_by_type(self) -> Dict[type, Any]:
        """The kwargs handlers as ``{type: handler}``."""
        return {type(h): h for h in self.handlers}

    def handler(self, kind: type) -> Any:
        """The kwargs handler of type ``kind``, or its defaults."""
        found = self.handlers_by_type().get(kind)
        return found if found is not None else kind()


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
