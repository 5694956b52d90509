"""The configuration schema: the keys of ``default_config.yaml`` are the rows of the option table
(:mod:`anyaccel.optionspec`) that have a key; :class:`Config` is *made* from them.

A key's type, default, allowed values and help are its row's, and each value is checked by its
row (:func:`anyaccel.optionspec.check`), so the file, the ``anyaccel launch`` flags, the
variables and ``Accelerator``'s arguments refuse a value with the same words. A :class:`Config` is
always valid: the constructor checks every value and the rules between keys, so
``dataclasses.replace`` cannot produce an impossible configuration either. An unknown key is an
error naming the nearest known key (a typo must not run a job with a setting nobody asked for);
only a file written by a newer anyaccel (a larger ``config_version``) may have keys this one
ignores, with a warning.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple

from .. import optionspec
from ..errors import ConfigError
from .strategy_keys import PARALLELISM_KEYS, effective_strategy, parallelism_sizes
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
    "unknown_keys_error",
    "known_keys",
]

CONFIG_VERSION = 1
#: the rows of the option table that are top-level keys of the file, in file order
KEY_ROWS: Tuple[optionspec.Option, ...] = optionspec.options_with("key")
_ROWS: Dict[str, optionspec.Option] = {row.key or row.name: row for row in KEY_ROWS}
_NAMES: Tuple[str, ...] = tuple(_ROWS)


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


def _runs_one_process(device: str) -> bool:
    """Whether the config device ``device`` runs one process only: it has no communication
    backend (:attr:`DeviceFacts.communication <anyaccel.devices.DeviceFacts>`, e.g. Apple MPS)."""
    from ..backends import config_device

    facts = config_device(device)
    return facts is not None and facts.communication is None


class ConfigWarning(UserWarning):
    """Something in a configuration file was ignored (e.g. a key written by a newer anyaccel)."""


class _Config:
    """Everything ``anyaccel launch`` needs to start a job; the YAML keys are the field names,
    made from the option table (each field's metadata holds its ``option`` row: read it with
    :func:`field_help`, :func:`field_choices`, :func:`field_allowed` and :func:`field_type`)."""

    def __post_init__(self) -> None:
        for name in _NAMES:
            object.__setattr__(self, name, check_value(name, getattr(self, name)))
        _check_rules(self, None)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: Optional[str] = None) -> "Config":
        """Build a config from a mapping (a parsed YAML file). Missing keys take their defaults;
        an unknown key is a :class:`ConfigError` naming the nearest known one (a file written by a
        newer anyaccel, with a larger ``config_version``: ignored with a :class:`ConfigWarning`);
        bad values raise :class:`ConfigError` naming ``source``, the key, the value and what is
        allowed. Types are strict: the string ``"2"`` is not an integer."""
        values = known_keys(d, source)
        try:
            return Config(**values)
        except ConfigError as exc:  # a rule between keys: say which file
            raise ConfigError(exc.message, source=source, key=exc.key) from None

    def to_dict(self) -> Dict[str, Any]:
        """All keys in schema order, ready for ``yaml.safe_dump``."""
        return {name: getattr(self, name) for name in _NAMES}

    def validate(self, source: Optional[str] = None) -> "Config":
        """Check every value and the rules between keys (the rank is below the number of machines,
        several machines need ``main_process_ip``, ``num_processes`` is a multiple of
        ``num_machines``, MPS runs one process, the device supports ``mixed_precision``, fp8
        settings only with ``mixed_precision: fp8``).
        Raises :class:`ConfigError` mentioning ``source``; returns ``self``."""
        for name in _NAMES:
            check_value(name, getattr(self, name), source)
        _check_rules(self, source)
        return self  # type: ignore[return-value]

    def resolve_num_processes(self, gpu_count: int) -> int:
        """The total number of processes: ``num_processes`` when set, otherwise (per machine) one
        per usable GPU when the device may be a GPU and ``gpu_count`` > 0, else 1."""
        if self.num_processes is not None:
            return int(self.num_processes)
        per_machine = 1
        if self.device in ("auto", "gpu") and gpu_count > 0:
            per_machine = gpu_count if self.gpu_ids == "all" else min(gpu_count, len(self.gpu_ids.split(",")))
        return per_machine * int(self.num_machines)

    if TYPE_CHECKING:  # the fields are made from the option table below; typed by their rows
        def __init__(self, **values: Any) -> None: ...

        def __getattr__(self, name: str) -> Any: ...


def _field(row: optionspec.Option) -> Tuple[str, Any, Any]:
    kind = Optional[row.type] if row.nullable else row.type
    return row.key or row.name, kind, dataclasses.field(default=row.default, metadata={"option": row})


if TYPE_CHECKING:
    Config = _Config
else:
    Config = dataclasses.make_dataclass("Config", [_field(row) for row in KEY_ROWS], bases=(_Config,), frozen=True)
    Config.__module__, Config.__doc__ = __name__, _Config.__doc__


def known_keys(d: Any, source: Optional[str] = None) -> Dict[str, Any]:
    """The keys of a file's mapping ``d`` (values not yet checked): a key that is not one of the
    schema's is a :class:`ConfigError` naming the nearest known key, unless the file was written
    by a newer anyaccel (a larger ``config_version``: ignored with a :class:`ConfigWarning`)."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"expected a mapping of `key: value` lines, found {optionspec._describe(d)}; known keys: "
                          f"{', '.join(_NAMES)}", source=source)
    version = check_value("config_version", d.get("config_version", CONFIG_VERSION), source)
    unknown = [str(k) for k in d if k not in _ROWS]
    if unknown and version <= CONFIG_VERSION:
        raise unknown_keys_error(unknown, source)
    if version > CONFIG_VERSION:
        warnings.warn(f"{source or 'config'}: config_version {version} is newer than this anyaccel understands "
                      f"({CONFIG_VERSION}); reading it anyway"
                      + (f", without the key(s) {', '.join(unknown)}" if unknown else ""), ConfigWarning, stacklevel=3)
    return {k: v for k, v in d.items() if k in _ROWS}


def unknown_keys_error(unknown: Any, source: Optional[str], known: Any = None) -> ConfigError:
    """The error for keys a file must not have: each named, with the nearest known key."""
    known = tuple(known or _NAMES)
    parts = []
    for key in unknown:
        near = optionspec.close_match(key, known)
        parts.append(f"'{key}'" + (f" (did you mean '{near}'?)" if near else ""))
    return ConfigError(f"unknown key{'s' if len(parts) > 1 else ''} {', '.join(parts)}; known keys: "
                       f"{', '.join(known)}", source=source, key=str(next(iter(unknown))))


def _row(name: str) -> optionspec.Option:
    try:
        return _ROWS[name]
    except KeyError:
        raise KeyError(f"no configuration key {name!r}; known keys: {', '.join(_NAMES)}") from None


def field_choices(name: str) -> Optional[Tuple[str, ...]]:
    """The allowed values of key ``name``, or None when it is not a fixed set (``strategy``'s
    and ``device``'s come from their registries, read now)."""
    choices = optionspec.choices_of(_row(name))
    return None if choices is None else tuple(choices)


def field_help(name: str) -> str:
    """One-line help text of key ``name`` (``strategy``'s lists the registered strategies)."""
    return optionspec.help_text(_row(name))


def field_type(name: str) -> type:
    """The Python type of key ``name``'s value (``int`` for ``Optional[int]``)."""
    return _row(name).type


def field_allowed(name: str) -> str:
    """Human-readable description of what key ``name`` accepts, as used in error messages."""
    return optionspec.allowed(_row(name), with_null=True)


def mixed_precision_choices(device: str) -> Tuple[str, ...]:
    """The ``mixed_precision`` values that ``device`` supports, most useful first."""
    return _precisions_by_device()[device]


def check_value(name: str, value: Any, source: Optional[str] = None) -> Any:
    """Check one value of key ``name`` and return it normalised (``"FP16"`` -> ``"fp16"``, YAML's
    ``no`` read as False -> ``"no"``, ``gpu_ids: 0`` -> ``"0"``, an int for a float key -> float):
    its row's check (:func:`anyaccel.optionspec.check`). Raises :class:`ConfigError` naming
    ``source``, the key, the value and what is allowed."""
    row = _row(name)
    return optionspec.check(row, value, row.where_key, source)


def _check_rules(cfg: Any, source: Optional[str]) -> None:
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
        (bool(strategy_problem), next((k for k in ("parallelism_config", "deepspeed_config")
                                       if k in strategy_problem), "fsdp_config"), strategy_problem),
        (bool(parallelism_problem), "parallelism_config", f"key 'parallelism_config': {parallelism_problem}"),
        (cfg.mixed_precision not in mp_allowed, "mixed_precision",
         f"key 'mixed_precision' is {cfg.mixed_precision}, which device {cfg.device} does not support; "
         f"allowed: {', '.join(mp_allowed)}"),
        (bool(cfg.fp8_config) and cfg.mixed_precision != "fp8", "fp8_config",
         f"key 'fp8_config' (or an --fp8_* flag) is set but mixed_precision is {cfg.mixed_precision}; allowed: "
         "mixed_precision: fp8 (or remove the fp8 settings)"),
    ]  # fmt: skip
    for broken, key, message in rules:
        if broken:
            raise ConfigError(message, source=source, key=key)
