"""A worker's failure, from the worker that raised to the one message the user reads.

Worker side (:func:`record_failure`, in :mod:`anyaccel.worker_failure`, re-exported here): the
exception and its traceback go into the error file that torch's elastic agent names in
``TORCHELASTIC_ERROR_FILE``, in torchelastic's own JSON format plus an ``anyaccel`` entry (rank,
exact time, a trimmed traceback, the pickled exception when it can be pickled). The worker then
exits with status 1 without printing the traceback, so it is printed once, by the launcher.

Launcher side (:func:`failures_from`, :func:`report`): read every failed rank, pick the root cause
(the earliest error that is not a mere consequence of another rank dying, such as gloo's
"Connection closed by peer"), and format one message labelled with the rank.

Imports only the standard library: the worker bootstrap loads this module before the user script.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import pickle
import signal
from typing import Any, Iterable, List, Optional

from ..errors import WorkerFailedError
# The worker side lives below the doctor, which records the failures it ends a process for.
from ..worker_failure import (_PLUMBING, add_plumbing, record_failure, user_traceback,  # noqa: F401
                              worker_launch_facts, worker_rank)

__all__ = ["Failure", "WorkerFailedError", "record_failure", "user_traceback", "failures_from", "root_cause", "report"]

add_plumbing(__file__)


# --------------------------------------------------------------------------------------------
# Launcher side
# --------------------------------------------------------------------------------------------

# Errors a rank raises because *another* rank died (its sockets closed under a collective).
_CONSEQUENCE_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "socket closed",
    "remote process exited",
    "nccl communicator was aborted",
    "distbackenderror",
)


def looks_like_consequence(text: str) -> bool:
    """True for the errors a rank raises when a peer died under a collective."""
    text = text.lower()
    return any(m in text for m in _CONSEQUENCE_MARKERS)


@dataclasses.dataclass
class Failure:
    """One failed worker as the launcher sees it."""

    rank: int
    local_rank: int
    pid: int
    exitcode: int
    summary: str
    traceback: Optional[str]
    time: float
    pickled: Optional[str] = None

    @property
    def stopped_by_agent(self) -> bool:
        """Ended by the SIGTERM/SIGINT the agent sends to the survivors (or exit status 130/143)."""
        return self.traceback is None and self.exitcode in (-signal.SIGTERM, -signal.SIGINT, 130, 143)

    @property
    def is_consequence(self) -> bool:
        """Most likely caused by another rank's failure rather than a failure of its own."""
        return self.stopped_by_agent or looks_like_consequence(f"{self.summary}\n{self.traceback or ''}")

    def exception(self) -> Optional[BaseException]:
        """The worker's exception object, when it could be pickled."""
        if not self.pickled:
            return None
        try:
            return pickle.loads(base64.b64decode(self.pickled))
        except Exception:
            return None

    def headline(self) -> str:
        if self.traceback is not None:
            return self.summary
        if self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = f"signal {-self.exitcode}"
            hint = " (out of memory? the kernel's OOM killer sends SIGKILL)" if name == "SIGKILL" else ""
            return f"killed by {name}{hint}, no Python traceback"
        return f"exited with status {self.exitcode} without a Python exception (sys.exit or os._exit?)"


def failures_from(error: Any, side_dir: Optional[str] = None) -> List[Failure]:
    """The failures inside torch's ``ChildFailedError`` (``error.failures``: global rank →
    ProcessFailure), plus those recorded in ``side_dir`` by ranks the agent did not report."""
    out = []
    for rank, pf in sorted(getattr(error, "failures", {}).items()):
        data = pf.error_file_data if isinstance(getattr(pf, "error_file_data", None), dict) else {}
        message = data.get("message")
        extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
        ours = extra.get("anyaccel") if isinstance(extra, dict) else None
        if isinstance(ours, dict):
            out.append(Failure(rank, pf.local_rank, pf.pid, pf.exitcode, ours.get("summary", ""), ours.get("traceback"),
                               float(ours.get("time", pf.timestamp)), ours.get("pickled")))
        elif isinstance(message, dict) and extra.get("py_callstack"):
            out.append(Failure(rank, pf.local_rank, pf.pid, pf.exitcode, str(message.get("message", "")),
                               str(extra["py_callstack"]), float(pf.timestamp)))
        else:
            out.append(Failure(rank, pf.local_rank, pf.pid, pf.exitcode, "", None, float(pf.timestamp)))
    known = {f.rank for f in out}
    recorded = []
    for name in sorted(os.listdir(side_dir)) if side_dir and os.path.isdir(side_dir) else ():
        if not name.endswith(".json"):  # record_failure's temporary files (a worker ended mid-write), result.pkl
            continue
        try:
            with open(os.path.join(side_dir, name)) as fh:
                recorded.append(json.load(fh)["message"]["extraInfo"]["anyaccel"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    last = max((int(r.get("attempt", 0)) for r in recorded), default=0)
    for ours in recorded:
        rank = ours.get("rank")
        if isinstance(rank, int) and rank not in known and int(ours.get("attempt", 0)) == last:
            out.append(Failure(rank, -1, int(ours.get("pid", -1)), 1, ours.get("summary", ""), ours.get("traceback"),
                               float(ours.get("time", 0)), ours.get("pickled")))
    return sorted(out, key=lambda f: f.rank)


def root_cause(failures: Iterable[Failure]) -> Optional[Failure]:
    """The failure that started it: the earliest Python exception that is not a consequence of
    another rank dying; else a worker killed by a signal or exiting without a traceback; else the
    earliest of all."""
    failures = list(failures)
    if not failures:
        return None
    for group in (
        [f for f in failures if f.traceback is not None and not f.is_consequence],
        [f for f in failures if f.traceback is None and not f.stopped_by_agent],
        failures,
    ):
        if group:
            return min(group, key=lambda f: (f.time, f.rank))
    return None


def report(failures: List[Failure], world_size: int, machine_rank: int = 0) -> str:
    """The message printed once by the launcher: the root cause's traceback labelled with its
    rank, then one line per other failed rank."""
    root = root_cause(failures)
    if root is None:
        return "a worker failed, but torch's elastic agent reported no failed process"
    local = f"local rank {root.local_rank} " if root.local_rank >= 0 else ""
    where = f"{local}on machine {machine_rank}, pid {root.pid}"
    lines = [f"rank {root.rank} of {world_size} failed ({where}): {root.headline()}"]
    if root.traceback:
        lines.append(f"---- traceback of rank {root.rank} ----")
        lines.append(root.traceback.rstrip("\n"))
        lines.append(f"---- end of rank {root.rank} ----")
    for f in failures:
        if f is not root:
            why = " (most likely because rank %d failed first)" % root.rank if f.is_consequence or f.traceback is None else ""
            lines.append(f"rank {f.rank} also failed: {f.headline()}{why}")
    lines.append("The other processes were stopped.")
    return "\n".join(lines)


