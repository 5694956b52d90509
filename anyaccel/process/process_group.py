"""The torch.distributed process group: join it once, keep it for the life of the process, and end
it safely when the process ends.

Every process of a multi-process job calls :func:`ensure_process_group` with the same resolved
:class:`~anyaccel.environment.Environment`; it blocks until all ``world_size`` processes have
joined (or the timeout passes) and is a no-op when the group already exists (a second
``Accelerator()`` — after ``end_training()`` too — or a user who called ``init_process_group``).

**Why a group is never destroyed while the script runs.** gloo runs each collective on a worker
thread, and that thread frees the finished work — tensors whose Python objects the main thread
may already have dropped, so freeing them takes the GIL. A ``ProcessGroupGloo`` destructor joins
those threads. When the destructor runs from a Python deallocation (the default group's last
reference dropped by ``destroy_process_group``, or a DDP ``Reducer`` freed when ``main()``'s
locals die) it holds the GIL while it joins: a worker still freeing its last work waits for the
GIL, the main thread waits for the worker, and a finished job hangs forever (issue 29: 5 of 8
runs of a small DDP script). The same late worker, when the interpreter finalises under it, is
ended inside C++ and the process aborts ("terminate called without an active exception").

So, by construction:

* anyaccel never destroys a group in the middle of a process. ``end_training()`` and a collected
  ``Accelerator`` leave the group as it is (as Accelerate does), and the next ``Accelerator`` of
  the process uses it again. Where a group must be *left* (``PartialState().destroy_process_group()``,
  the nd strategy's group of one, the asynchronous saver's group), :func:`retire` lets torch
  forget it but keeps the object — and so its threads — alive until the process ends; nothing
  anyaccel made can run the destructor from a deallocation. A group joined again after one was
  left reads a store prefix of its own, never the previous group's addresses.
* the process ends through :func:`shutdown` (the launchers' workers after the user's code
  returned, and ``atexit`` for every other process): first :func:`quiesce` — the main thread
  releases the GIL until every gloo worker thread is idle on its queue (read from
  ``/proc/self/task``: an idle worker waits on its condition variable with no timeout; one waiting
  for the GIL waits with one) — then the DDP reducers and the groups are released, so each
  destructor joins threads that are already idle. Where the workers cannot be seen (no ``/proc``,
  a torch that does not name them), :func:`quiesce` waits a fixed 0.2 s instead and says so in its
  return value.

What the process does after its script returned is bounded by :mod:`anyaccel.lifetime`.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import platform
import sys
import time
import warnings
import weakref
from typing import Any, Dict, List, Optional

import torch.distributed as dist

from .. import envvars, lazyclass
from ..environment import network
from ..environment import Environment
from ..errors import JobEnvironmentError

__all__ = ["ProcessGroupOptions", "ensure_process_group", "destroy_process_group", "retire", "keep", "keep_all", "is_initialized", "track_ddp",
           "quiesce", "gloo_workers_idle", "shutdown"]


@lazyclass.dataclass(frozen=True, kw_only=True)
class ProcessGroupOptions:
    """What the user chose for the process group: ``backend`` (``"gloo"``, ``"nccl"``, ...; None:
    the environment's) and ``timeout_s`` (seconds to wait for every process to join; None:
    torch's default). Accelerate's ``InitProcessGroupKwargs`` converts into it (``to_options()``).
    Local; frozen."""

    backend: Optional[str] = None
    timeout_s: Optional[float] = None


class _Groups:
    """What this process knows about the groups anyaccel made (one instance, :data:`_GROUPS`)."""

    def __init__(self) -> None:
        self.owned: Any = None  # the default group anyaccel created and torch still knows, if any
        self.store: Any = None  # the store of the first default group anyaccel created (reused by later ones)
        self.joins = 0  # default groups anyaccel created in this process
        self.kept: List[Any] = []  # every group anyaccel made or left: alive until shutdown()
        self.pid = os.getpid()  # a forked child must never touch its parent's groups
        self.atexit = False
        self.done = False


_GROUPS = _Groups()
_ddp_wrappers: "weakref.WeakSet[Any]" = weakref.WeakSet()  # DDP modules created by prepare()


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
    kwargs: Dict[str, Any] = dict(backend=env.backend, timeout=timeout)
    if _GROUPS.store is not None:
        # joined again after the group was left: the same store, under a prefix of its own (the
        # previous group's keys would send gloo to the previous group's sockets)
        kwargs.update(store=dist.distributed_c10d.PrefixStore(f"anyaccel/join{_GROUPS.joins}/", _GROUPS.store), rank=env.rank,
                      world_size=env.world_size)
    elif env.source == "torchrun" and env.launch.started_by_elastic_agent:
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
    group = dist.group.WORLD
    if _GROUPS.store is None:
        _GROUPS.store = dist.distributed_c10d._get_default_store()
    _GROUPS.joins += 1
    _GROUPS.owned = group
    keep(group)
    if not _GROUPS.atexit:
        atexit.register(_at_exit)
        _GROUPS.atexit = True
    return True


def _runtime_forms_group(env: Environment) -> bool:
    """The device's runtime forms the group itself (XLA): no torch.distributed group here."""
    from ..environment.devices import device_facts

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


def keep(group: Any) -> None:
    """Hold ``group`` (a ``ProcessGroup``) until :func:`shutdown`, so that no deallocation can run
    its destructor while the script runs (module docstring). Local; idempotent."""
    if group is not None and not any(g is group for g in _GROUPS.kept):
        _GROUPS.kept.append(group)


def keep_all() -> None:
    """:func:`keep` every group torch knows now (the default one and those made from it: device
    meshes, the asynchronous saver's), so a later ``dist.destroy_process_group()`` by the user's
    code cannot run their destructors from a deallocation. Local."""
    if is_initialized():
        for group in list(dist.distributed_c10d._world.pg_map):
            keep(group)


def retire(group: Any = None) -> None:
    """Leave ``group`` (default: the default group): torch forgets it, so a new group can be made,
    but anyaccel keeps the object until :func:`shutdown`. Local; every rank of the group calls it
    at the same point when a new group is to be made. Safe when there is no such group."""
    if not is_initialized():
        return
    target = dist.group.WORLD if group is None else group
    if target is None or target is dist.GroupMember.NON_GROUP_MEMBER:
        return
    if group is None:  # the default group takes every group made from it along
        keep_all()
    keep(target)
    dist.destroy_process_group(group)
    if group is None or target is _GROUPS.owned:
        _GROUPS.owned = None


def destroy_process_group() -> None:
    """Leave the default process group if anyaccel created it (:func:`retire`: the object lives
    on until the process ends). Local; safe to call twice."""
    if _GROUPS.owned is not None and is_initialized() and dist.group.WORLD is _GROUPS.owned:
        retire()
    _GROUPS.owned = None


def track_ddp(module: Any) -> None:
    """Remember a DDP wrapper so that its reducer is released before the groups at shutdown."""
    _ddp_wrappers.add(module)


# --------------------------------------------------------------------------------------------
# gloo's worker threads
# --------------------------------------------------------------------------------------------

_WORKER_NAME = "pt_gloo_runloop"  # torch names gloo's worker threads so (c10::setThreadName)
_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238}.get(platform.machine())
#: the futex operations of an untimed condition-variable wait: FUTEX_WAIT_BITSET (glibc 2.25 and
#: later) and FUTEX_WAIT (older glibc, e.g. 2.17 of RHEL 7); the GIL's wait always has a timeout
_FUTEX_UNTIMED_WAITS = (9, 0)


def gloo_workers_idle() -> Optional[bool]:
    """Whether every gloo worker thread of this process waits, idle, for work: blocked on its queue's
    condition variable without a timeout (a worker freeing a finished work and waiting for the GIL
    waits *with* a timeout; one running a collective is in another call, or running). None when this
    cannot be seen (no ``/proc``, another architecture, or a torch that does not name the workers).
    Local; a few reads of ``/proc/self/task``."""
    if _FUTEX is None:
        return None
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    seen = False
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != _WORKER_NAME:
                    continue
            with open(f"/proc/self/task/{tid}/syscall") as f:
                fields = f.read().split()
        except OSError:  # the thread ended meanwhile
            continue
        seen = True
        if len(fields) < 5 or fields[0] != str(_FUTEX):
            return False
        if int(fields[2], 16) & 0x7F not in _FUTEX_UNTIMED_WAITS or int(fields[4], 16) != 0:
            return False
    if not seen and _has_gloo_group():  # a gloo group exists, its workers carry no name: an older torch
        return None
    return True


def _has_gloo_group() -> bool:
    for group in list(_GROUPS.kept) + (list(dist.distributed_c10d._world.pg_map) if is_initialized() else []):
        try:
            if "gloo" in str(group.name()).lower():
                return True
        except Exception:  # noqa: BLE001 - a group torch has already let go of
            continue
    return False


def quiesce(timeout: float = 10.0) -> Optional[bool]:
    """Release the GIL until every gloo worker thread of this process is idle (see
    :func:`gloo_workers_idle`), at most ``timeout`` seconds: a worker still freeing a finished
    collective's tensors gets the GIL it waits for. Returns True when the workers were seen idle,
    False when ``timeout`` passed first (a collective is still running), None when they cannot be
    seen (then it waits a fixed 0.2 s). Local."""
    deadline = time.monotonic() + timeout
    delay = 0.0005
    while True:
        idle = gloo_workers_idle()
        if idle is None:
            time.sleep(0.2)
            return None
        if idle:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


# --------------------------------------------------------------------------------------------
# The end of the process
# --------------------------------------------------------------------------------------------


def shutdown(force: bool = False, timeout: float = 10.0, quiet: bool = False) -> None:
    """End the process's groups safely (module docstring): wait for gloo's workers to be idle
    (:func:`quiesce`), release the reducers of the DDP wrappers anyaccel created, then destroy
    the groups anyaccel made or left — and, with ``force=True`` (the launchers' workers, after the
    user's code returned), any group torch still knows. Workers that stay busy past ``timeout``
    (a collective still running) leave the groups alive, with one line saying so (unless ``quiet``:
    a failed script's collectives may never finish): the process then ends without joining them.
    Local; runs once (at interpreter exit when nobody called it)."""
    if _GROUPS.done or os.getpid() != _GROUPS.pid:
        return
    if not (_GROUPS.kept or (force and is_initialized())):
        return
    _GROUPS.done = True
    if quiesce(timeout) is False:
        keep_all()
        _never_free(_GROUPS.kept)  # a destructor would join busy workers under the GIL, even in finalisation
        if quiet:
            return
        sys.stderr.write(f"[anyaccel] a collective was still running {timeout:g} s after the script ended; the "
                         "process groups are left alive until the process ends (the system frees them)\n")
        sys.stderr.flush()
        return
    for module in list(_ddp_wrappers):
        for name in ("reducer", "logger", "process_group"):
            if name in module.__dict__:
                try:
                    delattr(module, name)
                except Exception:  # pragma: no cover - best effort at shutdown
                    pass
    _ddp_wrappers.clear()
    if is_initialized() and (force or dist.group.WORLD is _GROUPS.owned):
        try:
            dist.destroy_process_group()
        except Exception:  # pragma: no cover - best effort at shutdown
            pass
    _GROUPS.owned = None
    kept, _GROUPS.kept = _GROUPS.kept, []
    del kept  # the destructors run here: their workers are idle
    gc.collect()


def _never_free(objects: List[Any]) -> None:
    """Give each object a reference nobody drops, so that no destructor of theirs ever runs, not
    even in the interpreter's finalisation (the process's end frees their memory and sockets)."""
    import ctypes

    for obj in objects:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _at_exit() -> None:
    shutdown()
