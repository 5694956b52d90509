"""Where a replica group's processes find torchft's TCP store: :func:`torchft_store`.

torchft's ``Manager`` is given one TCP store per replica group: the group's ranks find their
torchft server there (rank 0 publishes its address), and the other groups build the gradient group
through it (torchft advertises its address at the Lighthouse), so it must be reachable from the
other machines. The group's own store (the launcher's) is used when it is; a one-machine launch
(each group's agent, ``torchrun`` on one node) serves it on 127.0.0.1 only, so rank 0 then serves
one on every interface, named by this machine's host name (as torchft names its own servers), and
tells the group's other ranks its port through the group's store, under a key named by the group's
restart attempt (:func:`agreed_attempt`: the store can outlive a restart of the group, and a port
from an earlier attempt names a server that is gone).
"""

from __future__ import annotations

import datetime
import socket
from typing import Any, List, Optional, Tuple

from ..environment.network import names_this_machine
from ..errors import FaultToleranceError
from .settings import FaultToleranceSettings

__all__ = ["torchft_store", "agreed_attempt", "KEY"]

#: the key, under the group's store, of the port of the store its rank 0 serves (``/<attempt>`` added)
KEY = "anyaccel/fault_tolerance/store"


def agreed_attempt(attempt: int) -> int:
    """The highest of the group's ranks' restart attempts (``attempt``: this rank's, from its
    launcher), the same on every rank. torch's elastic agents count restarts each on its own
    machine: in a group spanning machines, one whose agent was started again counts from 0 while
    the others count on, and the ranks would name the key differently (rank 1 waiting under a key
    rank 0 never writes). The highest count is new at every restart of the group as long as one
    agent lives through it (if none does, the store is new too). Collective over the group's
    default process group (formed by the runtime before the first quorum): one ``all_gather`` of one
    integer, once per process; ``attempt`` itself, locally, when no group of several ranks is formed."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() <= 1:
        return attempt
    attempts: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(attempts, int(attempt))
    return max(int(a) for a in attempts)


def torchft_store(settings: FaultToleranceSettings, rank: int, world_size: int, given: Optional[Tuple[str, int]],
                  attempt: int) -> Tuple[str, int, Optional[Any]]:
    """``(host, port, served)``: the store torchft is given (module docstring), and the store this
    process serves for it (kept by the caller for as long as torchft uses it; None when it serves
    none). ``given``: the group's store (the launcher's), or None (no launcher); ``attempt``: this
    rank's restart attempt. Collective over the group's ranks when rank 0 serves the store for
    several ranks: they meet in :func:`agreed_attempt` when each reaches its first quorum (a
    collective of the group's process group, bounded by its timeout, ``ANYACCEL_PG_TIMEOUT``), then
    rank 0 publishes the port at once and the others wait for it (without a process group, until
    rank 0 reaches its first quorum), up to the longer of ``timeout_s`` and ``quorum_timeout_s``;
    else local. Raises :class:`FaultToleranceError` naming the store, the key and the fix."""
    from torch._C._distributed_c10d import TCPStore  # (torch.distributed re-exports it without saying so)

    if given is not None and not names_this_machine(given[0]):
        return given[0], given[1], None
    host = socket.gethostname()
    if given is None or world_size == 1:  # no launcher, or a group of one process: nobody to tell the port
        alone = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        return host, int(alone.port), alone
    # the other ranks wait here for rank 0 to serve and publish: at once where agreed_attempt met the
    # ranks (a process group is formed), else when rank 0 reaches its first quorum; bounded as the
    # quorum is (not by timeout_s alone, a transfer's bound: 5 s in the two-host test)
    wait_s = max(settings.timeout_s, settings.quorum_timeout_s)
    key = f"{KEY}/{agreed_attempt(attempt)}"
    served: Optional[Any] = None
    try:
        group = TCPStore(given[0], given[1], is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=wait_s))
        if rank == 0:
            served = TCPStore(host, 0, is_master=True, wait_for_workers=False)
            group.set(key, str(served.port))
        return host, int(group.get(key)), served
    except Exception as exc:  # torch's DistStoreError/RuntimeError: a timeout, a refused connection
        cause = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        if rank == 0:
            raise FaultToleranceError(
                f"replica group {settings.group}, rank 0: could not serve torchft's store on {host} (this machine's "
                f"host name) and publish its port in the group's store at {given[0]}:{given[1]} ({cause}); the host "
                "name must resolve to an address of this machine that the other machines reach") from exc
        raise FaultToleranceError(
            f"replica group {settings.group}, rank {rank}: the port of torchft's store (served by the group's rank 0 "
            f"on {host}) was not found in the group's store at {given[0]}:{given[1]} (key {key!r}) within {wait_s:g} s "
            f"({cause}); the group's rank 0 did not reach its first quorum in that time (it failed or is still "
            "starting: see its output), or the group's store is gone; TORCHFT_QUORUM_TIMEOUT_SEC sets the bound") from exc
