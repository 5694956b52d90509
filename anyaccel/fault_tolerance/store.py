"""Where a replica group's processes find torchft's TCP store: :func:`torchft_store`.

torchft's ``Manager`` is given one TCP store per replica group: the group's ranks find their
torchft server there (rank 0 publishes its address), and the other groups build the gradient group
through it (torchft advertises its address at the Lighthouse), so it must be reachable from the
other machines. The group's own store (the launcher's) is used when it is; a one-machine launch
(each group's agent, ``torchrun`` on one node) serves it on 127.0.0.1 only, so rank 0 then serves
one on every interface, named by this machine's host name (as torchft names its own servers), and
tells the group's other ranks its port through the group's store, under a key named by the group's
restart attempt (the store can outlive a restart of the group, and a port from an earlier attempt
names a server that is gone): the attempt every rank of the group agrees on, which the runtime
settles once for the doctor's keys and this one (``runtime._agreed_restart_attempt``: torch's
elastic agents count restarts each on its own machine, so a group spanning machines whose agent
was started again on one of them would otherwise name the key differently there).
"""

from __future__ import annotations

import datetime
import socket
from typing import Any, Optional, Tuple

from ..environment.network import names_this_machine
from ..errors import FaultToleranceError
from .settings import FaultToleranceSettings

__all__ = ["torchft_store", "KEY"]

#: the key, under the group's store, of the port of the store its rank 0 serves (``/<attempt>`` added)
KEY = "anyaccel/fault_tolerance/store"


def torchft_store(settings: FaultToleranceSettings, rank: int, world_size: int, given: Optional[Tuple[str, int]],
                  attempt: int) -> Tuple[str, int, Optional[Any]]:
    """``(host, port, served)``: the store torchft is given (module docstring), and the store this
    process serves for it (kept by the caller for as long as torchft uses it; None when it serves
    none). ``given``: the group's store (the launcher's), or None (no launcher); ``attempt``: the
    group's restart attempt, the same on every rank (module docstring). Collective over the group's
    ranks when rank 0 serves the store for several ranks: rank 0 publishes the port when it reaches
    its first quorum, and the others wait for it there, up to the longer of ``timeout_s`` and
    ``quorum_timeout_s``; else local. Raises :class:`FaultToleranceError` naming the store, the key and the fix."""
    from torch._C._distributed_c10d import TCPStore  # (torch.distributed re-exports it without saying so)

    if given is not None and not names_this_machine(given[0]):
        return given[0], given[1], None
    host = socket.gethostname()
    if given is None or world_size == 1:  # no launcher, or a group of one process: nobody to tell the port
        alone = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        return host, int(alone.port), alone
    # the other ranks wait here for rank 0 to serve and publish, when it reaches its first quorum;
    # bounded as the quorum is (not by timeout_s alone, a transfer's bound: 5 s in the two-host test)
    wait_s = max(settings.timeout_s, settings.quorum_timeout_s)
    key = f"{KEY}/{attempt}"
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
