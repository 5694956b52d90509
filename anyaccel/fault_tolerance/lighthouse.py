"""The torchft Lighthouse, started in the launcher's own process: :class:`Lighthouse`.

The Lighthouse (torchft's Rust server, prebuilt in its wheel) decides every step's quorum from the
replica groups that ask for one and from their heartbeats. ``anyaccel launch --fault_tolerance on``
starts one in the launcher of machine 0 (one machine: bound to 127.0.0.1 only; several: to every
interface) and gives its address to every worker. Its settings:

=====================  =========  ==================================================================
setting                value      why
=====================  =========  ==================================================================
``min_replicas``       the option  groups a quorum needs (``fault_tolerance_min_replicas``)
``heartbeat_timeout``  3 s        a group not heard from for this long is left out of the next
                                  quorum: the survivors' wait after a group dies (torchft: 5 s)
``join_timeout``       1 s        how long a quorum waits for a group that heartbeats but has not
                                  asked yet (torchft: 60 s; anyaccel starts a group's heartbeat
                                  only when it asks, so a longer wait buys nothing)
``quorum_tick``        100 ms     torchft's
=====================  =========  ==================================================================

To run your own instead (on another machine, with other settings), start ``torchft_lighthouse
--min_replicas 1 --bind [::]:29510`` and pass ``--fault_tolerance HOST:29510``. Local to the
launcher.
"""

from __future__ import annotations

from typing import Any, Optional

from ..environment.network import host_port
from .settings import require_torchft

__all__ = ["Lighthouse", "HEARTBEAT_TIMEOUT_MS", "JOIN_TIMEOUT_MS"]

HEARTBEAT_TIMEOUT_MS = 3000
JOIN_TIMEOUT_MS = 1000
QUORUM_TICK_MS = 100


class Lighthouse:
    """A Lighthouse serving in this process until :meth:`close`. ``host``: the address it binds
    (``127.0.0.1``, or ``0.0.0.0`` / ``::`` for every interface); ``port`` 0 picks a free one;
    ``advertise``: the host workers are told (default: ``host``, or this machine's address for
    peers when bound to every interface). Raises
    :class:`~anyaccel.errors.FaultToleranceError` when torchft is missing, ``OSError``-like
    ``RuntimeError`` from torchft when the port is taken."""

    def __init__(self, min_replicas: int, host: str = "127.0.0.1", port: int = 0, advertise: Optional[str] = None):
        require_torchft()
        from torchft._torchft import LighthouseServer

        self._host = host
        bind = host_port(host, port)
        self._server: Any = LighthouseServer(bind=bind, min_replicas=int(min_replicas),
                                             join_timeout_ms=JOIN_TIMEOUT_MS, quorum_tick_ms=QUORUM_TICK_MS,
                                             heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
        self.port = int(str(self._server.address()).rsplit(":", 1)[1])
        shown = advertise or host
        self.address = host_port(shown, self.port)

    def heartbeating(self) -> Optional[int]:
        """How many replica groups heartbeat to this Lighthouse now (within its heartbeat timeout),
        read from the status page it serves (torchft 0.2's ``/status``: "[N heartbeating]"); None
        when that cannot be read. Local (one HTTP request to this process's own server)."""
        return self._status_count(r"\[(\d+) heartbeating\]")

    def asking(self) -> Optional[int]:
        """How many replica groups have asked this Lighthouse for the next quorum and wait for it,
        read from the same status page ("[N/M participants healthy]"); None when that cannot be read.
        Local (one HTTP request to this process's own server)."""
        return self._status_count(r"\[(\d+)/\d+ participants healthy\]")

    def _status_count(self, pattern: str) -> Optional[int]:
        """The number ``pattern``'s group captures in the status page, or None."""
        import re
        import urllib.request

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # (never through a proxy)
        loopbacks = ["[::1]", "127.0.0.1"] if ":" in self._host else ["127.0.0.1"]  # (bound to :: only: IPv6's)
        for loopback in loopbacks:
            try:
                with opener.open(f"http://{loopback}:{self.port}/status", timeout=5) as response:
                    text = response.read().decode("utf-8", "replace")
            except OSError:
                continue
            found = re.search(pattern, text)
            return int(found.group(1)) if found else None
        return None

    def close(self) -> None:
        """Stop serving (the replica groups' next quorum then fails after its timeout). Local."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
