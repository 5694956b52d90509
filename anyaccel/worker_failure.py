"""A worker's failure, written where the launcher reads it: the worker side of
:mod:`anyaccel.launch.failures`.

:func:`record_failure` puts an exception and its traceback into the error file that torch's
elastic agent names in ``TORCHELASTIC_ERROR_FILE``, in torchelastic's own JSON format plus an
``anyaccel`` entry (rank, exact time, a trimmed traceback, the pickled exception when it can be
pickled), and a copy per rank in ``ANYACCEL_FAILURE_DIR``. The worker bootstrap calls it for the
exception that ended the user's script; the hang doctor for the mismatch it ends a process for
(:mod:`anyaccel.doctor.giveup`), which is why it lives below both. Local; imports only the standard
library and anyaccel's foundations (the bootstrap loads it before the user script).
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import threading
import time
import traceback
from typing import Optional

from . import envvars
from .environment.detectors import LaunchFacts, detect_topology, launch_facts
from .errors import JobEnvironmentError

__all__ = ["add_plumbing", "user_traceback", "worker_launch_facts", "worker_rank", "record_failure"]

# Frames of these files sit between the launcher and the user's code; tracebacks start after them.
_PLUMBING = {os.path.abspath(__file__)}  # (the launch package adds its own files)


def add_plumbing(path: str) -> None:
    """Hide frames of ``path`` at the top of worker tracebacks (the bootstrap and runpy)."""
    _PLUMBING.add(os.path.abspath(path))


def user_traceback(exc: BaseException) -> str:
    """``exc``'s traceback without the launcher's own frames at the top."""
    tb = exc.__traceback__
    while tb is not None and (
        os.path.abspath(tb.tb_frame.f_code.co_filename) in _PLUMBING or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")
    ):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def worker_launch_facts() -> LaunchFacts:
    """The launcher's facts in a worker that has no ``Environment`` (yet): malformed variables
    read as "no facts" here, since this runs while a failure is being reported. Local."""
    try:
        return launch_facts()
    except JobEnvironmentError:
        return LaunchFacts()


def worker_rank() -> Optional[int]:
    """This worker's rank as its launcher gave it (None: one process, or unreadable variables). Local."""
    try:
        topology = detect_topology()
    except JobEnvironmentError:
        return None
    return topology.rank if topology is not None else None


def record_failure(exc: BaseException, rank: Optional[int] = None) -> bool:
    """Write ``exc`` to ``$TORCHELASTIC_ERROR_FILE`` (called by the failing worker only). Returns
    False when no error file was asked for (the caller must then print the traceback itself)."""
    launch = worker_launch_facts()
    path = launch.error_file
    if not path:
        return False
    text = user_traceback(exc)
    attempt = launch.restart_attempt
    extra = {"rank": rank, "time": time.time(), "type": type(exc).__name__, "summary": _summary(exc), "traceback": text,
             "pid": os.getpid(), "attempt": attempt}  # fmt: skip
    try:
        extra["pickled"] = base64.b64encode(pickle.dumps(exc)).decode("ascii")
        pickle.loads(base64.b64decode(extra["pickled"]))  # unpicklable on the way back: leave it out
    except Exception:
        extra.pop("pickled", None)
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time())), "anyaccel": extra},
        }
    }
    # The agent reports only the failures it noticed (with forked workers: only one of them); a
    # copy per rank in $ANYACCEL_FAILURE_DIR lets the launcher find the true root cause anyway.
    side = os.environ.get(envvars.FAILURE_DIR.name)
    targets = [path] + ([os.path.join(side, f"rank{rank}-attempt{attempt}.json")] if side and rank is not None else [])
    written = False
    for target in targets:
        # A temporary file renamed over the target: two threads of one process may record at once
        # (the hang doctor's give-up beside the main thread's exception, or the doctor's two threads),
        # and either may os._exit mid-write; the agent's json.load of a mixed or cut file raises.
        tmp = f"{target}.{os.getpid()}-{threading.get_ident()}.tmp"
        try:
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, target)
            written = written or target == path
        except OSError:
            pass
    return written


def _summary(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
