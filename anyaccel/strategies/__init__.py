"""Strategies: how a model is wrapped across processes, one module per way.

:func:`create_strategy` picks one per ``Accelerator``: the name asked for, else the backend's
default (XLA replicas on XLA), else DDP for several processes and ``single`` for one.

Adding a strategy (FSDP2 was added this way: ``fsdp.py``) is one new file with a :class:`~.base.Strategy`
subclass plus one :func:`register_strategy` line here; ``Accelerator(strategy=name)`` then selects it.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, Optional

from .base import Strategy

__all__ = ["Strategy", "register_strategy", "create_strategy", "strategy_names"]

_REGISTRY: Dict[str, str] = {}


def register_strategy(name: str, target: str) -> None:
    """Make ``name`` selectable; ``target`` is ``"package.module:StrategyClass"`` (imported on use)."""
    _REGISTRY[name] = target


register_strategy("single", "anyaccel.strategies.single:SingleStrategy")
register_strategy("ddp", "anyaccel.strategies.ddp:DDPStrategy")
register_strategy("xla", "anyaccel.strategies.xla:XlaReplicaStrategy")
register_strategy("fsdp", "anyaccel.strategies.fsdp:FSDPStrategy")


def strategy_names() -> tuple:
    return tuple(_REGISTRY)


def default_strategy(env: Any, backend: Any) -> str:
    """The strategy used when none is asked for."""
    own = getattr(backend, "default_strategy", None)
    if own:
        return own
    return "ddp" if env.world_size > 1 else "single"


def create_strategy(env: Any, backend: Any, name: Optional[str] = None, handlers: Optional[Dict[type, Any]] = None,
                    mixed_precision: str = "no", dynamo: Any = None) -> Strategy:
    """The strategy ``name`` (default: :func:`default_strategy`) for this job; ``handlers`` are the
    ``Accelerator``'s options by type (kwargs handlers, plugins), ``mixed_precision`` its setting,
    ``dynamo`` its compile options. Local. Raises ``ValueError`` naming the known strategies for an
    unknown name."""
    name = name or default_strategy(env, backend)
    target = _REGISTRY.get(name)
    if target is None:
        raise ValueError(f"strategy={name!r} is unknown; choose one of {', '.join(_REGISTRY)}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(env, backend, handlers=handlers,
                                                         mixed_precision=mixed_precision, dynamo=dynamo)
