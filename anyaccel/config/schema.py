"""The configuration schema: every key of ``default_config.yaml``, its type, allowed values,
default and help text, defined once in :class:`Config`.

The wizard, the file loader, ``anyaccel launch`` and ``Accelerator`` all read the field metadata
(``help``, ``choices``, ``min``, ``max``) instead of repeating it. A :class:`Config` is always valid:
the constructor checks every value and the rules between keys, so ``dataclasses.replace`` cannot
produce an impossible configuration either.
"""

from __future__ import annotations

import dataclasses
import re
import typing
import warnings
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

from .. import envvars  # the one home of the defaults the launcher passes on to workers
from ..errors import ConfigError
from ..strategies import StrategyChoices, describe_strategies
from .strategy_keys import ALLOWED as PARALLELISM_ALLOWED
from .strategy_keys import PARALLELISM_KEYS, check_parallelism, effective_strategy, parallelism_sizes
from .strategy_keys import parallelism_problem as parallelism_problem_of

__all__ = [
    "CONFIG_VERSION",
    "Config",
    "ConfigError",
    "ConfigWarning",
    "check_value",
    "field_allowed",
    "field_choices",
    "field_help",
    "field_type",
    "effective_strategy",
    "mixed_precision_choices",
    "PARALLELISM_KEYS",
    "parallelism_sizes",
]

CONFIG_VERSION = 1


def _precisions_by_device() -> Dict[str, Tuple[str, ...]]:
    """What each config device can do with autocast, from the device facts of the backend registry
    (:func:`anyaccel.backends.precisions_by_config_name`). "auto" accepts everything; the device
    found at launch decides."""
    from ..backends import precisions_by_config_name

    by_device = precisions_by_config_name()
    everything = {p for choices in by_device.values() for p in choices}
    auto = next((c for c in by_device.values() if set(c) == everything),
                tuple(dict.fromkeys(p for c in by_device.values() for p in c)))
    return {"auto": auto, **by_device}


class _DeviceChoices:
    """``"auto"`` and the config names of the registered devices
    (:func:`anyaccel.backends.config_device_names`), as a lazy container: the device registry
    (which imports torch) is read when the choices are asked, not when this module is imported."""

    def _names(self) -> Tuple[str, ...]:
        from ..backends import config_device_names

        return ("auto",) + config_device_names()

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __repr__(self) -> str:
        return f"_DeviceChoices({', '.join(self)})"


def _runs_one_process(device: str) -> bool:
    """Whether the config device ``device`` runs one process only: it has no communication
    backend (:attr:`DeviceFacts.communication <anyaccel.devices.DeviceFacts>`, e.g. Apple MPS)."""
    from ..backends import config_device

    facts = config_device(device)
    return facts is not None and facts.communication is None


_GPU_IDS = re.compile(r"^\d+(,\d+)*$")


class ConfigWarning(UserWarning):
    """Something in a configuration file was ignored (e.g. a key written by a newer anyaccel)."""


def _field(default: Any, help: str, **meta: Any) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, **meta})


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything ``anyaccel launch`` needs to start a job; the YAML keys are the field names.

    Each field's metadata holds ``help`` and, where they apply, ``choices``, ``min``, ``max`` and
    ``min_exclusive``; read them with :func:`field_help`, :func:`field_choices`,
    :func:`field_allowed` and :func:`field_type` rather than repeating them elsewhere."""

    config_version: int = _field(CONFIG_VERSION, "Version of this file's format.", min=1)
    compute_environment: str = _field(
        "this_machine",
        "Run on this machine only, or on several machines that start the job together.",
        choices=("this_machine", "several_machines"),
    )
    device: str = _field(
        "auto",
        "Device kind; auto picks GPUs when visible, else Apple MPS, else the CPU.",
        choices=_DeviceChoices(),  # read from the device registry when asked
    )
    num_machines: int = _field(1, "Number of machines taking part in the job.", min=1)
    machine_rank: int = _field(0, "Rank of this machine, 0 for the main machine.", min=0)
    main_process_ip: Optional[str] = _field(None, "Address of the machine with rank 0 (needed for several machines).")
    main_process_port: Optional[int] = _field(None, "Port on the main machine; null means 29500.", min=1, max=65535)
    num_processes: Optional[int] = _field(
        None, "Total processes over all machines; null means one per visible GPU, else 1.", min=1
    )
    gpu_ids: str = _field("all", "GPUs to use on this machine: all, or comma-separated ids such as 0,1.")
    mixed_precision: str = _field(
        envvars.MIXED_PRECISION.default, "Autocast dtype for the forward pass; no keeps everything in fp32.", choices=("no", "fp16", "bf16")
    )
    gradient_accumulation_steps: int = _field(
        envvars.GRADIENT_ACCUMULATION_STEPS.default, "Batches whose gradients are summed before each optimizer step.", min=1
    )
    rdzv_backend: str = _field(
        "static", "Rendezvous: static (fixed ranks) or c10d (elastic).", choices=("static", "c10d")
    )
    strategy: str = _field(
        "auto", lambda: f"How models are wrapped across processes: auto (DDP for several), or a registered strategy: "
                        f"{describe_strategies()}.",
        choices=StrategyChoices(),  # read from the strategy registry (entry points included) when asked
    )
    fsdp_config: Optional[dict] = _field(
        None, "FSDP2 options (FullyShardedDataParallelPlugin fields, Accelerate's fsdp_* names accepted)."
    )
    parallelism_config: Optional[dict] = _field(
        None, "N-D parallelism sizes (Accelerate's keys parallelism_config_dp_replicate_size, _dp_shard_size, "
              "_tp_size, _cp_size; missing ones are 1); selects the nd strategy.",
    )
    dynamo_backend: str = _field(
        "no", "torch.compile backend for prepared models; no leaves them eager.",
        choices=("no", "inductor", "eager", "aot_eager", "cudagraphs", "openxla"),
    )
    dynamo_mode: Optional[str] = _field(
        None, "torch.compile mode (null: torch's default).",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    )
    max_restarts: int = _field(0, "How often torchrun restarts the job after a failure.", min=0)
    hang_timeout: float = _field(
        envvars.HANG_TIMEOUT.default, "Seconds a rank may wait in a collective before the hang doctor reports where every rank is; 0: off.",
        min=0.0,
    )
    preemption_signals: str = _field(
        envvars.PREEMPTION_SIGNALS.default, "Signals that make every rank save a checkpoint at the next step and exit 75; none: off."
    )
    preemption_grace: float = _field(
        120.0, "Seconds the launcher gives its workers to save that checkpoint before it kills them.",
        min_exclusive=0.0,
    )
    monitor_interval: float = _field(0.1, "Seconds between torchrun's checks of the workers.", min_exclusive=0.0)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, check_value(f.name, getattr(self, f.name)))
        _check_rules(self, None)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: Optional[str] = None) -> "Config":
        """Build a config from a mapping (a parsed YAML file). Missing keys take their defaults;
        unknown keys are ignored with a :class:`ConfigWarning`; bad values raise :class:`ConfigError`
        naming ``source``, the key, the value and what is allowed. Types are strict: the string
        ``"2"`` is not an integer."""
        if not isinstance(d, Mapping):
            raise ConfigError(
                f"expected a mapping of `key: value` lines, found {_describe(d)}; known keys: {', '.join(_NAMES)}",
                source=source,
            )
        unknown = [str(k) for k in d if k not in _NAMES]
        if unknown:
            where = f"{source}: " if source else ""
            warnings.warn(
                f"{where}ignoring unknown key(s) {', '.join(unknown)} (written by a newer anyaccel, or a typo?); "
                f"known keys: {', '.join(_NAMES)}",
                ConfigWarning,
                stacklevel=2,
            )
        values = {k: check_value(k, v, source) for k, v in d.items() if k in _NAMES}
        version = values.get("config_version", CONFIG_VERSION)
        if version > CONFIG_VERSION:
            warnings.warn(
                f"{source or 'config'}: config_version {version} is newer than this anyaccel understands "
                f"({CONFIG_VERSION}); reading it anyway",
                ConfigWarning,
                stacklevel=2,
            )
        try:
            return cls(**values)
        except ConfigError as exc:  # a rule between keys: say which file
            raise ConfigError(exc.message, source=source, key=exc.key) from None

    def to_dict(self) -> Dict[str, Any]:
        """All keys in schema order, ready for ``yaml.safe_dump``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def validate(self, source: Optional[str] = None) -> "Config":
        """Check every value and the rules between keys (the rank is below the number of machines,
        several machines need ``main_process_ip``, ``num_processes`` is a multiple of
        ``num_machines``, MPS runs one process, the device supports ``mixed_precision``).
        Raises :class:`ConfigError` mentioning ``source``; returns ``self``."""
        for f in dataclasses.fields(self):
            check_value(f.name, getattr(self, f.name), source)
        _check_rules(self, source)
        return self

    def resolve_num_processes(self, gpu_count: int) -> int:
        """The total number of processes: ``num_processes`` when set, otherwise (per machine) one
        per usable GPU when the device may be a GPU and ``gpu_count`` > 0, else 1."""
        if self.num_processes is not None:
            return self.num_processes
        per_machine = 1
        if self.device in ("auto", "gpu") and gpu_count > 0:
            per_machine = gpu_count if self.gpu_ids == "all" else min(gpu_count, len(self.gpu_ids.split(",")))
        return per_machine * self.num_machines


_NAMES: Tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Config))
_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
# The Python type of each key, read from the annotations (Optional[int] -> int).
_TYPES = {
    name: next(a for a in typing.get_args(hint) if a is not type(None)) if typing.get_args(hint) else hint
    for name, hint in typing.get_type_hints(Config).items()
}


def field_choices(name: str) -> Optional[Tuple[str, ...]]:
    """The allowed values of key ``name``, or None when it is not a fixed set (``strategy``'s
    come from the strategy registry)."""
    choices = _field_of(name).metadata.get("choices")
    return None if choices is None else tuple(choices)


def field_help(name: str) -> str:
    """One-line help text of key ``name``."""
    text = _field_of(name).metadata["help"]
    return text() if callable(text) else text


def field_type(name: str) -> type:
    """The Python type of key ``name``'s value (``int`` for ``Optional[int]``)."""
    _field_of(name)
    return _TYPES[name]


def field_allowed(name: str) -> str:
    """Human-readable description of what key ``name`` accepts, as used in error messages."""
    f = _field_of(name)
    meta, kind = f.metadata, _TYPES[name]
    if "choices" in meta:
        text = "one of " + ", ".join(meta["choices"])
    elif name == "gpu_ids":
        text = "all, or comma-separated GPU ids such as 0,1"
    elif kind is int:
        lo, hi = meta.get("min"), meta.get("max")
        text = f"an integer from {lo} to {hi}" if hi is not None else f"an integer >= {lo}"
    elif kind is float:
        text = f"a number > {meta['min_exclusive']:g}" if "min_exclusive" in meta else f"a number >= {meta['min']:g}"
    elif name == "preemption_signals":
        text = "signal names such as SIGTERM,SIGUSR1 (SIGUSR2, SIGINT, SIGHUP, SIGCONT too), or none"
    elif name == "parallelism_config":
        text = PARALLELISM_ALLOWED
    elif kind is dict:
        text = "a mapping of FullyShardedDataParallelPlugin settings such as auto_wrap_policy: transformer_based_wrap"
    else:
        text = "a host name or IP address"
    if f.default is None:
        text += " (or null)"
    return text


def mixed_precision_choices(device: str) -> Tuple[str, ...]:
    """The ``mixed_precision`` values that ``device`` supports, most useful first."""
    return _precisions_by_device()[device]


def check_value(name: str, value: Any, source: Optional[str] = None) -> Any:
    """Check one value of key ``name`` and return it normalised (``"FP16"`` -> ``"fp16"``, YAML's
    ``no`` read as False -> ``"no"``, ``gpu_ids: 0`` -> ``"0"``, an int for a float key -> float).
    Raises :class:`ConfigError` naming ``source``, the key, the value and what is allowed."""
    f = _field_of(name)
    meta, kind = f.metadata, _TYPES[name]

    def bad(problem: str = "") -> ConfigError:
        return ConfigError(
            f"key '{name}' has the value {value!r}{problem}; allowed: {field_allowed(name)}", source=source, key=name
        )

    if value is None:
        if f.default is None:
            return None
        raise bad()
    if name == "gpu_ids":
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        elif isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            value = ",".join(str(v) for v in value)
        if not isinstance(value, str):
            raise bad(f", which is {_describe(value)}")
        text = value.replace(" ", "").lower()
        if text != "all" and not _GPU_IDS.match(text):
            raise bad()
        if text != "all" and len(set(text.split(","))) != len(text.split(",")):
            raise bad(" (an id appears twice)")
        return text
    if name == "preemption_signals":
        from ..preemption import parse_signals

        if not isinstance(value, (str, list, tuple)):
            raise bad(f", which is {_describe(value)}")
        try:
            return ",".join(parse_signals(value, source=name)) or "none"
        except ConfigError as exc:
            raise ConfigError(str(exc), source=source, key=name) from None
    if name == "parallelism_config":
        return check_parallelism(value, source)
    if kind is dict:
        if not isinstance(value, Mapping):
            raise bad(f", which is {_describe(value)}")
        from ..plugins import fsdp_plugin_from_dict

        try:
            fsdp_plugin_from_dict(value, source=name)
        except ValueError as exc:
            raise ConfigError(str(exc), source=source, key=name) from None
        return dict(value)
    if kind is str:
        if value is False and "no" in meta.get("choices", ()):
            return "no"  # YAML 1.1 reads a bare `no` as False
        if not isinstance(value, str):
            raise bad(f", which is {_describe(value)}")
        if "choices" in meta:
            if value.strip().lower() not in meta["choices"]:
                raise bad()
            return value.strip().lower()
        if not value.strip() or any(c.isspace() for c in value.strip()):
            raise bad()
        return value.strip()
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise bad(f", which is {_describe(value)}, not {'an integer' if kind is int else 'a number'}")
    if ("min" in meta and value < meta["min"]) or ("max" in meta and value > meta["max"]):
        raise bad()
    if "min_exclusive" in meta and value <= meta["min_exclusive"]:
        raise bad()
    return value


def _check_rules(cfg: Config, source: Optional[str]) -> None:
    """The rules between keys; the first one broken raises ConfigError."""
    n, nproc, mp_allowed = cfg.num_machines, cfg.num_processes, mixed_precision_choices(cfg.device)
    try:  # the one rule for options that select their strategy (fsdp_config: FSDP's)
        effective_strategy(cfg)
        strategy_problem = ""
    except ValueError as exc:
        strategy_problem = str(exc)
    parallelism_problem = parallelism_problem_of(cfg)
    rules = [
        (cfg.machine_rank >= n, "machine_rank",
         f"key 'machine_rank' is {cfg.machine_rank} but num_machines is {n}; allowed: 0 to {n - 1}"),
        (cfg.compute_environment == "this_machine" and n != 1, "compute_environment",
         f"key 'compute_environment' is this_machine but num_machines is {n}; "
         "allowed: several_machines (or num_machines: 1)"),
        (cfg.compute_environment == "several_machines" and n < 2, "num_machines",
         "key 'num_machines' is 1 but compute_environment is several_machines; "
         "allowed: num_machines >= 2 (or compute_environment: this_machine)"),
        (n > 1 and not cfg.main_process_ip, "main_process_ip",
         f"key 'main_process_ip' is missing but num_machines is {n}; "
         "allowed: the host name or IP address of the machine with rank 0"),
        (nproc is not None and nproc % n != 0, "num_processes",
         f"key 'num_processes' is {nproc}, the total over all machines, which does not divide evenly over "
         f"num_machines {n}; allowed: a multiple of {n}"),
        (nproc not in (None, 1) and _runs_one_process(cfg.device), "num_processes",
         f"key 'num_processes' is {nproc} but device {cfg.device} runs one process; allowed: 1 (or null)"),
        (bool(strategy_problem), "parallelism_config" if "parallelism_config" in strategy_problem else "fsdp_config",
         strategy_problem),
        (bool(parallelism_problem), "parallelism_config", f"key 'parallelism_config': {parallelism_problem}"),
        (cfg.mixed_precision not in mp_allowed, "mixed_precision",
         f"key 'mixed_precision' is {cfg.mixed_precision}, which device {cfg.device} does not support; "
         f"allowed: {', '.join(mp_allowed)}"),
    ]  # fmt: skip
    for broken, key, message in rules:
        if broken:
            raise ConfigError(message, source=source, key=key)


def _field_of(name: str) -> dataclasses.Field:
    try:
        return _FIELDS[name]
    except KeyError:
        raise KeyError(f"no configuration key {name!r}; known keys: {', '.join(_NAMES)}") from None


def _describe(value: Any) -> str:
    names = {
        dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer", float: "a number",
        type(None): "nothing",
    }
    return names.get(type(value), f"a {type(value).__name__}")
