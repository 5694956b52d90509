"""The first code a worker runs: ``python -u -m anyaccel.launch.bootstrap [-m] TARGET [ARGS...]``.

Each worker process started by ``anyaccel launch`` runs this module, which runs the user's script
(``runpy.run_path``) or module (``runpy.run_module``) as ``__main__`` with ``sys.argv`` exactly as
``python TARGET ARGS...`` would see it. If the script raises, the exception and its traceback go
to torch elastic's error file and the worker exits with status 1 without printing them: the
launcher prints the root cause once, labelled with its rank. (When the agent will restart the
job, the worker prints its traceback itself so that it is not lost.)

The worker also asks Linux to SIGKILL it when its launcher dies, so a launcher killed with
SIGKILL leaves no orphans behind (the processes it forks are SIGKILLed when it dies:
:mod:`anyaccel.lifetime`). Once the script has returned or raised, the rest of the worker's life —
telling the other ranks it leaves, ending the process groups once gloo's threads are idle, atexit
handlers, finalisation — runs under ``ANYACCEL_EXIT_TIMEOUT`` (30 s); past it the worker prints
every thread's stack, records the failure for the launcher and exits 70
(:func:`anyaccel.lifetime.end_of_script`). Only the standard library is imported before the
user's code.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional, Sequence

from .. import envvars
from . import failures

__all__ = ["main", "run_target"]

failures.add_plumbing(__file__)
failures.add_plumbing(runpy.__file__)


def run_target(target: str, args: Sequence[str], is_module: bool) -> None:
    """Run ``target`` (a script path, or a module name when ``is_module``) as ``__main__`` in
    this process with ``sys.argv = [target, *args]``; local to the calling process."""
    if is_module:
        sys.argv = [target, *args]  # sys.path[0] is already the working directory, as with `python -m`
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        path = os.path.abspath(target)
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(path)  # as `python script.py` does
        runpy.run_path(path, run_name="__main__")


def _die_with_parent() -> None:
    parent = os.environ.get(envvars.AGENT_PID.name)
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        # SIGKILL, not SIGTERM: a rank waiting inside a collective runs no Python signal handler (the
        # preemption handler catches SIGTERM), and would wait for the group's timeout (30 min)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # pragma: no cover - best effort
        return
    if str(os.getppid()) != parent and envvars.launcher_gone():  # died before prctl (or a wrapper started us)
        os._exit(1)  # do not run orphaned


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of every worker; returns the exit status (0, 1 on an exception, 130 on Ctrl-C)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    is_module = bool(argv) and argv[0] == "-m"
    if is_module:
        argv = argv[1:]
    if not argv:
        print("usage: python -m anyaccel.launch.bootstrap [-m] TARGET [ARGS...]", file=sys.stderr)
        return 2
    _die_with_parent()
    code = _run(argv[0], argv[1:], is_module)
    end_of_job(code)
    return code


def _run(target: str, args: Sequence[str], is_module: bool) -> int:
    """Run the user's code; its exit status, the failure recorded for the launcher."""
    try:
        run_target(target, args, is_module)
        note_exit(0)
    except SystemExit as exc:
        code = exc.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        note_exit(code or 0, exc)
        return code or 0
    except KeyboardInterrupt as exc:
        note_exit(130, exc)
        return 130
    except BaseException as exc:
        note_exit(1, exc)
        rank = failures.worker_rank()
        written = failures.record_failure(exc, rank)
        label = f"rank {rank}" if rank is not None else "worker"
        text = failures.user_traceback(exc)
        launch = failures.worker_launch_facts()
        restart = written and launch.restart_follows
        attempt = f" on attempt {launch.restart_attempt + 1}" if restart else ""
        if not written or restart:  # nobody else will print it (srun task), or a restart follows
            if failures.looks_like_consequence(text):
                line = text.strip().splitlines()[-1][:200]
                sys.stderr.write(f"[anyaccel] {label} stopped{attempt} (another rank failed): {line}\n")
            elif restart:
                sys.stderr.write(f"[anyaccel] {label} failed{attempt}; the launcher restarts the job:\n{text}")
            else:
                sys.stderr.write(f"[anyaccel] {label} failed:\n{text}")
        sys.stderr.flush()
        return 1
    return 0


def note_exit(code: int, exc: Optional[BaseException] = None) -> None:
    """Tell the other ranks (through the hang doctor) that this one leaves, with ``code`` (and the
    exception that ended it), so a rank still waiting in a collective can say who left instead of
    "connection closed"."""
    doctor = sys.modules.get("anyaccel.doctor")
    if doctor is not None:
        doctor.note_exit(code, exc)


def end_of_job(code: int) -> None:
    """What a worker does after the user's code returned with ``code``: under the exit bound, end
    the process groups (any the user's code left behind too, DDP reducers first); the bound stays
    armed through atexit handlers and finalisation, and reports to the launcher when it expires."""
    from ..process import lifetime

    rank = failures.worker_rank()
    label = f"rank {rank}" if rank is not None else "worker"
    failed = code not in (0, None)
    # a failed rank's own exception is recorded already: the bound's message goes to stderr only
    lifetime.end_of_script(label, on_expire=None if failed else (lambda message: _record_timeout(message, rank)),
                           failed=failed)


def _record_timeout(message: str, rank: Optional[int]) -> None:
    failures.record_failure(TimeoutError(message), rank)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
