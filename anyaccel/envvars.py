"""Every ``ANYACCEL_*`` environment variable, in one place, with one parser per type (and
Accelerate's ``PARALLELISM_CONFIG_*`` and ``ACCELERATE_DEEPSPEED_*`` settings, which anyaccel reads
under Accelerate's names).

Two kinds:

* **the launcher → worker contract**: what ``anyaccel launch`` and ``notebook_launcher`` tell a
  plain ``Accelerator()`` in every worker (the config file's or the flags' values). Its variables
  are *made* from the option table (:mod:`anyaccel.optionspec`: every row with ``worker=True``),
  as is :class:`WorkerSettings`; the launchers build the variables with :func:`worker_env`, the
  ``Accelerator`` reads them with :func:`worker_settings`, each value checked by its row.
  Nothing else writes or reads these names.
* **user switches**: variables a user (or a batch script) sets to change behaviour.

Booleans accept ``1/true/yes/on`` and ``0/false/no/off`` (any case; empty = unset) everywhere;
any other text raises :class:`~anyaccel.errors.ConfigError` naming the variable and the value,
instead of being read as "off" by one module and "on" by another. Values are read when asked
for, never at import time. Standard library only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import types
from typing import TYPE_CHECKING, Any, Dict, Iterator, Mapping, Optional, Tuple

from . import lazyclass, optionspec
from .errors import ConfigError

__all__ = [
    "Var",
    "ALL",
    "WorkerSettings",
    "worker_settings",
    "worker_env",
    "read",
    "parse_bool",
]


@lazyclass.dataclass(frozen=True)
class Var:
    """One variable: its name, type (``bool``/``int``/``float``/``str``), default and meaning."""

    name: str
    kind: str  # bool, int, float, str or json
    default: Any
    help: str
    worker: bool = False  # part of the launcher -> worker contract


# ---- the launcher -> worker contract ---------------------------------------------------------
_KINDS = {bool: "bool", int: "int", float: "float", str: "str", dict: "json"}

if TYPE_CHECKING:  # made on first use (_made): the option table and ~70 Var objects are not needed to import
    #: the variable of every option that reaches the worker, by option name (made from the option
    #: table, :data:`anyaccel.optionspec.OPTIONS`: a row with ``worker=True`` and a ``variable``)
    WORKER_VARS: Mapping[str, Var]
    _OPTION_OF: Dict[str, str]
    # the ones modules below the options read directly
    USE_CPU: Var
    DEBUG: Var
    PREEMPTION_SIGNALS: Var
    #: the ``ParallelismConfig`` fields the launcher sets (Accelerate's ``PARALLELISM_CONFIG_*``), by field
    PARALLELISM_FIELDS: Mapping[str, Var]
    #: the N-D sizes among them (``PARALLELISM_CONFIG_*_SIZE``; ``ParallelismConfig`` reads a size left None there)
    PARALLELISM_SIZES: Mapping[str, Var]
    # launcher plumbing (not options)
    AGENT_PID: Var
    LAUNCH_ID: Var
    REPLICA_GROUP: Var
    REPLICA_GROUPS: Var
    REPLICA_GROUP_RESTART: Var
    FAILURE_DIR: Var
    # user switches
    DISABLE_SLURM: Var
    DISABLE_MPI: Var
    BACKEND: Var
    PG_TIMEOUT: Var
    EXIT_TIMEOUT: Var
    RDZV_TIMEOUT: Var
    CONFIG_FILE: Var
    HOME: Var
    LOG_LEVEL: Var
    #: every variable: the launcher -> worker contract's first, then the others
    ALL: Tuple[Var, ...]


def _variables() -> Dict[str, Any]:
    """Every variable of this module, by its module attribute name (made once, by :func:`_made`)."""
    worker_vars: Mapping[str, Var] = types.MappingProxyType({
        row.name: Var(row.variable, _KINDS[row.type], row.default, row.help, worker=True)
        for row in optionspec.options_with("worker") if row.variable})
    fields = types.MappingProxyType({row.name: worker_vars[row.name]
                                     for row in optionspec.section_rows("parallelism_config")})
    others = dict(
        # launcher plumbing (not options)
        AGENT_PID=Var("ANYACCEL_AGENT_PID", "int", None, "pid of the launcher; a worker exits when it dies", worker=True),
        LAUNCH_ID=Var("ANYACCEL_LAUNCH_ID", "str", None,
                      "set by anyaccel launch: every process that carries it ends with the launch", worker=True),
        REPLICA_GROUP=Var("ANYACCEL_REPLICA_GROUP", "int", None,
                          "set by anyaccel launch --fault_tolerance: this worker's replica group (0, 1, ...)",
                          worker=True),
        REPLICA_GROUPS=Var("ANYACCEL_REPLICA_GROUPS", "int", None,
                           "set by anyaccel launch --fault_tolerance: how many replica groups the job has", worker=True),
        REPLICA_GROUP_RESTART=Var("ANYACCEL_REPLICA_GROUP_RESTART", "int", 0,
                                  "set by anyaccel launch --fault_tolerance: how often this group's launcher was "
                                  "started again", worker=True),
        FAILURE_DIR=Var("ANYACCEL_FAILURE_DIR", "str", None, "where failing workers leave their error report",
                        worker=True),
        # ---- user switches --------------------------------------------------------------------------
        DISABLE_SLURM=Var("ANYACCEL_DISABLE_SLURM", "bool", False, "ignore SLURM variables"),
        DISABLE_MPI=Var("ANYACCEL_DISABLE_MPI", "bool", False, "ignore MPI variables"),
        BACKEND=Var("ANYACCEL_BACKEND", "str", None, "force the torch.distributed backend (gloo, nccl)"),
        PG_TIMEOUT=Var("ANYACCEL_PG_TIMEOUT", "float", 1800.0, "seconds before a collective times out"),
        EXIT_TIMEOUT=Var("ANYACCEL_EXIT_TIMEOUT", "float", 30.0,
                         "seconds a process may take to end after its script returned, before it prints every "
                         "thread's stack and exits 70"),
        RDZV_TIMEOUT=Var("ANYACCEL_RDZV_TIMEOUT", "int", 900, "seconds the launcher waits for all machines"),
        CONFIG_FILE=Var("ANYACCEL_CONFIG_FILE", "str", None, "the configuration file to use"),
        HOME=Var("ANYACCEL_HOME", "str", None, "directory holding default_config.yaml"),
        LOG_LEVEL=Var("ANYACCEL_LOG_LEVEL", "str", None, "level of loggers made by get_logger"),
    )
    return dict(
        WORKER_VARS=worker_vars, _OPTION_OF={var.name: name for name, var in worker_vars.items()},
        USE_CPU=worker_vars["cpu"], DEBUG=worker_vars["debug"], PREEMPTION_SIGNALS=worker_vars["preemption_signals"],
        PARALLELISM_FIELDS=fields,
        PARALLELISM_SIZES=types.MappingProxyType({name: var for name, var in fields.items() if name.endswith("_size")}),
        **others, ALL=tuple(worker_vars.values()) + tuple(others.values()))


_LAZY = ("WORKER_VARS", "_OPTION_OF", "USE_CPU", "DEBUG", "PREEMPTION_SIGNALS", "PARALLELISM_FIELDS",
         "PARALLELISM_SIZES", "AGENT_PID", "LAUNCH_ID", "REPLICA_GROUP", "REPLICA_GROUPS", "REPLICA_GROUP_RESTART",
         "FAILURE_DIR", "DISABLE_SLURM", "DISABLE_MPI", "BACKEND", "PG_TIMEOUT", "EXIT_TIMEOUT", "RDZV_TIMEOUT",
         "CONFIG_FILE", "HOME", "LOG_LEVEL", "ALL")
_MADE: Dict[str, Any] = {}  # the variables by attribute name, once made (:func:`_made`)


def _made() -> Dict[str, Any]:
    """The variables (:func:`_variables`) by attribute name, made the first time one is asked for
    (then module attributes too). Local; once, under a lock."""
    if not _MADE:
        with _MAKING:
            if not _MADE:
                made = _variables()
                globals().update(made)
                _MADE.update(made)
    return _MADE


def _worker_vars() -> Mapping[str, Var]:
    vars_: Mapping[str, Var] = _made()["WORKER_VARS"]
    return vars_

_TRUE = optionspec.TRUE_WORDS
_FALSE = optionspec.FALSE_WORDS | {""}


def parse_bool(text: Optional[str], name: str = "value") -> bool:
    """``True`` for 1/true/yes/on, ``False`` for 0/false/no/off/empty/None (any case, spaces
    ignored); raises :class:`ConfigError` for anything else."""
    value = (text or "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={text!r} is not a yes/no value; use 1/0, true/false, yes/no or on/off")


def read(var: Var, env: Optional[Mapping[str, str]] = None) -> Any:
    """The value of ``var`` in ``env`` (``os.environ`` by default), parsed; its default when unset
    or empty. Raises :class:`ConfigError` naming the variable when the text does not parse."""
    env = os.environ if env is None else env
    text = env.get(var.name)
    if text is None or text.strip() == "":
        return var.default
    option_of = _made()["_OPTION_OF"]
    if var.name in option_of:  # an option's variable: parsed and checked by its row, as everywhere
        return optionspec.parse_text(optionspec.option(option_of[var.name]), text, var.name)
    if var.kind == "bool":
        return parse_bool(text, var.name)
    if var.kind == "json":
        import json

        try:
            return json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{var.name} is not valid JSON ({exc}): {text[:200]!r}") from None
    if var.kind in ("int", "float"):
        try:
            return int(text) if var.kind == "int" else float(text)
        except ValueError:
            raise ConfigError(f"{var.name}={text!r} is not a number ({var.help})") from None
    return text.strip()


class _WorkerSettings:
    """What the launcher decided for the worker, by option name: one field per option that
    reaches the worker (:data:`WORKER_VARS`, made from the option table); ``None`` means "not
    told" (the ``Accelerator`` argument or its default applies). Each value is checked when made,
    by its option's row (:func:`anyaccel.optionspec.check`), naming the variable. A frozen
    dataclass (``dataclasses.replace`` works)."""

    def __post_init__(self) -> None:
        for name, var in _worker_vars().items():
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, optionspec.check(optionspec.option(name), value, var.name))

    def told(self) -> Dict[str, Any]:
        """The settings the launcher passed (``{option: value}``)."""
        return {name: getattr(self, name) for name in _worker_vars() if getattr(self, name) is not None}

    def parallelism_sizes(self) -> Dict[str, int]:
        """The N-D sizes the launcher set (``{field: size}``; empty when it set none)."""
        return {f: getattr(self, f) for f in _made()["PARALLELISM_SIZES"] if getattr(self, f) is not None}

    def section_fields(self, section: str) -> Dict[str, Any]:
        """The settings of the option table's ``section`` (``"deepspeed_config"``) the launcher
        set, by option name (empty when it set none)."""
        return {row.name: getattr(self, row.name) for row in optionspec.section_rows(section)
                if row.name in _worker_vars() and getattr(self, row.name) is not None}

    def parallelism_fields(self) -> Dict[str, Any]:
        """Every ``ParallelismConfig`` field the launcher set (sizes and others), by field."""
        return {f: getattr(self, f) for f in _made()["PARALLELISM_FIELDS"] if getattr(self, f) is not None}

    if TYPE_CHECKING:  # the fields are made from the table below; their values are typed by their rows
        def __init__(self, **told: Any) -> None: ...

        def __getattr__(self, name: str) -> Any: ...


if TYPE_CHECKING:
    WorkerSettings = _WorkerSettings
else:
    def __getattr__(name: str) -> Any:
        """``WorkerSettings``, made on first use: a frozen dataclass of one field per worker option
        (~100), whose generated methods cost milliseconds to make — a script that never asks for
        it (the CLI's ``--help``, ``import anyaccel``) does not pay them. The variables too
        (``WORKER_VARS``, ``USE_CPU``, ..., ``ALL``: :func:`_made`), which read the option table."""
        if name == "WorkerSettings":
            return _worker_settings_class()
        if name in _LAZY:
            return _made()[name]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __dir__() -> list[str]:  # dir(), tab completion and autodoc list the variables before they are made too
        return sorted(set(globals()) | {"WorkerSettings", *_LAZY})


def _worker_settings_class() -> type:
    cls = globals().get("WorkerSettings")
    if cls is None:
        worker_vars = _worker_vars()
        with _MAKING:
            cls = globals().get("WorkerSettings")
            if cls is None:
                cls = dataclasses.make_dataclass(
                    "WorkerSettings", [(name, Optional[optionspec.option(name).type], None) for name in worker_vars],
                    bases=(_WorkerSettings,), frozen=True, kw_only=True)
                cls.__module__, cls.__doc__ = __name__, _WorkerSettings.__doc__
                globals()["WorkerSettings"] = cls  # from now on a plain module attribute
    return cls


_MAKING = threading.Lock()


def worker_settings(env: Optional[Mapping[str, str]] = None) -> WorkerSettings:
    """Read the launcher's decisions in a worker (local; called by every ``Accelerator``). Each
    variable is parsed and checked by its option's row; a bad one is a :class:`ConfigError`
    naming the variable."""
    env = os.environ if env is None else env
    values = {}
    for name, var in _worker_vars().items():
        text = env.get(var.name)
        if text is not None and text.strip() != "":
            values[name] = optionspec.parse_text(optionspec.option(name), text, var.name)
    return _worker_settings_class()(**values)  # type: ignore[no-any-return]


def worker_env(**settings: Any) -> Dict[str, str]:
    """The variables a launcher adds to its workers' environment for ``settings`` (option names:
    the keys of :data:`WORKER_VARS`). ``None`` and default values are left out, so a worker sees
    only what was decided."""
    worker_vars = _worker_vars()
    out: Dict[str, str] = {}
    for name, value in settings.items():
        var = worker_vars.get(name)
        if var is None:
            raise TypeError(f"worker_env() got an unknown setting {name!r}; known: {', '.join(worker_vars)}")
        if value is None or value == var.default:
            continue
        if var.kind == "bool":
            out[var.name] = "1" if value else "0"
        elif var.kind == "json":
            import json

            out[var.name] = json.dumps(value, sort_keys=True)
        else:
            out[var.name] = str(value)
    return out


def launcher_gone(env: Optional[Mapping[str, str]] = None) -> bool:
    """True when the launcher that started this worker (``ANYACCEL_AGENT_PID``) no longer exists;
    False when it does, when that cannot be told, or without a launcher. Local."""
    pid = (env if env is not None else os.environ).get(_made()["AGENT_PID"].name)
    if not (pid and pid.isdigit()):
        return False
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, PermissionError):  # gone, or its pid now belongs to another user
        return True
    except OSError:
        return False
    return False


@contextlib.contextmanager
def set_temporarily(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the ``with`` block, then restore each variable as it
    was (removed again where it was unset). This process only: for a launcher that passes variables
    to workers it starts or forks inside the block."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
