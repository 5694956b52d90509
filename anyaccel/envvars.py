"""Every ``ANYACCEL_*`` environment variable, in one place, with one parser per type (and
Accelerate's ``PARALLELISM_CONFIG_*_SIZE``, which anyaccel reads under Accelerate's names).

Two kinds:

* **the launcher → worker contract**: what ``anyaccel launch`` and ``notebook_launcher`` tell a
  plain ``Accelerator()`` in every worker (the config file's or the flags' values). The launchers
  build it with :func:`worker_env`; the ``Accelerator`` reads it with :func:`worker_settings`.
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
from typing import Any, Dict, Iterator, Mapping, Optional

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


@dataclasses.dataclass(frozen=True)
class Var:
    """One variable: its name, type (``bool``/``int``/``float``/``str``), default and meaning."""

    name: str
    kind: str  # bool, int, float, str or json
    default: Any
    help: str
    worker: bool = False  # part of the launcher -> worker contract


# ---- the launcher -> worker contract ---------------------------------------------------------
USE_CPU = Var("ANYACCEL_USE_CPU", "bool", False, "run on the CPU even when GPUs are visible", worker=True)
MIXED_PRECISION = Var("ANYACCEL_MIXED_PRECISION", "str", "no", "mixed precision: no, fp16 or bf16", worker=True)
GRADIENT_ACCUMULATION_STEPS = Var("ANYACCEL_GRADIENT_ACCUMULATION_STEPS", "int", 1,
                                  "micro-batches per optimizer step", worker=True)
DEBUG = Var("ANYACCEL_DEBUG", "bool", False, "show tracebacks and torch's launcher logs", worker=True)
STRATEGY = Var("ANYACCEL_STRATEGY", "str", None, "how models are wrapped: ddp, fsdp, single", worker=True)
FSDP_CONFIG = Var("ANYACCEL_FSDP_CONFIG", "json", None, "FSDP2 options (the config file's fsdp_config, as JSON)",
                  worker=True)
DYNAMO_BACKEND = Var("ANYACCEL_DYNAMO_BACKEND", "str", None, "torch.compile backend for prepared models", worker=True)
DYNAMO_MODE = Var("ANYACCEL_DYNAMO_MODE", "str", None, "torch.compile mode", worker=True)
HANG_TIMEOUT = Var("ANYACCEL_HANG_TIMEOUT", "float", 300.0,
                   "seconds in one collective before the hang doctor reports where every rank is (0: off)", worker=True)
PREEMPTION_SIGNALS = Var("ANYACCEL_PREEMPTION_SIGNALS", "str", "SIGTERM,SIGUSR1",
                         "signals that make every rank checkpoint at the next step and exit 75 (none: off)", worker=True)
AGENT_PID = Var("ANYACCEL_AGENT_PID", "int", None, "pid of the launcher; a worker exits when it dies", worker=True)
LAUNCH_ID = Var("ANYACCEL_LAUNCH_ID", "str", None,
                "set by anyaccel launch: every process that carries it ends with the launch", worker=True)
# Accelerate's names (its launcher exports them too): the N-D parallelism sizes of ParallelismConfig
DP_REPLICATE_SIZE = Var("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "int", None,
                        "ParallelismConfig.dp_replicate_size: model replicas (outermost mesh dimension)", worker=True)
DP_SHARD_SIZE = Var("PARALLELISM_CONFIG_DP_SHARD_SIZE", "int", None,
                    "ParallelismConfig.dp_shard_size: processes each replica is sharded over (FSDP2)", worker=True)
TP_SIZE = Var("PARALLELISM_CONFIG_TP_SIZE", "int", None,
              "ParallelismConfig.tp_size: tensor-parallel processes (innermost mesh dimension)", worker=True)
CP_SIZE = Var("PARALLELISM_CONFIG_CP_SIZE", "int", None,
              "ParallelismConfig.cp_size: context-parallel processes (needs CUDA SDPA)", worker=True)
#: the N-D sizes, by ``ParallelismConfig`` field
PARALLELISM_SIZES = {"dp_replicate_size": DP_REPLICATE_SIZE, "dp_shard_size": DP_SHARD_SIZE, "tp_size": TP_SIZE,
                     "cp_size": CP_SIZE}
FAILURE_DIR = Var("ANYACCEL_FAILURE_DIR", "str", None, "where failing workers leave their error report",
                  worker=True)

# ---- user switches ------------------------------------------------------------------------------
DISABLE_SLURM = Var("ANYACCEL_DISABLE_SLURM", "bool", False, "ignore SLURM variables")
DISABLE_MPI = Var("ANYACCEL_DISABLE_MPI", "bool", False, "ignore MPI variables")
BACKEND = Var("ANYACCEL_BACKEND", "str", None, "force the torch.distributed backend (gloo, nccl)")
PG_TIMEOUT = Var("ANYACCEL_PG_TIMEOUT", "float", 1800.0, "seconds before a collective times out")
EXIT_TIMEOUT = Var("ANYACCEL_EXIT_TIMEOUT", "float", 30.0,
                   "seconds a process may take to end after its script returned, before it prints every thread's "
                   "stack and exits 70")
RDZV_TIMEOUT = Var("ANYACCEL_RDZV_TIMEOUT", "int", 900, "seconds the launcher waits for all machines")
CONFIG_FILE = Var("ANYACCEL_CONFIG_FILE", "str", None, "the configuration file to use")
HOME = Var("ANYACCEL_HOME", "str", None, "directory holding default_config.yaml")
LOG_LEVEL = Var("ANYACCEL_LOG_LEVEL", "str", None, "level of loggers made by get_logger")

ALL = tuple(v for v in globals().values() if isinstance(v, Var))

_TRUE = frozenset({"1", "true", "yes", "on", "y"})
_FALSE = frozenset({"0", "false", "no", "off", "n", ""})


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


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """What the launcher decided for the worker; ``None`` means "not told" (the ``Accelerator``
    argument or its default applies). An argument given to ``Accelerator(...)`` wins over these."""

    use_cpu: Optional[bool] = None
    mixed_precision: Optional[str] = None
    gradient_accumulation_steps: Optional[int] = None
    debug: bool = False
    strategy: Optional[str] = None
    fsdp_config: Optional[Dict[str, Any]] = None
    dynamo_backend: Optional[str] = None
    dynamo_mode: Optional[str] = None
    hang_timeout: Optional[float] = None
    preemption_signals: Optional[str] = None
    dp_replicate_size: Optional[int] = None
    dp_shard_size: Optional[int] = None
    tp_size: Optional[int] = None
    cp_size: Optional[int] = None

    def parallelism_sizes(self) -> Dict[str, int]:
        """The N-D sizes the launcher set (``{field: size}``; empty when it set none)."""
        return {f: getattr(self, f) for f in PARALLELISM_SIZES if getattr(self, f) is not None}


_WORKER_FIELDS = {
    "use_cpu": USE_CPU,
    "mixed_precision": MIXED_PRECISION,
    "gradient_accumulation_steps": GRADIENT_ACCUMULATION_STEPS,
    "debug": DEBUG,
    "strategy": STRATEGY,
    "fsdp_config": FSDP_CONFIG,
    "dynamo_backend": DYNAMO_BACKEND,
    "dynamo_mode": DYNAMO_MODE,
    "hang_timeout": HANG_TIMEOUT,
    "preemption_signals": PREEMPTION_SIGNALS,
    **PARALLELISM_SIZES,
}


def worker_settings(env: Optional[Mapping[str, str]] = None) -> WorkerSettings:
    """Read the launcher's decisions in a worker (local; called by every ``Accelerator``)."""
    env = os.environ if env is None else env
    values = {}
    for field, var in _WORKER_FIELDS.items():
        text = env.get(var.name)
        if text is not None and text.strip() != "":
            values[field] = read(var, env)
    return WorkerSettings(**values)


def worker_env(**settings: Any) -> Dict[str, str]:
    """The variables a launcher adds to its workers' environment for ``settings`` (the fields of
    :class:`WorkerSettings`). ``None`` and default values are left out, so a worker sees only
    what was decided."""
    out: Dict[str, str] = {}
    for field, value in settings.items():
        var = _WORKER_FIELDS.get(field)
        if var is None:
            raise TypeError(f"worker_env() got an unknown setting {field!r}; known: {', '.join(_WORKER_FIELDS)}")
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
    pid = (env if env is not None else os.environ).get(AGENT_PID.name)
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
