"""Strategies: how a model is wrapped across processes, one room per way of splitting; this module
is their registry, and every choice of a strategy is read from it.

The rooms: ``single.py``, ``ddp.py``, ``xla.py`` (one module each), ``fsdp/`` (FSDP2: options,
sharding, ties), ``deepspeed/`` (ZeRO: options, engine, checkpoints) and the N-D family ``nd/``
(tensor parallel, ``pipeline/``, ``sequence/``, ``expert/``); what they share: ``base.py`` (the
:class:`~.base.Strategy` interface), ``capabilities.py`` (what only some can do), ``mesh.py`` (the
one :class:`~.mesh.ProcessMesh`), ``options.py``, ``compile.py``, ``dcp.py`` (sharded checkpoints,
read by every strategy) and ``loss.py`` (the loss of one global batch). Who may import whom is an
import-linter contract (pyproject.toml): the N-D family above FSDP above the base; DeepSpeed, DDP,
single and XLA above the base only. Module paths of before the rooms
(``anyaccel.strategies.sequence``, ``.pipeline``, ``.deepspeed_config``, ...) still import: each
is its new module (:data:`MOVED_MODULES`).

:func:`create_strategy` picks one per ``Accelerator``: the name asked for, else the backend's
default (XLA replicas on XLA), else DDP for several processes and ``single`` for one. The config
file's ``strategy`` key, ``anyaccel launch --strategy`` and the ``anyaccel config`` questions offer
:func:`selectable_names`; :func:`choose_strategy` is the one rule for options that select their
strategy (FSDP options alone mean ``fsdp``).

Adding a strategy is one file (or package) with a :class:`~.base.Strategy` subclass plus one
registration:

* in-process: ``register_strategy("mine", "my_package.my_module:MyStrategy")`` (or the class itself);
* for ``anyaccel launch`` and the config file, whose processes never import the training script:
  an entry point in the group ``anyaccel.strategies`` of the package that holds it
  (``[project.entry-points."anyaccel.strategies"] mine = "my_package.my_module:MyStrategy"``),
  read the first time a name that is not registered is looked up or the names are listed.

Importing this module imports no torch (the launcher and the config file read it); the strategy
classes are imported when one is created. See docs/extending/strategies.md.
"""

from __future__ import annotations

import importlib
import re
import threading
import warnings
from typing import TYPE_CHECKING, Any, Dict, Iterator, Optional, Tuple, Union

from .. import _redirect_moved_modules, lazyclass

if TYPE_CHECKING:
    from .base import Strategy

__all__ = ["Strategy", "StrategyEntry", "register_strategy", "create_strategy", "strategy_names", "memory_layouts",
           "selectable_names", "strategy_entry", "choose_strategy", "default_strategy", "default_for_processes",
           "describe_strategies", "describe_choices", "StrategyChoices", "ENTRY_POINT_GROUP"]

#: the entry-point group a package declares its strategies in
ENTRY_POINT_GROUP = "anyaccel.strategies"

_NAME = r"^[a-z][a-z0-9_\-]*$"  # (compiled when a name is first checked, not at import)


@lazyclass.dataclass(frozen=True)
class StrategyEntry:
    """One registered strategy.

    ``target``: ``"package.module:Class"`` (imported on first use) or the class. ``summary``: one
    line for ``--help``, the config file's comments and the ``anyaccel config`` question.
    ``spans_processes``: the strategy spreads training over several processes (the question
    offers it for multi-process jobs; ``single`` does not). ``selectable``: offered by the config
    file, ``--strategy`` and the questions (``xla`` is not: the TPU backend picks it).
    ``implied_by_options``: giving this strategy's options without a strategy selects it, and
    giving them with another strategy is an error (FSDP's). ``shards_state``: how ``anyaccel
    estimate-memory`` counts it: True when parameters, gradients and optimizer state are split
    over the processes, False when each process holds a full copy, None when it cannot say (the
    strategy is then not offered there). ``origin``: where it was registered."""

    name: str
    target: Union[str, type]
    summary: str = ""
    spans_processes: bool = True
    selectable: bool = True
    implied_by_options: bool = False
    origin: str = "register_strategy"
    shards_state: Optional[bool] = None

    def load(self) -> type:
        """The strategy class (imports its module). Local."""
        if not isinstance(self.target, str):
            return self.target
        module, _, attr = self.target.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"strategy {self.name!r} ({self.origin}) points to {self.target!r}, which cannot be "
                             f"imported: {exc}") from exc


if TYPE_CHECKING:
    _REGISTRY: Dict[str, StrategyEntry]
_entry_points_read = False
_MAKING = threading.Lock()


def _registry() -> Dict[str, StrategyEntry]:
    """The registry ``{name: entry}``, made with the built-in strategies (:data:`_BUILT_IN`) the
    first time anything reads or registers one (``from anyaccel import Accelerator`` does not:
    the import budget); ``_REGISTRY`` from then on. Local; made once under a lock."""
    return lazyclass.made_once(globals(), "_REGISTRY", _MAKING, lambda: {
        name: _entry(name, target, **fields) for name, target, fields in _BUILT_IN})


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not re.match(_NAME, name) or name == "auto":
        raise ValueError(f"strategy name {name!r}: use lower-case letters, digits, '_' or '-', starting with a "
                         "letter ('auto' is reserved: it means 'decide at run time')")


def register_strategy(name: str, target: Union[str, type], *, summary: str = "", spans_processes: bool = True,
                      selectable: bool = True, implied_by_options: bool = False,
                      shards_state: Optional[bool] = None, replace: bool = False) -> None:
    """Make ``name`` selectable everywhere in this process: ``Accelerator(strategy=name)``, the
    config file, ``--strategy`` (see :class:`StrategyEntry` for the other fields). ``target`` is
    ``"package.module:StrategyClass"`` (imported on use) or the class. Registering a name again
    replaces it, except a built-in one (``single``, ``ddp``, ``fsdp``, ...: ``ValueError``) unless
    ``replace=True``. Local: a launcher started with ``anyaccel launch`` finds strategies of other
    packages through their ``anyaccel.strategies`` entry points instead."""
    _check_name(name)
    if isinstance(target, str) and ":" not in target:
        raise ValueError(f"register_strategy({name!r}, {target!r}): the target must be 'package.module:Class' "
                         "or the class itself")
    registry = _registry()
    current = registry.get(name)
    if current is not None and current.origin == "anyaccel" and not replace and current.target != target:
        raise ValueError(f"register_strategy({name!r}, {target!r}): {name!r} is a built-in strategy "
                         f"({current.target}); choose another name, or pass replace=True to replace it on purpose")
    registry[name] = _entry(name, target, summary=summary, spans_processes=spans_processes, selectable=selectable,
                            implied_by_options=implied_by_options, shards_state=shards_state)


def _entry(name: str, target: Union[str, type], **fields: Any) -> StrategyEntry:
    """The entry :func:`register_strategy` makes (its origin: ``anyaccel`` for a built-in target)."""
    return StrategyEntry(name, target, **fields,
                         origin="anyaccel" if str(target).startswith("anyaccel.") else "register_strategy")


#: the built-in strategies, registered (as by :func:`register_strategy`) when the registry is first used
_BUILT_IN: Tuple[Tuple[str, str, Dict[str, Any]], ...] = (
    ("single", "anyaccel.strategies.single:SingleStrategy", dict(summary="one process, the model as it is",
                                                                  spans_processes=False)),
    ("ddp", "anyaccel.strategies.ddp:DDPStrategy", dict(summary="a full copy per process (DDP)", shards_state=False)),
    ("xla", "anyaccel.strategies.xla:XlaReplicaStrategy", dict(summary="XLA replicas (chosen on TPUs)",
                                                                selectable=False)),
    ("fsdp", "anyaccel.strategies.fsdp.strategy:FSDPStrategy",
     dict(summary="sharded over the processes (FSDP2: for models that do not fit one device)", implied_by_options=True,
          shards_state=True)),
    ("nd", "anyaccel.strategies.nd.strategy:NDStrategy",
     dict(summary="replicas x FSDP shards x tensor parallel on one device mesh (ParallelismConfig)",
          implied_by_options=True, shards_state=True)),
    ("deepspeed", "anyaccel.strategies.deepspeed.strategy:DeepSpeedStrategy",
     # shards_state: by stage (ZeRO-1/2 keep whole parameters), not one answer
     dict(summary="DeepSpeed ZeRO stages 0-3 (DeepSpeedPlugin; needs pip install anyaccel[deepspeed])",
          implied_by_options=True)),
)


def _read_entry_points() -> None:
    """Add the strategies other packages declare (group ``anyaccel.strategies``); once per
    process. A name that is already taken stays with its first owner (a warning names both)."""
    global _entry_points_read
    if _entry_points_read:
        return
    _entry_points_read = True
    from importlib import metadata

    registry = _registry()
    found = metadata.entry_points()
    group = found.select(group=ENTRY_POINT_GROUP) if hasattr(found, "select") else found.get(ENTRY_POINT_GROUP, ())
    for ep in group:
        dist = getattr(getattr(ep, "dist", None), "name", None) or "a package"
        origin = f"entry point of {dist}"
        if ep.name in registry:
            if registry[ep.name].target != ep.value:
                warnings.warn(f"{origin} declares strategy {ep.name!r} = {ep.value!r}, but {ep.name!r} is already "
                              f"{registry[ep.name].target!r} ({registry[ep.name].origin}); the entry point is "
                              "ignored", stacklevel=3)
            continue
        try:
            _check_name(ep.name)
        except ValueError as exc:
            warnings.warn(f"{origin}: {exc}; the entry point is ignored", stacklevel=3)
            continue
        registry[ep.name] = StrategyEntry(ep.name, ep.value, summary=f"from {dist}", origin=origin)


def strategy_entry(name: str) -> Optional[StrategyEntry]:
    """The registered strategy ``name`` (entry points are read when it is not registered in
    this process), or None. Local."""
    if name not in _registry():
        _read_entry_points()
    return _registry().get(name)


def strategy_names() -> Tuple[str, ...]:
    """Every registered name, entry points included, in registration order. Local."""
    _read_entry_points()
    return tuple(_registry())


def selectable_names() -> Tuple[str, ...]:
    """The names the config file, ``--strategy`` and ``anyaccel config`` offer. Local."""
    _read_entry_points()
    return tuple(name for name, entry in _registry().items() if entry.selectable)


def memory_layouts() -> Dict[str, bool]:
    """``{name: shards_state}`` of every selectable strategy that says how it holds the model's
    state (``anyaccel estimate-memory``'s ``--layout`` choices). Local."""
    _read_entry_points()
    return {name: e.shards_state for name, e in _registry().items() if e.selectable and e.shards_state is not None}


class StrategyChoices:
    """``"auto"`` and the selectable strategy names, as a lazy container: ``in`` reads the
    entry points only for a name not registered in this process, so a launcher given
    ``--strategy ddp`` never scans the installed packages. argparse and the config schema take it
    as their ``choices``."""

    def __contains__(self, name: object) -> bool:
        if name == "auto":
            return True
        entry = strategy_entry(name) if isinstance(name, str) else None
        return entry is not None and entry.selectable

    def __iter__(self) -> Iterator[str]:
        return iter(("auto",) + selectable_names())

    def __len__(self) -> int:
        return 1 + len(selectable_names())

    def __repr__(self) -> str:
        return f"StrategyChoices({', '.join(self)})"


def describe_strategies() -> str:
    """``"ddp (a full copy per process (DDP)), fsdp (...), ..."`` for help texts. Local."""
    _read_entry_points()
    return ", ".join(f"{e.name} ({e.summary})" if e.summary else e.name for e in _registry().values() if e.selectable)


def describe_choices() -> str:
    """``"auto, single (...), ddp (...), ..."``: every value a ``strategy`` option takes, for the
    option table's help (the config file's comments, the reference page). Local."""
    return f"auto, {describe_strategies()}"


def choose_strategy(requested: Optional[str], options_for: Optional[str] = None,
                    options_source: str = "options") -> Optional[str]:
    """The one rule for options that select a strategy. ``requested``: the name asked for
    (``None`` or ``"auto"``: decided at run time); ``options_for``: the strategy whose options
    were given (:attr:`~.options.StrategyOptions.strategy`), if any; ``options_source``: how they
    were given, for the message (``"fsdp_plugin"``, ``"key 'fsdp_config'"``). Returns the name,
    or None for "decide at run time". Options of a strategy registered with
    ``implied_by_options`` (FSDP's) select it when nothing else is asked for, and contradict
    another strategy (``ValueError``). Pure and local; used by ``Accelerator``, the config schema
    and ``anyaccel launch``."""
    requested = None if requested in (None, "auto") else requested
    entry = strategy_entry(options_for) if options_for else None
    if entry is None or not entry.implied_by_options:
        return requested
    if requested is None:
        return entry.name
    if requested != entry.name:
        raise ValueError(f"{options_source} is set but strategy is {requested}; {options_source} configures "
                         f"strategy {entry.name}: use strategy {entry.name} (or auto), or drop {options_source}")
    return requested


def default_strategy(env: Any, backend: Any) -> str:
    """The strategy used when none is asked for: the backend's own (XLA: ``xla``), else ``ddp``
    for several processes and ``single`` for one. Local."""
    return getattr(backend, "default_strategy", None) or default_for_processes(env.world_size)


def default_for_processes(world_size: int) -> str:
    """What ``auto`` means on devices without a strategy of their own: ``ddp`` for several
    processes, ``single`` for one. Local."""
    return "ddp" if world_size > 1 else "single"


def create_strategy(env: Any, backend: Any, name: Optional[str] = None, options: Any = None,
                    mixed_precision: str = "no", dynamo: Any = None, handlers: Any = None) -> "Strategy":
    """The strategy ``name`` (None or ``"auto"``: :func:`default_strategy`) for this job, configured by
    ``options`` (an instance of the class's ``options_type``; None: its defaults),
    ``mixed_precision`` (the accelerator's setting) and ``dynamo`` (its compile options).
    ``handlers``: objects given in Accelerate's formats (``kwargs_handlers``, plugins), of which
    the one whose ``to_options()`` configures this strategy is used when ``options`` is None.
    Local. Raises ``ValueError`` naming the known strategies for an unknown name, ``TypeError``
    for options of another strategy."""
    name = default_strategy(env, backend) if name in (None, "", "auto") else name
    entry = strategy_entry(name)
    if entry is None:
        raise ValueError(f"strategy={name!r} is unknown; choose one of {', '.join(StrategyChoices())}")
    cls = entry.load()
    if options is None:
        options = strategy_options(cls, handlers)
    return cls(env, backend, options=options, mixed_precision=mixed_precision, dynamo=dynamo)


def strategy_options(cls: type, given: Any) -> Any:
    """The options for strategy class ``cls`` among ``given`` (objects with ``to_options()``, e.g.
    ``DistributedDataParallelKwargs``, ``FullyShardedDataParallelPlugin``; a dict of them by type
    is accepted too), or None. Local."""
    wanted = getattr(cls, "options_type", None)
    if not given:
        return None
    found = None
    for obj in (given.values() if isinstance(given, dict) else given):
        convert = getattr(obj, "to_options", None)
        options = convert() if callable(convert) else obj
        if wanted is not None and found is None and isinstance(options, wanted):
            found = options
        elif callable(getattr(options, "comm_hook_spec", None)) and options.comm_hook_spec() is not None:
            _warn_hook_not_registered(cls, options)
    return found


def _warn_hook_not_registered(cls: type, options: Any) -> None:
    """A DDP communication hook asked for in a job that DDP does not wrap (one process, FSDP...)."""
    import warnings

    warnings.warn(f"DistributedDataParallelKwargs(comm_hook={options.comm_hook!r}) has no effect: this job uses the "
                  f"{getattr(cls, 'name', cls.__name__)!r} strategy, not DDP, so no communication hook is registered "
                  "(DDP wraps the model only with several processes)", stacklevel=5)


def _strategy_class() -> Any:
    """``anyaccel.strategies.Strategy``: imports torch, so only when asked for."""
    from .base import Strategy

    return Strategy


if not TYPE_CHECKING:  # (hidden from type checkers: a module __getattr__ would type every misspelt name Any)
    __getattr__, __dir__ = lazyclass.module_attributes(__name__, globals(), {"Strategy": _strategy_class,
                                                                             "_REGISTRY": _registry})


# ---- module paths of before the rooms ------------------------------------------------------------
#: every module path the strategies had before they became packages, and the module it is now;
#: ``import anyaccel.strategies.sequence`` gives ``anyaccel.strategies.nd.sequence.ulysses`` itself
#: (the same object: names, classes and monkeypatches are shared)
MOVED_MODULES = {
    "anyaccel.strategies.sharding": "anyaccel.strategies.fsdp.sharding",
    "anyaccel.strategies.ties": "anyaccel.strategies.fsdp.ties",
    "anyaccel.strategies.deepspeed_config": "anyaccel.strategies.deepspeed.config",
    "anyaccel.strategies.deepspeed_engine": "anyaccel.strategies.deepspeed.engine",
    "anyaccel.strategies.deepspeed_checkpoint": "anyaccel.strategies.deepspeed.checkpoint",
    "anyaccel.strategies.deepspeed_convert": "anyaccel.strategies.deepspeed.convert",
    "anyaccel.strategies.pipeline": "anyaccel.strategies.nd.pipeline.schedule",
    "anyaccel.strategies.pipeline_split": "anyaccel.strategies.nd.pipeline.split",
    "anyaccel.strategies.pipeline_ties": "anyaccel.strategies.nd.pipeline.ties",
    "anyaccel.strategies.pipeline_strategy": "anyaccel.strategies.nd.pipeline.strategy",
    "anyaccel.strategies.sequence": "anyaccel.strategies.nd.sequence.ulysses",
    "anyaccel.strategies.sequence_transformers": "anyaccel.strategies.nd.sequence.transformers",
}


_redirect_moved_modules(MOVED_MODULES)
