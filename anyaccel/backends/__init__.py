"""Device backends: one module per device type, chosen once from the resolved Environment.

The registry below maps a device type to its :class:`~anyaccel.backends.base.Backend` class
(imported only when used: ``import anyaccel`` loads none of them, and only
:mod:`anyaccel.backends.xla` imports torch-xla) and to a cheap test of whether that device's
runtime is started in this process (for per-process work such as RNG states and ``set_seed``).

The registry also answers what the rest of anyaccel needs to know about devices, so that no module
outside the device seam names one: which device types exist (:func:`device_types`), which
mixed precisions each runs (:func:`precisions`), which RNG types, profiler activities and storage
they have (:func:`rng_types`, :func:`profiler_activities`, :func:`has_storage`). The answers come
from the :class:`~anyaccel.devices.DeviceFacts` registered with each device in
:mod:`anyaccel.devices`, the low half of the seam that the environment (a lower layer) reads to
choose the device and its communication backend.

Adding a device (say Intel XPU) is one new file, ``backends/xpu.py`` with an ``XpuBackend``
subclass, and one :func:`register_backend` call with its :class:`~anyaccel.devices.DeviceFacts`
(its probe, communication backend, precisions, ...).
"""

from __future__ import annotations

import importlib
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Type

from .. import lazyclass
from ..environment.devices import DeviceFacts, cuda_initialized, device_facts, known_devices, mps_available, register_device

__all__ = ["register_backend", "backend_class", "create_backend", "started_backends", "transport_for",
           "indexed_device_type", "accelerator_available", "device_available", "named_map_devices", "free_memory",
           "active_transport", "device_types", "precisions", "precisions_by_config_name", "config_device_names",
           "config_device", "rng_types",
           "profiler_activities", "default_profiler_activities", "has_storage", "DeviceFacts"]


@lazyclass.dataclass(frozen=True)
class _Entry:
    target: str  # "module:Class"
    runtime_started: Callable[[], bool]
    transport: str  # "module:Class" of its collective transport


if TYPE_CHECKING:
    _REGISTRY: Dict[str, _Entry]
_MAKING = threading.Lock()


def _registry() -> Dict[str, _Entry]:
    """The registry ``{device type: entry}``, made with the built-in backends (:data:`_BUILT_IN`)
    the first time anything reads or registers one (not at import: the import budget);
    ``_REGISTRY`` from then on. Local; made once under a lock."""
    return lazyclass.made_once(globals(), "_REGISTRY", _MAKING, lambda: {
        device_type: _Entry(target, runtime_started, transport)
        for device_type, target, runtime_started, transport in _BUILT_IN})


if not TYPE_CHECKING:  # (hidden from type checkers: a module __getattr__ would type every misspelt name Any)
    __getattr__, __dir__ = lazyclass.module_attributes(__name__, globals(), {"_REGISTRY": _registry})


_C10D = "anyaccel.backends.transport:C10dTransport"


def register_backend(device_type: str, target: str, runtime_started: Callable[[], bool],
                     transport: str = _C10D, facts: Optional[DeviceFacts] = None) -> None:
    """Make ``device_type`` known: ``target`` is ``"package.module:BackendClass"``;
    ``runtime_started()`` must answer cheaply, without importing the device's runtime; ``transport``
    names the :class:`~anyaccel.backends.transport.Transport` its tensors travel on (default:
    torch.distributed); ``facts``: what the environment needs to choose it (its probe,
    communication backend, precisions, ...; the built-in devices' are in :mod:`anyaccel.devices`).
    Register before the environment is resolved. Local."""
    if facts is not None:
        if facts.device_type != device_type:
            raise ValueError(f"register_backend({device_type!r}, facts=DeviceFacts({facts.device_type!r}, ...)): "
                             "the two device types must be the same")
        register_device(facts)
    _registry()[device_type] = _Entry(target, runtime_started, transport)


def _never_started() -> bool:
    return False


def _xla_started() -> bool:
    return "torch_xla" in sys.modules


#: the built-in backends ``(device type, target, runtime_started, transport)``, registered (as by
#: :func:`register_backend`) when the registry is first used; their device facts are
#: :mod:`anyaccel.devices`'s
_BUILT_IN: Tuple[Tuple[str, str, Callable[[], bool], str], ...] = (
    ("cpu", "anyaccel.backends.cpu:CpuBackend", _never_started, _C10D),
    ("cuda", "anyaccel.backends.cuda:CudaBackend", cuda_initialized, _C10D),
    ("mps", "anyaccel.backends.mps:MpsBackend", mps_available, _C10D),
    ("xla", "anyaccel.backends.xla:XlaBackend", _xla_started, "anyaccel.backends.xla:XlaTransport"),
)


def _load(target: str) -> Any:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def backend_class(device_type: str) -> Type[Any]:
    """The Backend class for ``device_type``; ``ValueError`` naming the known types otherwise."""
    registry = _registry()
    entry = registry.get(device_type)
    if entry is None:
        raise ValueError(f"no anyaccel backend for device type {device_type!r}; known: {', '.join(sorted(registry))}")
    cls: Type[Any] = _load(entry.target)
    return cls


def create_backend(env: Any) -> Any:
    """The backend for ``env.device_type`` (not set up yet: call its ``setup()``). Local."""
    return backend_class(env.device_type)(env)


def started_backends() -> List[Type[Any]]:
    """Backend classes whose device runtime is started in this process (for RNG states, seeding,
    cache emptying). Local; imports nothing that is not loaded already."""
    return [_load(e.target) for e in _registry().values() if e.runtime_started()]


_TRANSPORTS: Dict[str, Any] = {}


def transport_for(device_type: str) -> Any:
    """The collective transport that tensors on ``device_type`` travel on (stateless; one object
    per transport class is kept). Unknown device types use torch.distributed."""
    # (every collective asks: the registry read without a call once it is made)
    entry = (globals().get("_REGISTRY") or _registry()).get(device_type)
    target = entry.transport if entry is not None else _C10D
    transport = _TRANSPORTS.get(target)
    if transport is None:
        transport = _TRANSPORTS[target] = _load(target)()
    return transport


def active_transport() -> Any:
    """The transport of the job this process is in, for collectives without tensors (objects,
    barriers): a torch.distributed group when one exists, else a started runtime with several
    replicas (XLA), else torch.distributed's (which then answers "one process")."""
    c10d = transport_for("cpu")
    if c10d.is_active():
        return c10d
    for device_type, entry in (globals().get("_REGISTRY") or _registry()).items():
        if entry.transport != _C10D and entry.runtime_started():
            transport = transport_for(device_type)
            if transport.is_active():
                return transport
    return c10d


# --------------------------------------------------------------------------------------------
# What the rest of anyaccel asks about devices
# --------------------------------------------------------------------------------------------

# Accelerate's ``rng_types`` names for devices anyaccel has no backend for: accepted (and, as every
# rng_types value, not needed: prepared loaders share one seed).
_ACCELERATE_ONLY_RNG_NAMES = ("npu", "xpu")


def device_types() -> Tuple[str, ...]:
    """Every registered device type, most preferred first."""
    return tuple(f.device_type for f in known_devices())


def precisions(device_type: str) -> Tuple[str, ...]:
    """The mixed precisions ``device_type`` runs, most useful first (``ValueError`` when unknown)."""
    return device_facts(device_type).precisions


def precisions_by_config_name() -> Dict[str, Tuple[str, ...]]:
    """``{config-file device name: its precisions}`` for every device with a config name
    (``"gpu"``, ``"tpu"``, ...), most preferred first."""
    return {f.config_name: f.precisions for f in known_devices() if f.config_name}


def config_device_names() -> Tuple[str, ...]:
    """The names the configuration file, the wizard and the launch planner use for the registered
    devices (``DeviceFacts.config_name``: ``"cpu"``, ``"gpu"``, ...), the CPU first and the most
    preferred last; ``"auto"`` is not one of them. Local."""
    return tuple(f.config_name for f in reversed(known_devices()) if f.config_name)


def config_device(name: str) -> Optional[DeviceFacts]:
    """The facts of the device the config name ``name`` means (``"gpu"``: CUDA's), None for
    ``"auto"`` and names no registered device has. Local."""
    return next((f for f in known_devices() if f.config_name == name), None)


def rng_types() -> Tuple[str, ...]:
    """The ``rng_types`` names Accelerate accepts that anyaccel accepts too."""
    names = [n for f in sorted(known_devices(), key=lambda f: f.preference) for n in f.rng_names]
    names += _ACCELERATE_ONLY_RNG_NAMES
    return tuple(dict.fromkeys(sorted(names, key=lambda n: n == "generator")))  # "generator" last


def profiler_activities() -> Tuple[str, ...]:
    """The activity names ``torch.profiler`` knows in this torch (lower case)."""
    import torch.profiler

    return tuple(name.lower() for name in torch.profiler.ProfilerActivity.__members__)


def default_profiler_activities(device_type: str) -> List[str]:
    """What the profiler records by default in a process on ``device_type``: the CPU and that
    device, when the profiler has an activity for it."""
    wanted = [device_facts("cpu").profiler_activity or "cpu"]
    facts = _facts_or_none(device_type)
    if facts is not None and facts.profiler_activity and facts.profiler_activity not in wanted:
        wanted.append(facts.profiler_activity)
    return wanted


def has_storage(device_type: str) -> bool:
    """Whether tensors on ``device_type`` expose a storage pointer (torch's ``meta`` tensors do
    not; unknown device types are assumed to)."""
    if device_type == "meta":
        return False
    facts = _facts_or_none(device_type)
    return facts.has_storage if facts is not None else True


def indexed_device_type() -> str:
    """The device type a big-model device map's integer keys (``0``, ``1``, ...) mean: the most
    preferred device type used by index that has devices here, else the most preferred one
    registered (``0`` then still means a GPU, and fails as one would). Local."""
    indexed = [f for f in known_devices() if f.indexed]
    if not indexed:
        raise ValueError("no registered device type is used by index; a device map cannot use integer keys")
    return next((f for f in indexed if f.count() > 0), indexed[0]).device_type


def accelerator_available() -> bool:
    """Whether a device used by index (a GPU) is visible here; asked without starting its
    runtime. Local."""
    return any(f.indexed and f.count() > 0 for f in known_devices())


def device_available(device_type: str) -> bool:
    """Whether ``device_type`` is registered and has devices here (False for unknown types,
    such as Accelerate's devices anyaccel has no backend for). Local."""
    facts = _facts_or_none(device_type)
    return bool(facts is not None and facts.count() > 0)


def named_map_devices() -> Tuple[str, ...]:
    """The device types a device map names by type rather than index (``"mps"``), most
    preferred first; the CPU and ``"disk"`` come after them. Local."""
    return tuple(f.device_type for f in known_devices() if not f.indexed and f.device_type != "cpu"
                 and not f.selected_by)


def free_memory() -> Dict[Any, int]:
    """Free bytes of every device a device map can fill, in the order an auto map fills them:
    each device used by index (key: its index), then the named devices whose memory torch
    reports (key: the type). The CPU is not included. Local; asks each device's runtime (on a
    GPU this initialises CUDA)."""
    found: Dict[Any, int] = {}
    kind = indexed_device_type()
    facts = device_facts(kind)
    if facts.memory is not None:
        for index in range(facts.count()):
            found[index] = facts.memory(index)[0]
    for name in named_map_devices():
        named = device_facts(name)
        if named.memory is not None and named.count() > 0:
            found[name] = named.memory(0)[0]
    return found


def _facts_or_none(device_type: str) -> Optional[DeviceFacts]:
    try:
        return device_facts(device_type)
    except ValueError:
        return None
