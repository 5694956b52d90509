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
lock (two threads' first use make it once; see _make for the one window left). Standard library only.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Set, Tuple, Type, TypeVar

__all__ = ["dataclass", "pending", "made_once", "module_attributes"]

T = TypeVar("T")
_LOCK = threading.RLock()
_STANDS_IN = "__anyaccel_stands_in__"  # the names the stand-ins took, and the dataclass parameters


def _make(cls: type) -> type:
    """Make the lazy dataclass that ``cls`` is or inherits from (the first in its MRO whose own
    stand-ins are still there); returns it.

    ``__dataclass_fields__`` and ``__signature__`` stay in place while ``dataclasses.dataclass`` runs
    (it overwrites the fields; the signature goes after): another thread's ``fields``,
    ``is_dataclass`` or ``inspect.signature`` waits for the lock. So does the stand-in ``__init__``
    when other threads are alive: the class is made with ``init=False`` and its generated ``__init__``
    (:func:`_made_init`) then replaces the stand-in in one store, so another thread's first instance
    never meets a class without one (alone, as in an import, the dataclass writes it: half the cost). The other stand-ins (``__repr__``, ``__eq__``, frozen ``__setattr__``) go before the
    dataclass writes its own; only an instance that skipped ``__init__`` (unpickled) could call one
    in that millisecond."""
    with _LOCK:
        for owner in cls.__mro__:
            pending_ = owner.__dict__.get(_STANDS_IN)
            if pending_ is None:
                continue
            if owner in _MAKING:  # (this thread, inside dataclasses.dataclass(owner))
                return owner
            names, params, defaults = pending_
            # another thread alive (any with Python state): its first instance must never meet the
            # class without an __init__; alone (an import), the dataclass writes it directly
            init = params.get("init", True) and len(sys._current_frames()) > 1
            for name in names:
                if name not in _KEPT and not (init and name == "__init__"):
                    delattr(owner, name)
            for name, value in defaults.items():  # the class body's dataclasses.field(...) objects back
                setattr(owner, name, value)
            _MAKING.add(owner)
            try:
                dataclasses.dataclass(owner, **{**params, "init": False} if init else params)
                if init:  # the stand-in __init__ replaced in one store: no moment without one
                    owner.__init__ = _made_init(owner, params)  # type: ignore[misc]
            finally:
                _MAKING.discard(owner)
            if "__signature__" in names:  # (the dataclass wrote __dataclass_fields__)
                delattr(owner, "__signature__")
            delattr(owner, _STANDS_IN)
            return owner
        return cls


_KEPT = ("__dataclass_fields__", "__signature__")  # in place while the class is made


def _made_init(owner: type, params: Dict[str, Any]) -> Callable[..., None]:
    """The ``__init__`` ``dataclasses.dataclass`` generates for ``owner`` (already made with
    ``init=False``): generated for a throwaway subclass without fields of its own (so the same
    fields, defaults, ``InitVar`` fields, ``kw_only`` and ``__post_init__`` call; the generated code names
    no class), then given ``owner``'s name."""
    twin = type(owner.__name__, (owner,), {"__module__": owner.__module__, "__qualname__": owner.__qualname__,
                                          "__doc__": owner.__doc__})
    made: type = dataclasses.dataclass(twin, init=True, repr=False, eq=False, match_args=False,
                                 frozen=params.get("frozen", False))
    fn: Callable[..., None] = made.__dict__["__init__"]
    fn.__qualname__ = f"{owner.__qualname__}.__init__"
    return fn


_MAKING: Set[type] = set()


class _MadeOnRead:
    """A class attribute that the dataclass will set (``__match_args__``, ``__dataclass_params__``) or
    that a field's ``dataclasses.field(...)`` holds until then: reading it from the class makes the
    class and reads the made one (an instance's own value comes first: a non-data descriptor)."""

    def __init__(self, name: str, holder: type) -> None:
        self.name, self.holder = name, holder

    def __get__(self, instance: Any, owner: type) -> Any:
        _make(owner)
        if self.holder in _MAKING:
            raise AttributeError(self.name)
        return getattr(owner if instance is None else instance, self.name)


class _Fields:
    """``__dataclass_fields__`` until the class is made: reading it makes the class."""

    def __init__(self, holder: type) -> None:
        self.holder = holder

    def __get__(self, instance: Any, owner: type) -> Dict[str, dataclasses.Field[Any]]:
        _make(owner)
        if self.holder in _MAKING:  # (dataclasses.dataclass of the holder reads it: not one yet)
            raise AttributeError("__dataclass_fields__")
        return owner.__dataclass_fields__  # type: ignore[attr-defined,no-any-return]


class _Signature:
    """``__signature__`` until the class is made: ``inspect.signature`` of the class makes it first
    (the stand-in ``__init__`` takes anything)."""

    def __init__(self, holder: type) -> None:
        self.holder = holder

    def __get__(self, instance: Any, owner: type) -> Any:
        import inspect

        if instance is not None:
            raise AttributeError("__signature__")
        _make(owner)
        if self.holder in _MAKING:  # (dataclasses.dataclass of the holder writing its __doc__)
            raise AttributeError("__signature__")
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
        # what the dataclass will do: None where it sets None (eq, not frozen, no unsafe_hash), so that
        # collections.abc.Hashable and hash() answer as they will
        none = params.get("eq", True) and not params.get("frozen", False) and not params.get("unsafe_hash", False)
        methods["__hash__"] = None if none else __hash__
    if params.get("frozen", False):
        methods["__setattr__"], methods["__delattr__"] = __setattr__, __delattr__
    out = {name: fn for name, fn in methods.items() if name not in own}
    for name, fn in out.items():
        if fn is not None:
            fn.__qualname__ = f"{cls.__qualname__}.{name}"
    out["__dataclass_fields__"] = _Fields(cls)
    out["__signature__"] = _Signature(cls)
    for name in ("__match_args__", "__dataclass_params__"):
        out[name] = _MadeOnRead(name, cls)
    for name, value in own.items():  # a field's dataclasses.field(...): its default, or none, once made
        if isinstance(value, dataclasses.Field):
            out[name] = _MadeOnRead(name, cls)
    return out


def _lazy(cls: Type[T], params: Dict[str, Any]) -> Type[T]:
    if params.get("slots") or params.get("order") or "__init__" in cls.__dict__:
        return dataclasses.dataclass(cls, **params)
    defaults = {name: value for name, value in cls.__dict__.items() if isinstance(value, dataclasses.Field)}
    stand_ins = _stand_ins(cls, params)
    for name, value in stand_ins.items():
        setattr(cls, name, value)
    setattr(cls, _STANDS_IN, (tuple(stand_ins), params, defaults))
    return cls


def pending(cls: type) -> bool:
    """Whether ``cls`` (or a lazy dataclass it inherits from) is not made yet. Local."""
    return any(_STANDS_IN in c.__dict__ for c in cls.__mro__)


def _dataclass(cls: Any = None, /, **params: Any) -> Any:
    """``dataclasses.dataclass``, made on first use (see the module). Local."""
    if cls is None:
        return lambda c: _lazy(c, params)
    return _lazy(cls, params)


def made_once(namespace: Dict[str, Any], name: str, lock: Any, make: Callable[[], T]) -> T:
    """``namespace[name]`` (a module's ``globals()``), made by ``make()`` and stored there the first
    time it is asked for — the same lazy idea for a module's registry or table (the strategies',
    backends' and devices' registries, the option table): not made at import, made once whichever
    thread asks first (double-checked under ``lock``, the module's own, so a registry made while
    another module's is being made takes no lock twice), a plain module attribute from then on.
    ``make`` must not ask for ``name`` again. Local."""
    value = namespace.get(name)
    if value is None:
        with lock:
            value = namespace.get(name)
            if value is None:
                value = make()
                namespace[name] = value
    return value


def module_attributes(module: str, namespace: Dict[str, Any], made: Dict[str, Callable[[], Any]]
                      ) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """A module's ``__getattr__`` and ``__dir__`` (PEP 562) for the names it makes on first use:
    ``made`` maps each name to what makes it (a registry's maker stores it in the module's
    globals, :func:`made_once`, where Python finds it from then on; a type alias is made at each
    ask); any other name raises ``AttributeError`` as a plain module does, and ``dir()`` lists the
    made names before they are made. Assign both inside ``if not TYPE_CHECKING:`` (a module
    ``__getattr__`` seen by type checkers types every misspelt name ``Any``). Local."""

    def __getattr__(name: str) -> Any:
        make = made.get(name)
        if make is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return make()

    def __dir__() -> List[str]:
        return sorted(set(namespace) | set(made))

    return __getattr__, __dir__


if TYPE_CHECKING:
    from dataclasses import dataclass as dataclass
else:
    dataclass = _dataclass
