"""Every option, written once: one :class:`Option` row per option in :data:`OPTIONS`.

A row says everything about an option: its name, type, default, allowed values, help, the
environment variable that carries it to the workers, the ``anyaccel launch`` flag, the
configuration-file key, the ``Accelerator(...)`` argument it fills, and whether it reaches the
worker. Everything else is **derived** from the rows, and nothing else names an option's
variable, flag, key, type, default or allowed values:

=============================================  ===============================================
what                                           made from the rows by
=============================================  ===============================================
the worker's variables, ``WorkerSettings``      :mod:`anyaccel.envvars`
``Accelerator``'s precedence rule               :mod:`anyaccel.options` (``PRECEDENCE``)
the configuration file's keys (``Config``)      :mod:`anyaccel.config.schema`
the ``anyaccel launch`` flags                   :mod:`anyaccel.launch.command`
merging flags over the file                     :mod:`anyaccel.launch.plan`
the ``anyaccel config`` questions' choices      :mod:`anyaccel.config.wizard`
the reference pages, the options table          ``docs/_ext/anyaccel_reference.py``
=============================================  ===============================================

**Each value is checked once, where it enters, by :func:`check`**, and the message is the same
from every entry point, prefixed by the entry point's name::

    cfg.yaml: key 'mixed_precision' has the value 'fp4'; allowed: one of no, fp16, bf16, fp8
    argument --mixed_precision/--mixed-precision: invalid value 'fp4'; allowed: one of no, fp16, bf16, fp8
    ANYACCEL_MIXED_PRECISION has the value 'fp4'; allowed: one of no, fp16, bf16, fp8
    mixed_precision has the value 'fp4'; allowed: one of no, fp16, bf16, fp8     (the Accelerator argument)

Adding an option is one row here plus the code that uses the value (see
``docs/extending/options.md``). Two spellings of a launcher fact are rows of their own where the
launcher needs both (``cpu`` is the flag and the worker's switch, ``device`` the file's key).

Why this module sits at the bottom of the layers and imports nothing of anyaccel: the worker's
variables (:mod:`anyaccel.envvars`), the preemption default and the environment's ``cpu`` switch
are read below everything else. The few rules that belong to a higher module — which strategy
names are registered, which devices exist, what a preemption signal is, what an FSDP setting
means — are *named* by a row as ``"package.module:name"`` and imported when a value is checked
or the choices are listed, as a registered strategy's target is (:class:`Ref`): the table stays
data, and the owner of each rule keeps it. Standard library only; nothing here reads the
environment.

Why this module is longer than ~450 lines: about half of it is the table itself (one row per
option); the rest is the one check that reads the rows. Splitting the rows from their check would
put a rule and the data it reads in two files.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Mapping, Optional, Tuple, Union

from . import lazyclass
from .errors import ConfigError

__all__ = ["Option", "Ref", "OPTIONS", "option", "options_with", "section_rows", "check", "parse_text", "allowed",
           "choices_of", "close_match", "flag_names", "refusal", "help_text", "PRECISIONS", "FP8_RECIPES", "FP8_BACKENDS", "DYNAMO_BACKENDS", "DYNAMO_MODES",
           "RDZV_BACKENDS", "COMPUTE_ENVIRONMENTS", "GROUPS", "TRUE_WORDS", "FALSE_WORDS"]

# ---- the choice lists, written once ------------------------------------------------------------
#: ``mixed_precision``: what autocast runs in (``no``: full fp32; ``fp8``: bf16 autocast around
#: linear layers that compute in fp8, :mod:`anyaccel.precision_fp8`)
PRECISIONS = ("no", "fp16", "bf16", "fp8")
#: ``fp8_config: {recipe: ...}``: torchao's ``Float8LinearRecipeName`` values (how fp8 scales are taken)
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: ``fp8_config: {backend: ...}``: Accelerate's ``FP8BackendType`` names anyaccel trains with
#: (``MSAMP`` is refused with its reason: :func:`_fp8_backend`)
FP8_BACKENDS = ("AO", "TE")
#: ``dynamo_backend``: torch.compile backends for prepared models (``no``: eager)
DYNAMO_BACKENDS = ("no", "inductor", "eager", "aot_eager", "cudagraphs", "openxla")
#: ``dynamo_mode``: torch.compile modes
DYNAMO_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: ``rdzv_backend``: how machines find each other
RDZV_BACKENDS = ("static", "c10d")
#: ``compute_environment``
COMPUTE_ENVIRONMENTS = ("this_machine", "several_machines")

#: the groups of ``anyaccel launch --help``, in order
GROUPS = ("processes and machines", "hardware and training", "sharding (FSDP2) and compilation",
          "N-D parallelism (ParallelismConfig; the sizes multiply to --num_processes)",
          "DeepSpeed (Accelerate's flags; any of them selects the deepspeed strategy)",
          "fp8 (Accelerate's --fp8_* flags and anyaccel's recipe and emulate; with --mixed_precision fp8)",
          "hangs, preemption and fault tolerance", "other")
_PROCESSES, _HARDWARE, _SHARDING, _ND, _DEEPSPEED, _FP8, _HANGS, _OTHER = GROUPS


@lazyclass.dataclass(frozen=True)
class Ref:
    """A name in a module above this one, ``"package.module:name"``, imported on first use (a
    strategy registry, a device registry, a parser owned by another module). ``call=True``: the
    name is a function or class, called with no arguments to get the value."""

    target: str
    call: bool = False
    first: Tuple[str, ...] = ()  # choices put before the registry's (e.g. "auto")

    def load(self) -> Any:
        module, _, name = self.target.partition(":")
        value = getattr(importlib.import_module(module), name)
        value = value() if self.call else value
        return self.first + tuple(value) if self.first else value


if TYPE_CHECKING:  # (type aliases, for annotations: made when imported at run time, __getattr__ below)
    Choices = Union[Tuple[str, ...], Ref]
    #: a special check: ``(value, where) -> normalised value``; raises ValueError/ConfigError
    Check = Callable[[Any, str], Any]


@lazyclass.dataclass(frozen=True, kw_only=True)
class Option:
    """One option. Only ``name``, ``type``, ``default`` and ``help`` are required; every other
    column is "not there" when left out.

    Columns:
        name: the one name: the ``Accelerator`` argument and worker setting it fills, the
            configuration key (when ``key`` is not given otherwise), the flag's ``--name``.
        type: ``int``, ``float``, ``bool``, ``str`` or ``dict`` (a mapping).
        default: the value when nobody set it (``None``: "not set"; a ``None`` default makes
            ``None`` an allowed value).
        help: one sentence (the flag's help, the file's comment, the reference pages).
        choices: the allowed strings, or a :class:`Ref` to a registry's (called when listed).
        minimum / maximum / above: bounds of a number (``above``: exclusive).
        allowed: what is allowed, in words, when the bounds and choices do not say it.
        special: a check beyond the type (``(value, where) -> value``), e.g. ``gpu_ids``.
        aliases: other spellings that mean a choice (``{"fp32": "no"}``).
        variable: the environment variable that carries it to the workers (``worker``), or a
            switch the user sets (Accelerate's ``PARALLELISM_CONFIG_*`` names are read as they are).
        worker: the launcher passes it to every worker (through ``variable``, or through its
            section's variable), and a plain ``Accelerator()`` reads it there.
        argument: the ``Accelerator(...)`` argument it fills when that argument is ``None``
            (argument > launcher variable > default).
        flag: the ``anyaccel launch`` flag (``--name_with_underscores``; the dashed spelling is
            accepted too); ``switch=True`` makes it a flag without a value (``--cpu``).
        metavar, group: how the flag shows in ``--help``.
        key / section: the configuration-file key; ``section`` names the mapping it sits in
            (``parallelism_config: {parallelism_config_tp_size: 2}``).
        accelerate: Accelerate's ``accelerate config`` file has this key with this meaning.
        question: the ``anyaccel config`` question that asks it (rows of a section are asked by
            the section's questions, in table order).
        help_from: a registry's description that fills the ``{}`` in ``help`` when it is shown
            (:func:`help_text`), e.g. the registered strategies with their summaries.
    """

    name: str
    type: type
    default: Any
    help: str
    choices: Optional[Choices] = None
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    above: Optional[float] = None
    allowed: Optional[str] = None
    special: Optional[Check] = None
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    variable: Optional[str] = None
    worker: bool = False
    argument: Optional[str] = None
    flag: Optional[str] = None
    switch: bool = False
    metavar: Optional[str] = None
    group: str = _OTHER
    key: Optional[str] = None
    section: Optional[str] = None
    accelerate: bool = False
    question: Optional[str] = None
    help_from: Optional[Ref] = None

    @property
    def nullable(self) -> bool:
        """``None`` is an allowed value (it means "not set")."""
        return self.default is None

    @property
    def dest(self) -> str:
        """The flag's ``argparse`` destination (the flag without its dashes)."""
        return (self.flag or f"--{self.name}")[2:]

    @property
    def where_key(self) -> str:
        """How messages name the configuration key."""
        return f"key '{self.section}.{self.key}'" if self.section else f"key '{self.key}'"


# ---- special checks (the rules beyond a type) --------------------------------------------------
def _gpu_ids(value: Any, where: str) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    elif isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        value = ",".join(str(v) for v in value)
    if not isinstance(value, str):
        raise _Refused(f" ({_describe(value)})")
    text = value.replace(" ", "").lower()
    if text != "all" and not re.fullmatch(r"\d+(,\d+)*", text):  # compiled when first asked, not at import
        raise _Refused()
    if text != "all" and len(set(text.split(","))) != len(text.split(",")):
        raise _Refused(" (an id appears twice)")
    return text


def _host(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value.strip()):
        raise _Refused()
    return value.strip()


def _fault_tolerance(value: Any, where: str) -> str:
    """``off``, ``on`` or a torchft Lighthouse's address as ``HOST:PORT`` (``http://`` may lead;
    an IPv6 host in brackets). YAML's bare ``on``/``off`` (booleans) are read as the words."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value.strip()):
        raise _Refused(f" ({_describe(value)})" if not isinstance(value, str) else "")
    text = value.strip()
    if text.lower() in TRUE_WORDS | {"on"}:
        return "on"
    if text.lower() in FALSE_WORDS | {"off", "none"}:
        return "off"
    address = text[len("http://"):] if text.lower().startswith("http://") else text
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in address \
            or (":" in host and not (host.startswith("[") and host.endswith("]"))):
        raise _Refused()
    return address


def _signals(value: Any, where: str) -> str:
    """The signals as canonical text (``SIGTERM,SIGUSR1``, or ``none``); preemption's parser
    says what a signal is."""
    if not isinstance(value, (str, list, tuple)):
        raise _Refused(f" ({_describe(value)})")
    parse = Ref("anyaccel.process.preemption:parse_signals").load()
    return ",".join(parse(value, source=where or "preemption_signals")) or "none"


def _fsdp_settings(value: Any, where: str) -> Dict[str, Any]:
    """An ``fsdp_config`` mapping: FullyShardedDataParallelPlugin's settings (Accelerate's
    ``fsdp_*`` names too), checked by building the plugin."""
    if not isinstance(value, Mapping):
        raise _Refused(f" ({_describe(value)})")
    build = Ref("anyaccel.compat.plugins:fsdp_plugin_from_dict").load()
    try:
        build(value, source=where or "fsdp_config")
    except ValueError as exc:
        text = str(exc)
        raise ConfigError(text if where and text.startswith(where) else f"{where or 'fsdp_config'}: {text}") from None
    return dict(value)


def _json_file(value: Any, where: str) -> str:
    """The absolute path of an existing file (its content is read by the DeepSpeed plugin)."""
    import os

    if not isinstance(value, str) or not value.strip():
        raise _Refused(f" ({_describe(value)})")
    path = os.path.abspath(os.path.expanduser(value.strip()))
    if not os.path.isfile(path):
        raise _Refused(" (no such file)")
    return path


def _pp_schedule(value: Any, where: str) -> str:
    """A pipeline schedule by ``torch.distributed.pipelining``'s name, in any case, returned as
    torch spells it (the registry: ``anyaccel.strategies.nd.options.PP_SCHEDULES``)."""
    if not isinstance(value, str):
        raise _Refused(f" ({_describe(value)})")
    names = Ref("anyaccel.strategies.nd.options:PP_SCHEDULES").load()
    found = {str(n).lower(): str(n) for n in names}.get(value.strip().lower())
    if found is None:
        raise _Refused(" (torch.distributed.pipelining's schedule names, any case)")
    return found


def _module_names(value: Any, where: str) -> str:
    """Module names (``pp_split_points``): a list, or text with commas; returned as text with
    commas, what a flag and a variable carry (``ParallelismConfig`` makes it a tuple)."""
    if isinstance(value, str):
        names = [n.strip() for n in value.split(",")]
    elif isinstance(value, (list, tuple)) and all(isinstance(n, str) for n in value):
        names = [n.strip() for n in value]
    else:
        raise _Refused(f" ({_describe(value)})")
    if not names or any(not n or any(c.isspace() for c in n) for n in names):
        raise _Refused()
    return ",".join(names)


def _nd_section(value: Any, where: str) -> Dict[str, Any]:
    """A ``parallelism_config`` mapping; its keys are the rows of the section (Accelerate's
    spelling, the ``parallelism_config_`` prefix may be left out), each checked as its row says.
    Accelerate's context/sequence-parallel settings that anyaccel does not implement are refused
    unless their size is 1 (an Accelerate file writes them then: ignored)."""
    if not isinstance(value, Mapping):
        raise _Refused(f" ({_describe(value)})")
    rows = {row.key: row for row in section_rows("parallelism_config") if row.key}
    full = {(k if str(k).startswith("parallelism_config_") else f"parallelism_config_{k}"): k for k in value}
    out: Dict[str, Any] = {}
    ignored = []
    for key, given in full.items():
        if key in _ACCELERATE_OFF_WHEN_1 and key not in rows:  # a row added for it takes it over
            size_key = _ACCELERATE_OFF_WHEN_1[key]
            size = value.get(full.get(size_key, ""), 1)
            if size not in (None, 1):
                raise ConfigError(f"{where}: has the key {given!r} with {size_key} {size}, which anyaccel does not "
                                  "implement yet")
            ignored.append(str(given))
            continue
        row = rows.get(key)
        if row is None:
            hint = close_match(key, rows)
            raise ConfigError(f"{where}: has the key {given!r}, which is not one of {', '.join(rows)}"
                              + (f" (did you mean {hint!r}?)" if hint else ""))
        out[key] = check(row, value[given], row.where_key if where.startswith("key ") or not where else f"{where}.{key}")
    if ignored:
        import warnings

        warnings.warn(f"parallelism_config: {', '.join(ignored)} ignored (Accelerate's context/sequence-parallel "
                      "settings; their size is 1 here, so they have no effect)", stacklevel=4)
    return {k: v for k, v in out.items() if v is not None}


def _deepspeed_section(value: Any, where: str) -> Dict[str, Any]:
    """A ``deepspeed_config`` mapping: its keys are the rows of the section (Accelerate's
    ``deepspeed_config`` keys), each checked as its row says, then together by building the
    ``DeepSpeedPlugin`` they make (a stage and an offload that do not go together, a setting the
    DeepSpeed config file sets otherwise). Accelerate's hostfile and filter keys belong to
    DeepSpeed's own multi-machine launchers, which anyaccel does not use: refused, saying so."""
    if not isinstance(value, Mapping):
        raise _Refused(f" ({_describe(value)})")
    rows = {row.key: row for row in section_rows("deepspeed_config") if row.key}
    name = where or "deepspeed_config"
    out: Dict[str, Any] = {}
    for key, given in value.items():
        row = rows.get(key)
        if row is None:
            why = _DEEPSPEED_NOT_HERE.get(str(key))
            if why:
                raise ConfigError(f"{name}: has the key {key!r}, {why}")
            hint = close_match(key, rows)
            raise ConfigError(f"{name}: has the key {key!r}, which is not one of {', '.join(rows)}"
                              + (f" (did you mean {hint!r}?)" if hint else ""))
        out[key] = check(row, given, row.where_key if where.startswith("key ") or not where else f"{where}.{key}")
    out = {k: v for k, v in out.items() if v is not None}
    build = Ref("anyaccel.compat.utils.deepspeed:deepspeed_plugin_from_settings").load()
    try:  # the settings together: a stage and an offload that do not go together, a file that says otherwise
        build({rows[k].name: v for k, v in out.items()}, source="")
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    return out


#: Accelerate ``deepspeed_config`` keys that only DeepSpeed's own launchers read, and why they
#: have no meaning here (``gradient_accumulation_steps`` is the top-level option)
_DEEPSPEED_NOT_HERE = {
    **{key: "which DeepSpeed's own multi-machine launchers (pdsh, MPI, ...) read; anyaccel launch starts every "
            "machine's processes itself: run it on each machine with --machine_rank"
       for key in ("deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter")},
    "gradient_accumulation_steps": "which is the top-level key gradient_accumulation_steps here (the same for every "
                                   "strategy): write it there",
}



def _fp8_backend(value: Any, where: str) -> str:
    """An fp8 backend by Accelerate's name in any case (``ao``, ``AO``), returned as Accelerate's
    ``FP8BackendType`` value; ``MSAMP`` is refused with the reason."""
    if not isinstance(value, str):
        raise _Refused(f" ({_describe(value)})")
    name = value.strip().upper()
    if name == "MSAMP":
        raise _Refused(" (MS-AMP is deprecated upstream: Accelerate 1.13 deprecated it and Microsoft no longer "
                       "maintains it; torchao (AO) trains the same linear layers in fp8)")
    if name not in FP8_BACKENDS:
        raise _Refused()
    return name


def _linear_precision(value: Any, where: str) -> str:
    """Transformer Engine's ``override_linear_precision``: three booleans (fprop, dgrad, wgrad), as
    a list or as text with commas (a flag, a variable); returned as text with commas."""
    if isinstance(value, str):
        words = [w.strip().lower() for w in value.split(",")]
        if len(words) != 3 or any(w not in TRUE_WORDS | FALSE_WORDS for w in words):
            raise _Refused()
        flags = [w in TRUE_WORDS for w in words]
    elif isinstance(value, (list, tuple)) and len(value) == 3 and all(isinstance(v, bool) for v in value):
        flags = list(value)
    else:
        raise _Refused(f" ({_describe(value)})")
    return ",".join("true" if f else "false" for f in flags)


def _fp8_section(value: Any, where: str) -> Optional[Dict[str, Any]]:
    """An ``fp8_config`` mapping (Accelerate's keys, and anyaccel's ``recipe`` and ``emulate``),
    each key checked by its row, then all together by building the fp8 options they make (a
    recipe with an fp8 all-gather torchao does not have, Transformer Engine's settings beside
    ``backend: AO``). An empty mapping is "not set" (``accelerate config`` writes ``{}``)."""
    if not isinstance(value, Mapping):
        raise _Refused(f" ({_describe(value)})")
    rows = {row.key: row for row in section_rows("fp8_config") if row.key}
    name = where or "fp8_config"
    out: Dict[str, Any] = {}
    for key, given in value.items():
        row = rows.get(key)
        if row is None:
            if key in _FP8_NOT_HERE:
                raise ConfigError(f"{name}: has the key {key!r}, {_FP8_NOT_HERE[key]}")
            hint = close_match(key, rows)
            raise ConfigError(f"{name}: has the key {key!r}, which is not one of {', '.join(rows)}"
                              + (f" (did you mean {hint!r}?)" if hint else ""))
        out[key] = check(row, given, row.where_key if where.startswith("key ") or not where else f"{where}.{key}")
    out = {k: v for k, v in out.items() if v is not None}
    build = Ref("anyaccel.training.precision_fp8:options_from_settings").load()
    try:  # the settings together
        build({rows[k].name: v for k, v in out.items()})
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    return out or None


#: Accelerate ``fp8_config`` keys without a meaning here, and why
_FP8_NOT_HERE = {"optimization_level": "MS-AMP's setting; MS-AMP is not available (deprecated upstream): use backend "
                                       "AO (torchao) or TE (Transformer Engine)"}

#: Accelerate's context/sequence-parallel settings without an anyaccel meaning yet, and the size
#: that must be 1 for them to be ignored
_ACCELERATE_OFF_WHEN_1 = {f"parallelism_config_{k}": f"parallelism_config_{size}" for k, size in (
    ("cp_backend", "cp_size"), ("cp_comm_strategy", "cp_size"), ("sp_seq_length", "sp_size"), ("sp_seq_length_is_variable", "sp_size"), ("sp_attn_implementation", "sp_size"))}


# ---- the table -----------------------------------------------------------------------------------
def _nd_field(name: str, type: type, help: str, question: Optional[str] = None, **kw: Any) -> Option:
    """A ``ParallelismConfig`` field the launcher sets, in Accelerate's spellings: variable
    ``PARALLELISM_CONFIG_<NAME>``, key ``parallelism_config: {parallelism_config_<name>: ...}``
    and flag ``--parallelism_config_<name>``; a plain ``Accelerator()`` passes it to its
    ``ParallelismConfig(<name>=...)``. A field for pipeline or sequence parallelism is one call."""
    return Option(name=name, type=type, default=None, help=help, variable=f"PARALLELISM_CONFIG_{name.upper()}",
                  worker=True, argument="parallelism_config", flag=f"--parallelism_config_{name}", group=_ND,
                  key=f"parallelism_config_{name}", section="parallelism_config", accelerate=True, question=question,
                  **kw)


def _size(dim: str, what: str, question: Optional[str] = None) -> Option:
    """A ``ParallelismConfig`` size ``<dim>_size`` (an integer >= 1; 1 where not given)."""
    return _nd_field(f"{dim}_size", int, f"{what} (ParallelismConfig.{dim}_size; default 1).", question, minimum=1,
                     metavar="N")


def _ds_field(name: str, type: type, help: str, variable: str, **kw: Any) -> Option:
    """A DeepSpeed setting in Accelerate's spellings: flag ``--<name>``, key ``deepspeed_config:
    {<name>: ...}`` and the ``ACCELERATE_*`` variable Accelerate's ``DeepSpeedPlugin`` reads; a
    plain ``Accelerator()`` builds its ``DeepSpeedPlugin`` from whatever the launcher set."""
    return Option(name=name, type=type, default=None, help=help, variable=variable, worker=True,
                  argument="deepspeed_plugin", flag=f"--{name}", group=_DEEPSPEED, key=name, section="deepspeed_config",
                  accelerate=True, **kw)


def _fp8_field(name: str, type: type, help: str, key: str, variable: str, **kw: Any) -> Option:
    """An fp8 setting: flag ``--<name>`` (Accelerate's ``--fp8_*`` flags), key ``fp8_config:
    {<key>: ...}`` (the key ``accelerate config`` writes) and the variable Accelerate's recipe
    handlers read (``ACCELERATE_FP8_*``; ``ANYACCEL_FP8_*`` for anyaccel's own); a plain
    ``Accelerator(mixed_precision="fp8")`` builds its fp8 options from whatever the launcher set."""
    return Option(name=name, type=type, default=None, help=help, variable=variable, worker=True,
                  argument="kwargs_handlers", flag=f"--{name}", group=_FP8, key=key, section="fp8_config",
                  accelerate=not variable.startswith("ANYACCEL_"), **kw)


def _fsdp_flag(name: str, help: str, type: type = str, **kw: Any) -> Option:
    """An Accelerate ``--fsdp_*`` flag: one setting of the ``fsdp_config`` section (it travels
    to the workers inside ``ANYACCEL_FSDP_CONFIG``)."""
    return Option(name=name, type=type, default=None, help=help, flag=f"--{name}", group=_SHARDING, key=name,
                  section="fsdp_config", accelerate=True, **kw)


def _rows() -> Tuple[Option, ...]:
    """The table: one row per option, in the order of ``--help``, the configuration file and the
    reference (made once, by :func:`_table`, when a row is first asked for). Longer than 60 lines:
    it is the table itself, one row per option (a function, so that importing this module does not
    build ~75 rows: the import budget)."""
    return (
        # ---- processes and machines --------------------------------------------------------------
        Option(name="config_version", type=int, default=1, minimum=1, help="Version of this file's format.",
               key="config_version"),
        Option(name="compute_environment", type=str, default="this_machine", choices=COMPUTE_ENVIRONMENTS,
               help="Run on this machine only, or on several machines that start the job together.",
               key="compute_environment"),
        Option(name="device", type=str, default="auto", help="Device kind; auto picks GPUs when visible, else Apple MPS, "
               "else the CPU.", choices=Ref("anyaccel.backends:config_device_names", call=True, first=("auto",)), key="device"),
        Option(name="num_processes", type=int, default=None, minimum=1,
               help="Total processes over all machines (default: one per visible GPU, else 1).", flag="--num_processes",
               metavar="N", group=_PROCESSES, key="num_processes", accelerate=True),
        Option(name="num_machines", type=int, default=1, minimum=1, help="Number of machines taking part in the job.",
               flag="--num_machines", metavar="M", group=_PROCESSES, key="num_machines", accelerate=True),
        Option(name="machine_rank", type=int, default=0, minimum=0, help="Rank of this machine, 0 for the main machine.",
               flag="--machine_rank", metavar="R", group=_PROCESSES, key="machine_rank", accelerate=True),
        Option(name="main_process_ip", type=str, default=None, special=_host, allowed="a host name or IP address",
               help="Address of the machine with rank 0 (needed for several machines).", flag="--main_process_ip",
               metavar="HOST", group=_PROCESSES, key="main_process_ip", accelerate=True),
        Option(name="main_process_port", type=int, default=None, minimum=1, maximum=65535,
               help="Port on the main machine (default: a free port on one machine, 29500 on several).",
               flag="--main_process_port", metavar="PORT", group=_PROCESSES, key="main_process_port", accelerate=True),
        Option(name="gpu_ids", type=str, default="all", special=_gpu_ids,
               allowed="all, or comma-separated GPU ids such as 0,1",
               help="GPUs to use on this machine: all, or comma-separated ids such as 0,1.", flag="--gpu_ids",
               metavar="IDS", group=_HARDWARE, key="gpu_ids", accelerate=True),
        Option(name="cpu", type=bool, default=False, help="Run on the CPU even when GPUs are visible.",
               variable="ANYACCEL_USE_CPU", worker=True, argument="cpu", flag="--cpu", switch=True, group=_HARDWARE),
        Option(name="mixed_precision", type=str, default="no", choices=PRECISIONS,
               aliases={"fp32": "no", "none": "no", "": "no"},
               help="Autocast dtype for the forward pass; no keeps everything in fp32.",
               variable="ANYACCEL_MIXED_PRECISION", worker=True, argument="mixed_precision", flag="--mixed_precision",
               group=_HARDWARE, key="mixed_precision", accelerate=True),
        Option(name="gradient_accumulation_steps", type=int, default=1, minimum=1,
               help="Batches whose gradients are summed before each optimizer step.",
               variable="ANYACCEL_GRADIENT_ACCUMULATION_STEPS", worker=True, argument="gradient_accumulation_steps",
               flag="--gradient_accumulation_steps", metavar="S", group=_HARDWARE, key="gradient_accumulation_steps"),
        Option(name="whole_last_batches", type=bool, default=False,
               help="Pad the last round of an epoch with whole batches of the epoch's first samples, as Accelerate "
                    "does (every batch has batch_size samples: fixed shapes for static-shape compile and BatchNorm), "
                    "instead of splitting its samples evenly.",
               variable="ANYACCEL_WHOLE_LAST_BATCHES", worker=True, flag="--whole_last_batches", switch=True,
               group=_HARDWARE, key="whole_last_batches"),
        Option(name="rdzv_backend", type=str, default="static", choices=RDZV_BACKENDS,
               help="Rendezvous between machines: static (fixed machine ranks) or c10d (elastic).", flag="--rdzv_backend",
               group=_PROCESSES, key="rdzv_backend", accelerate=True),
        # ---- sharding and compilation --------------------------------------------------------------
        Option(name="strategy", type=str, default="auto", choices=Ref("anyaccel.strategies:StrategyChoices", call=True),
               help="How models are wrapped across processes: {} (auto: DDP for several processes, else the device's own; "
                    "strategies of other packages come from their anyaccel.strategies entry points).",
               help_from=Ref("anyaccel.strategies:describe_choices", call=True),
               variable="ANYACCEL_STRATEGY", worker=True, argument="strategy", flag="--strategy", metavar="NAME",
               group=_SHARDING, key="strategy"),
        Option(name="fsdp_config", type=dict, default=None, special=_fsdp_settings,
               allowed="a mapping of FullyShardedDataParallelPlugin settings such as auto_wrap_policy: "
                       "transformer_based_wrap",
               help="FSDP2 options (FullyShardedDataParallelPlugin fields, Accelerate's fsdp_* names accepted).",
               variable="ANYACCEL_FSDP_CONFIG", worker=True, argument="fsdp_plugin", key="fsdp_config", accelerate=True),
        _fsdp_flag("fsdp_version", "FSDP version (anyaccel implements FSDP2).", type=int, choices=None, minimum=2,
                   maximum=2, metavar="2"),
        _fsdp_flag("fsdp_auto_wrap_policy", "Which blocks are sharded as their own unit.",
                   choices=Ref("anyaccel.strategies.fsdp.options:FSDP_WRAP_POLICIES")),
        _fsdp_flag("fsdp_transformer_layer_cls_to_wrap", "Comma-separated class names to wrap.", metavar="CLASSES"),
        _fsdp_flag("fsdp_min_num_params", "The size_based_wrap threshold.", type=int, minimum=1, metavar="N"),
        _fsdp_flag("fsdp_reshard_after_forward", "Free gathered parameters after forward.", type=bool, metavar="BOOL"),
        _fsdp_flag("fsdp_offload_params", "Keep shards in host memory (GPU only).", type=bool, metavar="BOOL"),
        _fsdp_flag("fsdp_activation_checkpointing", "Recompute activations of wrapped blocks.", type=bool,
                   metavar="BOOL"),
        _fsdp_flag("fsdp_state_dict_type", "How save_state stores models (default SHARDED_STATE_DICT).",
                   choices=Ref("anyaccel.compat.plugins:FSDP_STATE_DICT_TYPES")),
        Option(name="parallelism_config", type=dict, default=None, special=_nd_section,
               allowed="a mapping of parallelism_config_<dim>_size keys (dp_replicate, dp_shard, tp, cp, pp, sp, ep) to "
                       "integers >= 1, and the parallelism_config_pp_* and _sp_backend keys",
               help="N-D parallelism sizes (Accelerate's keys parallelism_config_dp_replicate_size, _dp_shard_size, "
                    "_tp_size, _cp_size, and _pp_size, _sp_size; missing ones are 1) and the pipeline and sequence "
                    "settings (_pp_schedule, _pp_microbatches, _pp_stages_per_rank, _pp_split_points, _sp_backend); "
                    "selects the nd strategy.",
               key="parallelism_config", accelerate=True),
        # the sizes in the order `anyaccel config` asks them; the last one asked takes what remains
        _size("tp", "Tensor-parallel processes (innermost mesh dimension, within a machine)",
              question="Tensor-parallel size (processes that split each layer, within a machine)?"),
        _size("cp", "Context-parallel processes (needs CUDA SDPA; not available yet)"),
        _size("pp", "Pipeline stages (outermost mesh dimension; trained through accelerator.pipeline_step)",
              question="Pipeline stages (pp_size: the model cut into consecutive stages; 1: none)?"),
        _size("sp", "Sequence-parallel processes, Ulysses style (each holds a slice of every sequence)",
              question="Sequence-parallel size (sp_size: processes that split each sequence; 1: none)?"),
        _size("dp_replicate", "Model replicas (outermost mesh dimension after pp, across machines)",
              question="Model replicas (dp_replicate_size: full copies, e.g. one per machine; 1: shard over all)?"),
        _size("dp_shard", "Processes each replica is sharded over (FSDP2)",
              question="FSDP shard size (processes each replica is sharded over)?"),
        # the other fields, asked after the sizes, each only when its dimension's size is above 1
        _nd_field("pp_schedule", str, "Pipeline schedule, torch.distributed.pipelining's name in any case "
                  "(ParallelismConfig.pp_schedule; default 1F1B).", question="Pipeline schedule?",
                  choices=Ref("anyaccel.strategies.nd.options:PP_SCHEDULES"), special=_pp_schedule, metavar="NAME"),
        _nd_field("pp_microbatches", int, "Micro-batches each batch is cut into under pp (ParallelismConfig."
                  "pp_microbatches; default: the number of stages).", question="Pipeline micro-batches per batch "
                  "(the batch size must divide by it; empty: one per stage)?", minimum=1, metavar="N"),
        _nd_field("pp_stages_per_rank", int, "Pipeline stages each pp rank holds (ParallelismConfig.pp_stages_per_rank; "
                  "default: 1, 2 for the V and looped schedules).", minimum=1, metavar="N"),
        _nd_field("pp_split_points", str, "Module names where pipeline stages begin, comma-separated "
                  "(ParallelismConfig.pp_split_points; default: an even cut).", special=_module_names, metavar="NAMES",
                  allowed="module names without spaces, comma-separated or a list (e.g. model.layers.2,model.layers.4)"),
        _nd_field("sp_backend", str, "How sp_size is run: ulysses, or deepspeed (Accelerate's name for the same "
                  "Ulysses all-to-all; DeepSpeed is not needed) (ParallelismConfig.sp_backend; default ulysses).",
                  choices=Ref("anyaccel.strategies.nd.options:SP_BACKENDS")),
        _nd_field("ep_size", int, "Expert-parallel processes: the experts of each mixture-of-experts layer split over "
                  "them, tokens sent all-to-all (ParallelismConfig.ep_size; default 1). Borrows the dp_shard x sp "
                  "processes, which it must divide.", question="Expert-parallel size (ep_size: processes each MoE "
                  "layer's experts are split over, taken from the FSDP shards; 1: none)?", minimum=1, metavar="N"),
        # ---- fp8: Accelerate's fp8_config keys and --fp8_* flags, anyaccel's recipe and emulate ---------------
        Option(name="fp8_config", type=dict, default=None, special=_fp8_section,
               allowed="a mapping of Accelerate's fp8_config keys (backend, enable_fsdp_float8_all_gather, pad_inner_dim, "
                       "Transformer Engine's margin, fp8_format, ...) and recipe, emulate",
               help="fp8 settings under mixed_precision fp8 (the keys of Accelerate's fp8_config section, and anyaccel's "
                    "recipe and emulate).", key="fp8_config", accelerate=True),
        _fp8_field("fp8_backend", str, "Which library trains in fp8: AO (torchao, default) or TE (NVIDIA Transformer "
                                       "Engine, CUDA only); MSAMP is refused (deprecated upstream).", "backend",
                   "ACCELERATE_FP8_BACKEND", special=_fp8_backend, choices=FP8_BACKENDS, metavar="{ao,te}",
                   allowed="AO or TE, any case",
                   question="Which fp8 library (AO: torchao; TE: NVIDIA Transformer Engine, CUDA only)?"),
        _fp8_field("fp8_recipe", str, "torchao's recipe: tensorwise (fastest), rowwise or rowwise_with_gw_hp (more "
                                      "accurate); default tensorwise.", "recipe", "ANYACCEL_FP8_RECIPE",
                   choices=FP8_RECIPES,
                   question="Which fp8 recipe (tensorwise: fastest; rowwise, rowwise_with_gw_hp: more accurate)?"),
        _fp8_field("fp8_emulate", bool, "Compute fp8 in higher precision (torchao's emulate): the default where the "
                                        "device has no fp8 matmul (CPU); for testing, never faster.", "emulate",
                   "ANYACCEL_FP8_EMULATE", metavar="BOOL"),
        _fp8_field("fp8_pad_inner_dim", bool, "Pad matmul dimensions to multiples of 16 (torchao; default true).",
                   "pad_inner_dim", "ACCELERATE_FP8_PAD_INNER_DIM", metavar="BOOL"),
        _fp8_field("fp8_enable_fsdp_float8_all_gather", bool, "FSDP2 all-gathers weights in fp8 (torchao, tensorwise "
                                                              "recipe; default: on under FSDP2).",
                   "enable_fsdp_float8_all_gather", "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER", metavar="BOOL"),
        _fp8_field("fp8_use_autocast_during_eval", bool, "Transformer Engine: fp8 in eval mode too (default off).",
                   "use_autocast_during_eval", "ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL", switch=True),
        _fp8_field("fp8_margin", int, "Transformer Engine: margin of the scaling factor (default 0).", "margin",
                   "ACCELERATE_FP8_MARGIN", minimum=0, metavar="N"),
        _fp8_field("fp8_interval", int, "Transformer Engine: steps between scaling-factor updates (default 1).",
                   "interval", "ACCELERATE_FP8_INTERVAL", minimum=1, metavar="N"),
        _fp8_field("fp8_format", str, "Transformer Engine: HYBRID (e4m3 forward, e5m2 backward), E4M3 or E5M2.",
                   "fp8_format", "ACCELERATE_FP8_FORMAT", choices=("HYBRID", "E4M3", "E5M2")),
        _fp8_field("fp8_amax_history_len", int, "Transformer Engine: amax history length (default 1024).",
                   "amax_history_length", "ACCELERATE_FP8_AMAX_HISTORY_LEN", minimum=1, metavar="N"),
        _fp8_field("fp8_amax_compute_algo", str, "Transformer Engine: max or most_recent (default most_recent).",
                   "amax_compute_algorithm", "ACCELERATE_FP8_AMAX_COMPUTE_ALGO", choices=("max", "most_recent")),
        _fp8_field("fp8_override_linear_precision", str, "Transformer Engine: fprop,dgrad,wgrad in higher precision, "
                                                         "three booleans (default false,false,false).",
                   "override_linear_precision", "ANYACCEL_FP8_OVERRIDE_LINEAR_PRECISION", special=_linear_precision,
                   allowed="three booleans, as a list or comma-separated (fprop,dgrad,wgrad)", metavar="BOOLS"),
        Option(name="dynamo_backend", type=str, default="no", choices=DYNAMO_BACKENDS,
               help="torch.compile backend for prepared models; no leaves them eager.", variable="ANYACCEL_DYNAMO_BACKEND",
               worker=True, argument="dynamo_backend", flag="--dynamo_backend", group=_SHARDING, key="dynamo_backend"),
        Option(name="dynamo_mode", type=str, default=None, choices=DYNAMO_MODES,
               help="torch.compile mode (default: torch's).", variable="ANYACCEL_DYNAMO_MODE", worker=True,
               flag="--dynamo_mode", group=_SHARDING, key="dynamo_mode"),
        Option(name="dynamo_use_fullgraph", type=bool, default=None,
               help="torch.compile(fullgraph=...): compile each forward as one graph (default: torch's).",
               variable="ANYACCEL_DYNAMO_USE_FULLGRAPH", worker=True, flag="--dynamo_use_fullgraph", switch=True,
               group=_SHARDING, key="dynamo_use_fullgraph"),
        Option(name="dynamo_use_dynamic", type=bool, default=None,
               help="torch.compile(dynamic=...): trace shapes as dynamic (true) or static (false) (default: torch's).",
               variable="ANYACCEL_DYNAMO_USE_DYNAMIC", worker=True, flag="--dynamo_use_dynamic", switch=True,
               group=_SHARDING, key="dynamo_use_dynamic"),
        # ---- DeepSpeed: Accelerate's flags, deepspeed_config keys and ACCELERATE_* variables -----------
        Option(name="deepspeed_config", type=dict, default=None, special=_deepspeed_section,
               allowed="a mapping of Accelerate's deepspeed_config keys (zero_stage, deepspeed_config_file, "
                       "offload_optimizer_device, ...)",
               help="DeepSpeed settings (the keys of Accelerate's deepspeed_config section); selects the deepspeed "
                    "strategy.", key="deepspeed_config", accelerate=True),
        _ds_field("zero_stage", int, "ZeRO stage: 0 (none), 1 (optimizer state sharded), 2 (and gradients), 3 (and "
                                     "parameters); default 2.", "ACCELERATE_DEEPSPEED_ZERO_STAGE", minimum=0, maximum=3,
                  metavar="{0,1,2,3}", question="Which ZeRO stage (what each process keeps only its share of)?"),
        _ds_field("deepspeed_config_file", str, "A DeepSpeed config JSON file; the other settings fill its \"auto\" or "
                                                "missing values.", "ACCELERATE_DEEPSPEED_CONFIG_FILE", special=_json_file,
                  allowed="the path of an existing DeepSpeed config (JSON) file", metavar="PATH"),
        _ds_field("offload_optimizer_device", str, "Where optimizer state lives: none, cpu or nvme (stages 1-3).",
                  "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
                  choices=Ref("anyaccel.strategies.deepspeed.config:OFFLOAD_DEVICES"),
                  question="Keep the optimizer state in host memory (offload: for models whose state does not fit)?"),
        _ds_field("offload_param_device", str, "Where parameters live: none, cpu or nvme (stage 3).",
                  "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
                  choices=Ref("anyaccel.strategies.deepspeed.config:OFFLOAD_DEVICES"),
                  question="Keep the parameters in host memory (offload, stage 3)?"),
        _ds_field("offload_optimizer_nvme_path", str, "Folder for optimizer state offloaded to nvme.",
                  "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH", metavar="PATH"),
        _ds_field("offload_param_nvme_path", str, "Folder for parameters offloaded to nvme.",
                  "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH", metavar="PATH"),
        _ds_field("gradient_clipping", float, "Clip every step at this gradient norm (DeepSpeed's clipping); not set: "
                                              "where the script calls clip_grad_norm_.", "ACCELERATE_GRADIENT_CLIPPING",
                  minimum=0.0, metavar="NORM"),
        _ds_field("zero3_init_flag", bool, "Build models made after the Accelerator partitioned (deepspeed.zero.Init; "
                                           "stage 3; default: true for stage 3).", "ACCELERATE_DEEPSPEED_ZERO3_INIT",
                  metavar="BOOL"),
        _ds_field("zero3_save_16bit_model", bool, "save_model under stage 3 gives the 16-bit weights (default false: the "
                                                  "fp32 masters).", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
                  metavar="BOOL"),
        _ds_field("deepspeed_moe_layer_cls_names", str, "Comma-separated mixture-of-experts block classes (ZeRO-3 "
                                                        "leaves).", "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES",
                  metavar="CLASSES"),
        Option(name="deepspeed_multinode_launcher", type=str, default=None, choices=("standard",),
               allowed="standard (torch's elastic agent, which anyaccel launch runs on every machine; pdsh, openmpi, "
                       "mvapich, mpich, nossh and slurm are DeepSpeed's own launchers, which anyaccel does not use)",
               help="How several machines start (Accelerate's key): standard, torch's elastic agent.",
               flag="--deepspeed_multinode_launcher", group=_DEEPSPEED, key="deepspeed_multinode_launcher",
               section="deepspeed_config", accelerate=True),
        # ---- restarts, hangs and preemption ---------------------------------------------------------
        Option(name="max_restarts", type=int, default=0, minimum=0,
               help="How often every process is restarted after a failure (as torchrun).", flag="--max_restarts",
               metavar="K", group=_PROCESSES, key="max_restarts"),
        Option(name="hang_timeout", type=float, default=300.0, minimum=0.0,
               allowed="a number of seconds >= 0 (0 turns the reports off)",
               help="Seconds a rank may wait in a collective before the hang doctor reports where every rank is; 0: off.",
               variable="ANYACCEL_HANG_TIMEOUT", worker=True, argument="hang_timeout", flag="--hang_timeout",
               metavar="SECONDS", group=_HANGS, key="hang_timeout"),
        Option(name="preemption_signals", type=str, default="SIGTERM,SIGUSR1", special=_signals,
               allowed="signal names such as SIGTERM,SIGUSR1 (SIGUSR2, SIGINT, SIGHUP, SIGCONT too), or none",
               help="Signals that make every rank save a checkpoint at the next step and exit 75; none: off.",
               variable="ANYACCEL_PREEMPTION_SIGNALS", worker=True, argument="preemption_signals",
               flag="--preemption_signals", metavar="SIGNALS", group=_HANGS, key="preemption_signals"),
        Option(name="preemption_grace", type=float, default=120.0, above=0.0, allowed="a number of seconds > 0",
               help="Seconds the launcher gives its workers to save that checkpoint before it kills them.",
               flag="--preemption_grace", metavar="SECONDS", group=_HANGS, key="preemption_grace"),
        Option(name="fault_tolerance", type=str, default="off", special=_fault_tolerance,
               allowed="off, on (anyaccel launch starts a torchft Lighthouse on machine 0), or HOST:PORT of a running "
                       "Lighthouse",
               help="Per-step fault tolerance on torchft: each process is a replica group, the others go on when one "
                    "dies and a restarted one heals from a live peer; off, on, or a Lighthouse's HOST:PORT (needs the "
                    "ft extra).", variable="ANYACCEL_FAULT_TOLERANCE", worker=True, argument="fault_tolerance",
               flag="--fault_tolerance", metavar="off|on|HOST:PORT", group=_HANGS, key="fault_tolerance"),
        Option(name="fault_tolerance_min_replicas", type=int, default=1, minimum=1,
               help="Replica groups a step needs to commit (and the Lighthouse's quorum minimum); with more, the "
                    "others wait for a lost group to return.", variable="ANYACCEL_FAULT_TOLERANCE_MIN_REPLICAS",
               worker=True, flag="--fault_tolerance_min_replicas", metavar="N", group=_HANGS,
               key="fault_tolerance_min_replicas"),
        Option(name="monitor_interval", type=float, default=0.1, above=0.0, allowed="a number of seconds > 0",
               help="Seconds between the agent's checks of the processes.", flag="--monitor_interval",
               metavar="SECONDS", group=_PROCESSES, key="monitor_interval"),
        Option(name="num_cpu_threads_per_process", type=int, default=None, minimum=1,
               help="OMP_NUM_THREADS for each process (default: 1 when several processes share a machine).",
               flag="--num_cpu_threads_per_process", metavar="T", group=_PROCESSES),
        # ---- other -------------------------------------------------------------------------------------
        Option(name="debug", type=bool, default=False, help="Show the agent's log and Python tracebacks.",
               variable="ANYACCEL_DEBUG", worker=True, flag="--debug", switch=True, group=_OTHER),
    )

if TYPE_CHECKING:  # made when a row is first asked for (_table), not at import (the import budget)
    #: every row, in table order
    OPTIONS: Tuple[Option, ...]
    _BY_NAME: Dict[str, Option]
_MAKING = threading.Lock()


def _table() -> Dict[str, Option]:
    """The rows by name: :func:`_rows` made into ``OPTIONS`` and ``_BY_NAME`` the first time a row
    is asked for (``_BY_NAME`` is stored last: its presence says "made"). Local; once, under a lock."""
    return lazyclass.made_once(globals(), "_BY_NAME", _MAKING, _made_table)


def _made_table() -> Dict[str, Option]:
    """``OPTIONS`` stored, and the rows by name returned (for :func:`_table`, under its lock)."""
    rows = _rows()
    by_name = {row.name: row for row in rows}
    assert len(by_name) == len(rows), "two rows with one name"
    globals()["OPTIONS"] = rows
    return by_name


def _made(name: str) -> Any:
    """``OPTIONS`` and ``_BY_NAME`` made when first asked for (:func:`_table`)."""
    _table()
    return globals()[name]


if not TYPE_CHECKING:  # (hidden from type checkers: a module __getattr__ would type every misspelt name Any)
    __getattr__, __dir__ = lazyclass.module_attributes(__name__, globals(), {
        "OPTIONS": lambda: _made("OPTIONS"), "_BY_NAME": lambda: _made("_BY_NAME"),
        # the type aliases, evaluated when imported (typing's subscriptions cost)
        "Choices": lambda: Union[Tuple[str, ...], Ref], "Check": lambda: Callable[[Any, str], Any]})


def option(name: str) -> Option:
    """The row called ``name``; ``KeyError`` naming the known ones (and a near match)."""
    by_name = _table()
    try:
        return by_name[name]
    except KeyError:
        hint = close_match(name, by_name)
        raise KeyError(f"no option {name!r}{f' (did you mean {hint!r}?)' if hint else ''}; known: "
                       f"{', '.join(by_name)}") from None


def options_with(column: str) -> Tuple[Option, ...]:
    """The rows that have ``column`` (``"flag"``, ``"variable"``, ``"key"``, ``"argument"``,
    ``"worker"``, ``"question"``), in table order; ``"key"`` gives top-level keys only."""
    rows = tuple(row for row in _table().values() if getattr(row, column))
    return tuple(row for row in rows if row.section is None) if column == "key" else rows


def section_rows(section: str) -> Tuple[Option, ...]:
    """The rows whose key sits in the mapping ``section`` (``"parallelism_config"``)."""
    return tuple(row for row in _table().values() if row.section == section)


# ---- checking ------------------------------------------------------------------------------------
class _Refused(Exception):
    """Raised by a special check: the value is refused; ``problem`` is added after it."""

    def __init__(self, problem: str = ""):
        super().__init__(problem)
        self.problem = problem


def choices_of(row: Option) -> Optional[Iterable[str]]:
    """The allowed values of ``row`` (a registry's, read now), or None when not a fixed set."""
    return row.choices.load() if isinstance(row.choices, Ref) else row.choices


def _choices(row: Option) -> Iterable[str]:
    """:func:`choices_of`, ``()`` for None: membership tests only (a lazy container stays lazy)."""
    choices = choices_of(row)
    return () if choices is None else choices


def allowed(row: Option, with_null: bool = False) -> str:
    """What ``row`` accepts, in words (every message and the reference pages use this);
    ``with_null``: say that ``null`` is allowed too where it is (the configuration file's page)."""
    if row.allowed:
        text = row.allowed
    elif row.choices is not None:
        text = "one of " + ", ".join(choices_of(row) or ())
    elif row.type is int:
        lo, hi = row.minimum, row.maximum
        text = f"an integer from {lo:g} to {hi:g}" if lo is not None and hi is not None and lo != hi else \
            f"{hi:g}" if hi is not None and lo == hi else f"an integer >= {lo:g}" if lo is not None else "an integer"
    elif row.type is float:
        text = f"a number > {row.above:g}" if row.above is not None else \
            f"a number >= {row.minimum:g}" if row.minimum is not None else "a number"
    elif row.type is bool:
        text = "true or false"
    elif row.type is dict:
        text = "a mapping"
    else:
        text = "text without spaces"
    return text + (" (or null)" if with_null and row.nullable and row.type is not bool else "")


def close_match(word: Any, known: Iterable[str]) -> Optional[str]:
    """The known word nearest to ``word`` (``difflib``), or None: for "did you mean"."""
    import difflib  # only when a value is refused: not on the way to a working Accelerator

    found = difflib.get_close_matches(str(word), [str(k) for k in known], n=1, cutoff=0.6)
    return found[0] if found else None


def check(row: Option, value: Any, where: str = "", source: Optional[str] = None) -> Any:
    """``value`` for ``row``, normalised (``"FP16"`` -> ``"fp16"``, YAML's ``no`` read as False
    -> ``"no"``, an int for a float -> float, ``gpu_ids: 0`` -> ``"0"``), or
    :class:`~anyaccel.errors.ConfigError` (:func:`refusal`'s wording) with the key
    ``row.name`` (and ``source``, the file). ``where`` names the entry point: ``"key 'x'"``, a
    variable, a flag, an argument. The one check of every option, from every entry point."""
    prefix = f"{where}: " if where else ""
    try:
        return _check(row, value, where)
    except _Refused as refused:
        hint = ""
        choices = choices_of(row) if row.choices is not None else None
        if choices is not None and isinstance(value, str):
            near = close_match(value.strip().lower() if row.type is str else value, choices)
            hint = f" (did you mean {near!r}?)" if near else ""
        raise ConfigError(refusal(where, value, refused.problem, allowed(row) + hint), source=source,
                          key=row.name) from None
    except ConfigError as exc:
        raise ConfigError(exc.message, source=source, key=row.name) from None
    except ValueError as exc:
        raise ConfigError(f"{prefix}{exc}", source=source, key=row.name) from None


def refusal(where: str, value: Any, problem: str, what: str) -> str:
    """The one wording of a refused value: ``"{where} has the value {value!r}{problem}; allowed:
    {what}"`` (``"invalid value ..."`` where the caller names the place itself, as argparse does)."""
    return f"{where + ' has the value' if where else 'invalid value'} {value!r}{problem}; allowed: {what}"


def _check(row: Option, value: Any, where: str) -> Any:
    if value is None:
        if row.nullable:
            return None
        raise _Refused()
    if isinstance(value, str) and row.aliases and value.strip().lower() in row.aliases:
        value = row.aliases[value.strip().lower()]
    if row.special is not None:
        return row.special(value, where)
    kind = row.type
    if kind is str:
        # (never ``choices_of(row) or ()``: the truth value of the strategy registry's lazy
        # choices is its length, which scans every installed package's entry points)
        if value is False and "no" in _choices(row):
            return "no"  # YAML 1.1 reads a bare `no` as False
        if not isinstance(value, str):
            raise _Refused(f" ({_describe(value)})")
        if row.choices is not None:
            choices = _choices(row)
            for text in (value.strip(), value.strip().lower(), value.strip().upper()):
                if text in choices:
                    return text
            raise _Refused()
        if not value.strip() or any(c.isspace() for c in value.strip()):
            raise _Refused()
        return value.strip()
    if kind is bool:
        if isinstance(value, bool):
            return value
        if type(value) is int and value in (0, 1):
            return bool(value)
        raise _Refused(f" ({_describe(value)})")
    if kind is dict:
        if not isinstance(value, Mapping):
            raise _Refused(f" ({_describe(value)})")
        return dict(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not isinstance(value, kind):
        raise _Refused(f" ({_describe(value)})")
    if (kind is float and not math.isfinite(value)) or (row.minimum is not None and not value >= row.minimum) \
            or (row.maximum is not None and value > row.maximum) or (row.above is not None and not value > row.above):
        raise _Refused()
    return value


#: the words a yes/no value may be written with (any case), everywhere
TRUE_WORDS = frozenset({"1", "true", "yes", "on", "y"})
FALSE_WORDS = frozenset({"0", "false", "no", "off", "n"})


def parse_text(row: Option, text: Optional[str], where: str = "") -> Any:
    """The value of ``row`` written as text (a flag's, a variable's), parsed by its type and then
    :func:`check`-ed. Empty text or None is "not set" (None). A mapping is JSON."""
    if text is None or text.strip() == "":
        return None
    value: Any = text.strip()
    try:
        if row.type is bool:
            lowered = value.lower()
            value = True if lowered in TRUE_WORDS else False if lowered in FALSE_WORDS else value
            if isinstance(value, str):
                raise _Refused()
        elif row.type is int:
            value = int(value)
        elif row.type is float:
            value = float(value)
        elif row.type is dict:
            import json

            try:
                value = json.loads(value)
            except ValueError as exc:
                prefix = f"{where}: " if where else ""
                raise ConfigError(f"{prefix}is not valid JSON ({exc}): {text[:200]!r}", key=row.name) from None
    except (ValueError, _Refused):
        raise ConfigError(refusal(where, text, "", allowed(row)), key=row.name) from None
    return check(row, value, where)


def help_text(row: Option, fill: Optional[str] = None) -> str:
    """The row's help, its ``{}`` filled with ``fill`` or else its registry's description
    (``help_from``, read now)."""
    if row.help_from is None:
        return row.help
    return row.help.replace("{}", fill if fill is not None else str(row.help_from.load()))


def flag_names(row: Option) -> Tuple[str, ...]:
    """The row's flag and its dashed spelling (``--num_processes``, ``--num-processes``)."""
    if not row.flag:
        return ()
    dashed = "--" + row.flag[2:].replace("_", "-")
    return (row.flag, dashed) if dashed != row.flag else (row.flag,)


def _describe(value: Any) -> str:
    names = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
             float: "a number", type(None): "nothing"}
    return names.get(type(value), f"a {type(value).__name__}")
