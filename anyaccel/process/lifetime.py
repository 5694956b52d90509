"""How a process of a job ends, and what the processes it forks inherit.

**The end, bounded.** Once the user's script has returned (or raised), what is left — telling the
other ranks this one leaves, ending the process groups (:func:`anyaccel.process_group.shutdown`),
the interpreter's finalisation — runs under a bound, ``ANYACCEL_EXIT_TIMEOUT`` (30 s):
:func:`end_of_script`. The script's own ``atexit`` handlers are inside the bound too (a launcher
must never wait forever): one that may legitimately run longer — an upload left to exit time —
needs a larger ``ANYACCEL_EXIT_TIMEOUT``; trackers finish in ``end_training()``, before it. Past it the process prints what it was doing, with the Python stack
of every thread, and exits with :data:`EXIT_TIMEOUT_CODE`, so a launcher never waits forever on a
finished job (the launcher reports it as the rank's failure). A Python thread does that when it can
get the GIL; ``faulthandler``'s own C thread, which needs none, does it 5 s later when it cannot
(a deadlock that holds the GIL), exiting 1. Before the bound starts, the process waits for its
non-daemon threads, as the interpreter would (an asynchronous checkpoint still being written).

**Forks.** CPython 3.11 can deadlock a child forked while another thread takes the interpreter's
thread-list lock (python/cpython#112275: fixed in 3.12): gloo's worker threads take it whenever
they need the GIL to free a finished collective's tensors. DataLoader forks its workers (Linux's
default start method) from a rank whose gloo workers and hang doctor run. :func:`register_fork_hooks`
(every rank, once) makes every fork of the process safe, by construction rather than by timing
where it can be seen:

* before the fork, the forking thread releases the GIL until gloo's workers are idle
  (:func:`anyaccel.process_group.quiesce`, at most 1 s — a collective still running then is not
  in the lock), and holds the doctor's output lock, so the child never inherits a lock held by a
  thread that does not exist there;
* in the child, the hang doctor is forgotten (its thread and its store connection are the
  parent's; the child must never write to that socket), and — for a fork from the main thread —
  Linux is asked to SIGKILL the child when its parent dies (``PR_SET_PDEATHSIG``; Linux signals
  when the forking *thread* ends, so forks from helper threads are left to the launcher), so a
  DataLoader worker — and whatever it forks in turn — never outlives its rank, even a worker stuck
  where Python cannot run its own exit checks. A parent already gone by then ends the child at once.

Local to the calling process.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, Optional

from .. import envvars

__all__ = ["EXIT_TIMEOUT_CODE", "end_of_script", "ExitBound", "bound_at_exit", "register_fork_hooks", "die_with_parent"]

#: exit status of a process whose end took longer than ``ANYACCEL_EXIT_TIMEOUT`` after its script returned
EXIT_TIMEOUT_CODE = 70  # EX_SOFTWARE
_PID = os.getpid()  # a forked child does not arm its parent's bound at its exit


class ExitBound:
    """The bound on a process's end (module docstring). ``stage`` says what the process is doing
    now (it is part of the message); ``on_expire(message)`` runs, on the watching thread, before
    the process exits (the launch bootstrap records the failure for the launcher there)."""

    def __init__(self, seconds: float, label: str, on_expire: Optional[Callable[[str], None]] = None):
        _ARMED["bound"] = self
        self.seconds, self.label, self.on_expire = float(seconds), label, on_expire
        self.stage = "ending"
        self._start = time.monotonic()
        self._cancelled = threading.Event()
        err = sys.__stderr__
        if err is not None:  # (none: a process without stderr has nobody to tell)
            try:
                faulthandler.dump_traceback_later(self.seconds + 5.0, exit=True, file=err)
            except (ValueError, RuntimeError, OSError):  # a stderr without a file descriptor
                pass
        self._thread = threading.Thread(target=self._watch, name="anyaccel-exit-bound", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        """Disarm (a process that goes on running: a notebook cell, a test)."""
        _ARMED["bound"] = None
        self._cancelled.set()
        faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        if self._cancelled.wait(self.seconds):
            return
        message = (f"{self.label}: the script returned {time.monotonic() - self._start:.0f} s ago but the process has "
                   f"not ended; it was {self.stage}. The Python stack of every thread follows; ending the process "
                   f"(exit {EXIT_TIMEOUT_CODE}; ANYACCEL_EXIT_TIMEOUT={self.seconds:g} s).\n{thread_stacks()}")
        try:
            err = sys.__stderr__
            if err is not None:
                err.write(f"[anyaccel] {message}\n")
                err.flush()
            if self.on_expire is not None:
                self.on_expire(message)
        finally:
            os._exit(EXIT_TIMEOUT_CODE)


def thread_stacks() -> str:
    """The Python stack of every thread of this process, named, most recent call last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '(not a Python thread)')} ({ident})\n"
                     + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def end_of_script(label: str, on_expire: Optional[Callable[[str], None]] = None, force: bool = True,
                  failed: bool = False) -> ExitBound:
    """After the user's script (or notebook function) returned: wait for the non-daemon threads
    as the interpreter would, then, under the bound, end the process groups
    (:func:`anyaccel.process_group.shutdown`; ``force``: also a group the user's code made; a
    ``failed`` script's collectives may never finish, so their workers get 2 s, not 10).
    Returns the armed :class:`ExitBound`: it stays armed through ``atexit`` handlers (the script's
    own too: a handler that may legitimately run long needs a larger ``ANYACCEL_EXIT_TIMEOUT``) and
    the interpreter's finalisation.
    Local. Imports nothing heavy: a script that never imported torch.distributed has no group."""
    if not failed:
        _join_non_daemon_threads()
    bound = ExitBound(envvars.read(envvars.EXIT_TIMEOUT), label, on_expire)
    if "torch.distributed" in sys.modules:
        from . import process_group

        bound.stage = "waiting for gloo's worker threads to be idle, then ending the process groups"
        process_group.shutdown(force=force, timeout=2.0 if failed else 10.0, quiet=failed)
    bound.stage = "in atexit handlers or the interpreter's finalisation"
    return bound


_ARMED: Dict[str, Optional[ExitBound]] = {"bound": None}
_AT_EXIT: Dict[str, bool] = {"registered": False}


def bound_at_exit(label: str) -> None:
    """For a process no anyaccel launcher started (torchrun, srun, ``python``): arm the bound when
    the interpreter starts its ``atexit`` handlers, which run after the script returned — unless a
    launcher's worker armed it already (:func:`end_of_script`). Register it after the process
    group's own handler (it runs before it: ``atexit`` is last in, first out). ``label`` names the
    process in the message (``"rank 3"``). Once per process."""
    if not _AT_EXIT["registered"]:
        _AT_EXIT["registered"] = True
        atexit.register(_arm_at_exit, label)


def _arm_at_exit(label: str) -> None:
    if _ARMED["bound"] is None and os.getpid() == _PID:
        try:
            bound = ExitBound(envvars.read(envvars.EXIT_TIMEOUT), label)
        except RuntimeError:  # no new thread at this point of the shutdown: faulthandler's still is
            return
        bound.stage = "in atexit handlers (the process groups' end among them) or the interpreter's finalisation"


def _join_non_daemon_threads() -> None:
    """What the interpreter does before its ``atexit`` handlers: the threading-exit callbacks first
    (``concurrent.futures`` executors tell their worker threads to stop there; joined without
    them, an executor kept in a global never ends), then join every non-daemon thread."""
    callbacks = getattr(threading, "_threading_atexits", None)
    if callbacks:
        for call in reversed(list(callbacks)):
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - as the interpreter, report and go on
                sys.stderr.write(f"[anyaccel] a threading exit callback failed: {exc!r}\n")
        callbacks.clear()  # done: the interpreter would call them once
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon and thread is not threading.main_thread():
            thread.join()


# --------------------------------------------------------------------------------------------
# Forks
# --------------------------------------------------------------------------------------------

_FORK: Dict[str, Any] = {"registered": False, "prctl": None, "parent": None, "from_main": False}
_PR_SET_PDEATHSIG = 1


def _prctl() -> Any:
    """libc's ``prctl`` (Linux), looked up once in the parent: a forked child must not load libraries."""
    if _FORK["prctl"] is None and sys.platform.startswith("linux"):
        try:
            import ctypes

            _FORK["prctl"] = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
            _FORK["prctl"] = False
    return _FORK["prctl"] or None


def die_with_parent(sig: int = signal.SIGKILL, parent: Optional[int] = None) -> bool:
    """Ask Linux to send ``sig`` to this process when the thread that created it dies
    (``PR_SET_PDEATHSIG``); with ``parent`` (its expected pid), end at once when the parent is
    already gone. Returns False where Linux cannot be asked. Local."""
    prctl = _prctl()
    if prctl is None:
        return False
    prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if parent is not None and os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)
    return True


def register_fork_hooks() -> None:
    """Make this process's forks safe (module docstring). Once per process; Local."""
    if _FORK["registered"] or not hasattr(os, "register_at_fork"):
        return
    _FORK["registered"] = True
    _prctl()
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


def _before_fork() -> None:
    from .. import doctor
    from . import process_group

    _FORK["parent"] = os.getpid()
    _FORK["from_main"] = threading.current_thread() is threading.main_thread()
    process_group.quiesce(timeout=1.0)
    doctor.pause_output()


def _after_fork_in_parent() -> None:
    from .. import doctor

    doctor.resume_output()


def _after_fork_in_child() -> None:
    from .. import doctor

    doctor.forget_in_child()
    if _FORK["from_main"]:  # Linux signals when the forking *thread* ends: a helper thread's forks may outlive it
        die_with_parent(signal.SIGKILL, _FORK["parent"])
