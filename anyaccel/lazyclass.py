"""Dataclasses made on first use: ``@lazyclass.dataclass(...)`` is ``@dataclasses.dataclass(...)``,
except that the generated methods are made when the class is first used, not at import.

Why: making a dataclass ``exec``\\ s the source of its ``__init__``, ``__repr__``, ``__eq__``,
``__hash__`` and, frozen, ``__setattr__``/``__delattr__`` — about a millisecond per class. The
classes ``from anyaccel import Accelerator`` defined made half of its import time (25 classes, most
of them options objects a script builds later or never: Accelerate's kwargs handlers, the
checkpoint and loader configurations).

What stays true: the class *is* a dataclass, whatever is asked first. Its first instance, its
``__dataclass_fields__`` (``dataclasses.fields``, ``is_dataclass``, ``asdict``, ``replace``, a
dataclass subclass), ``inspect.signature`` of the class, or a comparison, ``repr`` or ``hash`` of an
instance made without ``__init__`` (unpickled) makes it — by ``dataclasses.dataclass`` itself, with
the class body exactly as written, so the result is the class an eager ``@dataclass`` makes (the
same object, methods, frozen behaviour, ``__match_args__``, docstring). Until then, the class holds
stand-ins for the methods the dataclass will generate, which make it and call the made method.

Not for ``slots=True`` (the dataclass would be a new class) nor ``order=True``; a class that writes
its own ``__init__`` is made eagerly. Type checkers see ``dataclasses.dataclass``. Local; made under a
lock (two threads' first use make it once). Standard library only.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, Type, TypeVar

__all__ = ["dataclass", "pending"]

T = TypeVar("T")
_LOCK = threading.RLock()
_STANDS_IN = "__anyaccel_stands_in__"  # the names the stand-ins took, and the dataclass parameters


def _make(cls: type) -> type:
    """Make the lazy dataclass that ``cls`` is or inherits from (the first in its MRO whose own
    stand-ins are still there); returns it."""
    with _LOCK:
        for owner in cls.__mro__:
            pending_ = owner.__dict__.get(_STANDS_IN)
            if pending_ is None:
                continue
            names, params = pending_
            for name in names:
                delattr(owner, name)
            delattr(owner, _STANDS_IN)
            dataclasses.dataclass(owner, **params)
            return owner
        return cls


class _Fields:
    """``__dataclass_fields__`` until the class is made: reading it makes the class."""

    def __get__(self, instance: Any, owner: type) -> Dict[str, dataclasses.Field[Any]]:
        _make(owner)
        return owner.__dataclass_fields__  # type: ignore[attr-defined,no-any-return]


class _Signature:
    """``__signature__`` until the class is made: ``inspect.signature`` of the class makes it first
    (the stand-in ``__init__`` takes anything)."""

    def __get__(self, instance: Any, owner: type) -> Any:
        import inspect

        if instance is not None:
            raise AttributeError("__signature__")
        _make(owner)
        return inspect.signature(owner)


def _stand_ins(cls: type, params: Dict[str, Any]) -> Dict[str, Any]:
    """The methods the dataclass will generate (those the class body does not write), each making
    the class and calling the made method on the class that had the stand-in."""
    own = cls.__dict__

    def made(name: str) -> Callable[..., Any]:
        return getattr(_make(cls), name)  # type: ignore[no-any-return]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        made("__init__")(self, *args, **kwargs)

    def __repr__(self: Any) -> str:
        return made("__repr__")(self)  # type: ignore[no-any-return]

    def __eq__(self: Any, other: Any) -> Any:
        return made("__eq__")(self, other)

    def __hash__(self: Any) -> int:
        method = made("__hash__")
        if method is None:
            raise TypeError(f"unhashable type: {cls.__name__!r}")
        return method(self)  # type: ignore[no-any-return]

    def __setattr__(self: Any, name: str, value: Any) -> None:
        made("__setattr__")(self, name, value)

    def __delattr__(self: Any, name: str) -> None:
        made("__delattr__")(self, name)

    methods: Dict[str, Any] = {"__init__": __init__}
    if params.get("repr", True):
        methods["__repr__"] = __repr__
    if params.get("eq", True):
        methods["__eq__"] = __eq__
    if "__hash__" not in own:  # (a body that writes __eq__ has __hash__ = None here: the dataclass decides)
        methods["__hash__"] = __hash__
    if params.get("frozen", False):
        methods["__setattr__"], methods["__delattr__"] = __setattr__, __delattr__
    out = {name: fn for name, fn in methods.items() if name not in own}
    for name, fn in out.items():
        fn.__qualname__ = f"{cls.__qualname__}.{name}"
    out["__dataclass_fields__"] = _Fields()
    out["__signature__"] = _Signature()
    return out


def _lazy(cls: Type[T], params: Dict[str, Any]) -> Type[T]:
    if params.get("slots") or params.get("order") or "__init__" in cls.__dict__:
        return dataclasses.dataclass(cls, **params)
    stand_ins = _stand_ins(cls, params)
    for name, value in stand_ins.items():
        setattr(cls, name, value)
    setattr(cls, _STANDS_IN, (tuple(stand_ins), params))
    return cls


def pending(cls: type) -> bool:
    """Whether ``cls`` (or a lazy dataclass it inherits from) is not made yet. Local."""
    return any(_STANDS_IN in c.__dict__ for c in cls.__mro__)


def _dataclass(cls: Any = None, /, **params: Any) -> Any:
    """``dataclasses.dataclass``, made on first use (see the module). Local."""
    if cls is None:
        return lambda c: _lazy(c, params)
    return _lazy(cls, params)


if TYPE_CHECKING:
    from dataclasses import dataclass as dataclass
else:
    dataclass = _dataclass
