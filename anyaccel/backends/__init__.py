"""Device backends: one module per device type, chosen once from the resolved Environment.

The registry below maps a device type to its :class:`~anyaccel.backends.base.Backend` class
(imported only when used: ``import anyaccel`` loads none of them, and only
:mod:`anyaccel.backends.xla` imports torch-xla) and to a cheap test of whether that device's
runtime is started in this process (for per-process work such as RNG states and ``set_seed``).

Adding a device (say Intel XPU) is one new file, ``backends/xpu.py`` with an ``XpuBackend``
subclass, plus its detection: a probe in :mod:`anyaccel.devices` that the environment uses to pick
it, and one :func:`register_backend` line here.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import Any, Callable, Dict, List, Type

from ..devices import cuda_initialized, mps_available

__all__ = ["register_backend", "backend_class", "create_backend", "started_backends", "transport_for",
           "active_transport"]


@dataclasses.dataclass(frozen=True)
class _Entry:
    target: str  # "module:Class"
    runtime_started: Callable[[], bool]
    transport: str  # "module:Class" of its collective transport


_REGISTRY: Dict[str, _Entry] = {}
_C10D = "anyaccel.backends.transport:C10dTransport"


def register_backend(device_type: str, target: str, runtime_started: Callable[[], bool],
                     transport: str = _C10D) -> None:
    """Make ``device_type`` known: ``target`` is ``"package.module:BackendClass"``;
    ``runtime_started()`` must answer cheaply, without importing the device's runtime; ``transport``
    names the :class:`~anyaccel.backends.transport.Transport` its tensors travel on (default:
    torch.distributed)."""
    _REGISTRY[device_type] = _Entry(target, runtime_started, transport)


register_backend("cpu", "anyaccel.backends.cpu:CpuBackend", lambda: False)
register_backend("cuda", "anyaccel.backends.cuda:CudaBackend", cuda_initialized)
register_backend("mps", "anyaccel.backends.mps:MpsBackend", mps_available)
register_backend("xla", "anyaccel.backends.xla:XlaBackend", lambda: "torch_xla" in sys.modules,
                 transport="anyaccel.backends.xla:XlaTransport")


def _load(target: str) -> Any:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def backend_class(device_type: str) -> Type[Any]:
    """The Backend class for ``device_type``; ``ValueError`` naming the known types otherwise."""
    entry = _REGISTRY.get(device_type)
    if entry is None:
        raise ValueError(f"no anyaccel backend for device type {device_type!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _load(entry.target)


def create_backend(env: Any) -> Any:
    """The backend for ``env.device_type`` (not set up yet: call its ``setup()``). Local."""
    return backend_class(env.device_type)(env)


def started_backends() -> List[Type[Any]]:
    """Backend classes whose device runtime is started in this process (for RNG states, seeding,
    cache emptying). Local; imports nothing that is not loaded already."""
    return [_load(e.target) for e in _REGISTRY.values() if e.runtime_started()]


_TRANSPORTS: Dict[str, Any] = {}


def transport_for(device_type: str) -> Any:
    """The collective transport that tensors on ``device_type`` travel on (stateless; one object
    per transport class is kept). Unknown device types use torch.distributed."""
    entry = _REGISTRY.get(device_type)
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
    for device_type, entry in _REGISTRY.items():
        if entry.transport != _C10D and entry.runtime_started():
            transport = transport_for(device_type)
            if transport.is_active():
                return transport
    return c10d
