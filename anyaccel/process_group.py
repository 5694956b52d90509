"""The torch.distributed process group: join it once, leave it cleanly at exit.

Every process of a multi-process job calls :func:`ensure_process_group` with the same resolved
:class:`~anyaccel.environment.Environment`; it blocks until all ``world_size`` processes have
joined (or the timeout passes) and is a no-op when the group already exists (a second
``Accelerator()``, or a user who called ``init_process_group`` first).

The group we created is destroyed at interpreter exit. Without that, gloo sometimes aborts the
process with SIGABRT while Python tears down its threads. DistributedDataParallel wrappers keep
their own reference to the group (through their C++ reducer), so destroying the default group is
not enough: if the group object itself is only freed during interpreter finalisation, gloo still
aborts ("terminate called without an active exception", 2 of 16 runs of a raw DDP script here).
At exit we therefore first release the reducers of the DDP wrappers anyaccel created, then
destroy the group, while the interpreter is still fully alive (0 of 16 runs).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import warnings
import weakref
from typing import Optional

import torch.distributed as dist

from . import envvars, network
from .environment import Environment
from .errors import JobEnvironmentError

__all__ = ["ensure_process_group", "destroy_process_group", "is_initialized", "track_ddp", "shutdown"]

_owned = {"value": False, "atexit": False}  # whether *we* created the current group
_ddp_wrappers: "weakref.WeakSet" = weakref.WeakSet()  # DDP modules created by prepare()


def is_initialized() -> bool:
    """True when a default process group exists in this process."""
    return dist.is_available() and dist.is_initialized()


def ensure_process_group(env: Environment, timeout_s: Optional[float] = None) -> bool:
    """Join the default process group described by ``env`` if it is not joined yet.

    Collective over all ranks of ``env``: each one must call it. Returns True when this call
    created the group. Single-process environments do nothing and return False. ``timeout_s``
    (default ``ANYACCEL_PG_TIMEOUT``, 1800 s) bounds every collective of the group. The caller has
    already selected this process's device (the backend's ``setup``), which NCCL needs.
    """
    if env.world_size <= 1 or env.backend is None or _runtime_forms_group(env):
        return False
    if is_initialized():
        if dist.get_world_size() != env.world_size:
            raise JobEnvironmentError(
                f"a process group of size {dist.get_world_size()} already exists, but the environment "
                f"says world size {env.world_size}; destroy it or fix the launcher variables"
            )
        return False
    timeout = datetime.timedelta(seconds=timeout_s or envvars.read(envvars.PG_TIMEOUT))
    kwargs = dict(backend=env.backend, timeout=timeout)
    if env.source == "torchrun" and env.launch.started_by_elastic_agent:
        # torchrun's agent already runs a TCP store; env:// reuses it (no second port).
        kwargs["init_method"] = "env://"
    else:
        if env.main_port is None:
            raise JobEnvironmentError(
                f"world size {env.world_size} from {env.source} but no main port is known: set MASTER_PORT"
            )
        kwargs.update(
            init_method=f"tcp://{network.host_port(env.main_address, env.main_port)}",
            rank=env.rank,
            world_size=env.world_size,
        )
    _choose_gloo_interface(env)
    dist.init_process_group(**kwargs)
    _owned["value"] = True
    if not _owned["atexit"]:
        atexit.register(_at_exit)
        _owned["atexit"] = True
    return True


def _runtime_forms_group(env: Environment) -> bool:
    """The device's runtime forms the group itself (XLA): no torch.distributed group here."""
    from .devices import device_facts

    try:
        return device_facts(env.device_type).owns_processes
    except ValueError:  # a device registered without facts
        return False


def _choose_gloo_interface(env: Environment) -> None:
    """Gloo tells its peers the address this machine's host name resolves to. Where that is
    127.0.0.1 (Debian's /etc/hosts, many containers), peers on other machines cannot connect; so
    in a job of several machines, unless ``GLOO_SOCKET_IFNAME`` is set, use the interface of
    :func:`anyaccel.network.address_for_peers`. Local; sets ``GLOO_SOCKET_IFNAME`` in this process
    only."""
    import socket

    if env.num_nodes <= 1 or "gloo" not in str(env.backend) or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    if not network.resolves_to_loopback(socket.gethostname()):
        return
    address = network.address_for_peers(env.main_address)
    interface = network.interface_of(address) if address else None
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
        return
    warnings.warn(f"this machine's host name {socket.gethostname()!r} resolves to a loopback address, so gloo would "
                  f"tell the other machines an address they cannot reach, and no interface routes to the main address "
                  f"{env.main_address}; set GLOO_SOCKET_IFNAME to the network interface the machines share",
                  stacklevel=3)


def destroy_process_group() -> None:
    """Leave the default process group if anyaccel created it. Local; safe to call twice."""
    if _owned["value"] and is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # pragma: no cover - best effort at shutdown
            pass
    _owned["value"] = False


def track_ddp(module) -> None:
    """Remember a DDP wrapper so that its reducer is released before the group at exit."""
    _ddp_wrappers.add(module)


def shutdown(force: bool = False) -> None:
    """Release the reducers of the DDP wrappers anyaccel created (they hold the group), collect
    garbage, then destroy the default group — if anyaccel created it, or any group with
    ``force=True`` (used by the launchers after the user's code returned). Local; safe to call
    twice. Runs automatically at interpreter exit."""
    for module in list(_ddp_wrappers):
        for name in ("reducer", "logger", "process_group"):
            if name in module.__dict__:
                try:
                    delattr(module, name)
                except Exception:  # pragma: no cover - best effort at shutdown
                    pass
    _ddp_wrappers.clear()
    gc.collect()
    if force and is_initialized():
        _owned["value"] = True
    destroy_process_group()


def _at_exit() -> None:
    shutdown()
