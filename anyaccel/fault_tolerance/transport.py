"""The two torchft pieces anyaccel subclasses: the healing transfer and the reconfigurable gloo group.

* :func:`counting_transport` — torchft's ``HTTPTransport`` (a recovering replica group fetches the
  whole healing state from a live peer's HTTP server, in one stream, ``torch.load`` of a
  ``torch.save``), counting the bytes read and the seconds taken: what the heal reports and the
  benchmark measures.
* :func:`keeping_gloo` — torchft's ``ProcessGroupGloo``, which makes a new gloo group at every
  change of membership and drops the previous one. Dropping a gloo group runs its destructor,
  which joins gloo's worker threads while holding the GIL: the hang of issue 29
  (:mod:`anyaccel.process.process_group`). Here the previous group is handed to
  :func:`anyaccel.process.process_group.keep` instead, which ends it with the process once gloo's threads
  are idle. A job that changes membership N times keeps N small groups (their sockets to a dead
  peer are closed already).

Both classes are made at first use (torchft is optional, and importing it costs time).
:data:`CONTRACT` lists the torchft members relied on; ``tests/fault_tolerance`` checks them
against the installed torchft. Local.
"""

from __future__ import annotations

import functools
import time
import urllib.request
import warnings
from typing import Any, Tuple, cast

from ..process import process_group

__all__ = ["counting_transport", "keeping_gloo", "TransferCount", "CONTRACT"]

#: (torchft class, member) that the subclasses override or read
CONTRACT: Tuple[Tuple[str, str], ...] = (
    ("torchft.checkpointing.http_transport:HTTPTransport", "recv_checkpoint"),  # and its URL layout .../<step>/full
    ("torchft.process_group:ProcessGroupWrapper", "abort"),
    ("torchft.process_group:ProcessGroupWrapper", "_pg"),
    ("torchft.checkpointing.http_transport:HTTPTransport", "_server"),  # its RequestHandlerClass: quiet
    # replica.py: a heal in a synchronous quorum applied as torchft's own synchronous start_quorum does
    ("torchft.manager:Manager", "_healing"),
    ("torchft.manager:Manager", "_apply_pending_state_dict"),
    ("torchft.manager:Manager", "is_participating"),
    # replica.py: the quorum awaited with an overall bound (wait_quorum's own body: _quorum_future.result())
    ("torchft.manager:Manager", "_quorum_future"),
    # vote.py: should_commit, its steps in torchft's order
    ("torchft.manager:Manager", "_recovery_event"),
    ("torchft.manager:Manager", "_pg"),
    ("torchft.manager:Manager", "_min_replica_size"),
    ("torchft.manager:Manager", "_errored"),
    ("torchft.manager:Manager", "_checkpoint_transport"),
    ("torchft.manager:Manager", "_step"),
    ("torchft.manager:Manager", "_batches_committed"),
    ("torchft.manager:Manager", "_commit_failures"),
    ("torchft.manager:Manager", "_max_retries"),
    ("torchft.manager:Manager", "should_commit"),  # vote.decide follows its body (see the test)
    # reduce.py: allreduce, its steps in torchft's order (see the test)
    ("torchft.manager:Manager", "allreduce"),
    ("torchft.manager:Manager", "errored"),
    ("torchft.manager:Manager", "num_participants"),
    ("torchft.manager:Manager", "report_error"),
    # lineage.py and replica.py: the quorum's id, the group's replica rank in torchft's gradient group (and,
    # not a member: the Lighthouse forms a new quorum after a step some member could not commit, its
    # "Detected commit failures", so a lineage check that failed runs again in the next quorum's first step)
    ("torchft.manager:Manager", "_quorum_id"),
    # lineage.py: the quorum's member ids (QuorumResult.replica_ids), read through the Manager's client
    ("torchft.manager:Manager", "_client"),
    ("torchft.process_group:ProcessGroupWrapper", "_rank"),
)


class TransferCount:
    """Bytes and seconds of the healing transfers this process received (one per heal)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.seconds = 0.0
        self.transfers = 0


class _CountingReader:
    """A file object that counts what is read through it."""

    def __init__(self, raw: Any, count: TransferCount):
        self._raw, self._count = raw, count

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        self._count.bytes += len(data)
        return bytes(data)

    def readinto(self, buffer: Any) -> int:
        n = int(self._raw.readinto(buffer) or 0)
        self._count.bytes += n
        return n

    def readline(self, size: int = -1) -> bytes:
        data = self._raw.readline(size)
        self._count.bytes += len(data)
        return bytes(data)


@functools.lru_cache(maxsize=None)
def _transport_class() -> type:
    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class CountingHTTPTransport(HTTPTransport):  # type: ignore[misc]  # torchft is untyped: Any
        """torchft's HTTP transport; received bytes and seconds are added to ``self.count``."""

        count = TransferCount()  # replaced per instance in __init__

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.count = TransferCount()
            # the server's request log (one stderr line per transfer): the heal's own line says it
            self._server.RequestHandlerClass.log_message = lambda *args, **kwargs: None

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: Any) -> Any:
            """Read the peer's state (torchft's request), counting bytes and seconds. Local."""
            start = time.perf_counter()
            url = f"{metadata}{step}/full"  # HTTPTransport's layout without chunks (num_chunks=0)
            with urllib.request.urlopen(url, timeout=timeout.total_seconds()) as stream, warnings.catch_warnings():
                # torch.frombuffer on the received bytes warns that they are read-only; they are not kept
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                state = _streaming_load(cast(Any, _CountingReader(stream, self.count)), weights_only=False)
            self.count.seconds += time.perf_counter() - start
            self.count.transfers += 1
            return state

    return CountingHTTPTransport


def counting_transport(timeout: Any) -> Any:
    """A new counting HTTP transport (``.count``: a :class:`TransferCount`), one stream per
    transfer. Its server listens on every interface of this machine (torchft binds ``""``):
    a peer group on another machine fetches from it. Local."""
    return _transport_class()(timeout=timeout, num_chunks=0)


@functools.lru_cache(maxsize=None)
def _gloo_class() -> type:
    from torchft.process_group import ProcessGroupGloo

    class KeepingProcessGroupGloo(ProcessGroupGloo):  # type: ignore[misc]  # torchft is untyped: Any
        """torchft's reconfigurable gloo group; a group it replaces is kept until the process
        ends (module docstring), never destroyed from the quorum thread."""

        def abort(self, errored: bool = True) -> None:
            """Leave the current gloo group (torchft's abort), keeping it for the process's end. Local."""
            previous = getattr(self, "_pg", None)
            if previous is not None:
                process_group.keep(previous)
            super().abort(errored)

    return KeepingProcessGroupGloo


def keeping_gloo(timeout: Any) -> Any:
    """A reconfigurable gloo group for the replica groups' gradients (torchft's
    ``ProcessGroupGloo``) whose replaced groups are kept (module docstring). Local."""
    return _gloo_class()(timeout=timeout)


def current_group(pg: Any) -> Any:
    """The torch process group a :func:`keeping_gloo` wrapper runs on now (None before the
    first quorum). Local."""
    return getattr(pg, "_pg", None)
