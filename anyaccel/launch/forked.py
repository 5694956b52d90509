"""The notebook launcher's fast path: one machine, no restarts, the workers forked by the calling
process itself (no torch elastic agent).

Why: importing torch's elastic agent made most of ``notebook_launcher``'s start-up (2026-11-29,
cProfile on the kernel's CPU time up to its first fork: 80 % in :func:`~anyaccel.launch.elastic.run_elastic`,
of which 28 points are ``torch.distributed.elastic.rendezvous`` scanning the entry points of every
installed distribution at import, 50 modules loaded by the call). A one-machine job without
restarts needs none of it: this module binds the job's TCP store on 127.0.0.1 (the same
:func:`~anyaccel.launch.elastic.loopback_store` as the elastic path), forks the workers with
``os.fork`` and watches them. Several machines, or ``max_restarts`` > 0, still go through torch's
agent (:func:`~anyaccel.launch.elastic.run_elastic`).

What the workers and the caller see is the elastic path's: the same variables (torch's agent's
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_*`` with
the agent's store, plus ``ANYACCEL_AGENT_PID`` and ``ANYACCEL_FAILURE_DIR``); a failing worker's
report in ``TORCHELASTIC_ERROR_FILE``, read back with :func:`~anyaccel.launch.failures.failures_from`
and raised as :class:`~anyaccel.launch.elastic.JobFailed` once the other workers are stopped
(SIGTERM, then SIGKILL after ``shutdown_timeout``); a signal to the caller stops every worker the
same way (SIGINT, SIGHUP, SIGQUIT: ``KeyboardInterrupt``; SIGTERM, SIGUSR1: the workers get the
preemption grace, then :class:`~anyaccel.launch.elastic.JobPreempted` when each saved or had
finished). The caller's signal handlers are put back afterwards. Local to the launching process.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .. import envvars
from . import failures
from .elastic import JobFailed, JobPreempted, loopback_store

__all__ = ["run_forked", "rank_env", "failures_of"]

failures.add_plumbing(__file__)

_STOP_SIGNALS = ("SIGINT", "SIGHUP", "SIGQUIT")  # stop the workers, raise KeyboardInterrupt
_PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")  # forwarded; the workers get the grace to checkpoint


class _Stopped(BaseException):
    """A signal reached the launching process while its workers ran."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _Received:
    """The signals that reached this process during the launch. The handler only notes them and the
    loops below raise :class:`_Stopped`: a handler that raised could run inside ``os.fork``'s
    at-fork hooks (logging's), where the exception is printed and dropped, and the interrupt lost."""

    def __init__(self) -> None:
        self.signals: List[int] = []

    def handler(self, signum: int, frame: Any) -> None:
        self.signals.append(signum)

    def check(self) -> None:
        if self.signals:
            raise _Stopped(self.signals[0])

    def hurry(self) -> bool:
        """A second signal, an interrupt (Ctrl-C twice; not a repeated preemption signal): stop
        waiting for the workers."""
        return any(signal.Signals(s).name not in _PREEMPTION_SIGNALS for s in self.signals[1:])


def rank_env(local_rank: int, nproc: int, port: int, run_id: str) -> Dict[str, str]:
    """The variables torch's elastic agent gives worker ``local_rank`` of a one-machine job of
    ``nproc`` workers whose store is on 127.0.0.1:``port``. Local; pure but for ``OMP_NUM_THREADS``
    and ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, passed on as the agent does."""
    env = {
        "RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "GROUP_RANK": "0", "ROLE_RANK": str(local_rank),
        "ROLE_NAME": "anyaccel", "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the workers join the store this process serves
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }  # fmt: skip
    if "OMP_NUM_THREADS" in os.environ:
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    return env


def run_forked(nproc: int, worker_env: Dict[str, str], body: Callable[..., Any], function: Callable[..., Any],
               args: tuple, port: Optional[int] = None, monitor_interval: float = 0.02,
               shutdown_timeout: float = 5.0, grace: float = 120.0) -> Dict[int, Any]:
    """Fork ``nproc`` workers that each run ``body(function, args)`` and return ``{0: rank 0's
    return value}``. Local: called once per launch by the process that forks.

    Raises ``OSError`` when ``port`` is taken, :class:`JobFailed` when a worker fails (the others
    are stopped first), ``KeyboardInterrupt`` (with ``.signal``) on SIGINT/SIGHUP/SIGQUIT and
    :class:`JobPreempted` after SIGTERM/SIGUSR1 when every worker saved or had finished (else
    ``KeyboardInterrupt``); every worker has ended when it returns or raises."""
    store, port = loopback_store(port)
    side = tempfile.mkdtemp(prefix="anyaccel-failures-")
    run_id = f"anyaccel-{uuid.uuid4().hex[:12]}"
    common = {**worker_env, envvars.AGENT_PID.name: str(os.getpid()), envvars.FAILURE_DIR.name: side}
    workers: Dict[int, int] = {}  # local rank -> pid
    codes: Dict[int, int] = {}  # local rank -> exit code, once reaped
    received = _Received()
    try:
        with _handlers(_STOP_SIGNALS + _PREEMPTION_SIGNALS, received.handler), envvars.set_temporarily(common):
            try:
                for local_rank in range(nproc):
                    env = {**rank_env(local_rank, nproc, port, run_id),
                           "TORCHELASTIC_ERROR_FILE": os.path.join(side, f"error-{local_rank}.json")}
                    pid = os.fork()
                    if pid == 0:  # pragma: no cover - the child (its coverage is the workers')
                        _child(env, local_rank, body, function, args, side)
                    workers[local_rank] = pid
                    received.check()
                failed = _watch(workers, codes, monitor_interval, received)
            except _Stopped as stop:
                raise _stopped(stop.signum, workers, codes, shutdown_timeout, grace, received) from None
            except BaseException:  # KeyboardInterrupt without a handler of ours, or an error here
                _stop(workers, codes, signal.SIGTERM, shutdown_timeout)
                raise
            if failed:
                _stop(workers, codes, signal.SIGTERM, shutdown_timeout)
                found = failures_of(failed, workers, codes, side)
                raise JobFailed(found, failures.report(found, nproc))
            return {0: _result(side)}
    finally:
        _stop(workers, codes, signal.SIGKILL, 0.0)  # nothing outlives the call, whatever happened above
        del store
        shutil.rmtree(side, ignore_errors=True)


def _child(env: Dict[str, str], local_rank: int, body: Callable[..., Any], function: Callable[..., Any],
           args: tuple, side: str) -> None:
    """A forked worker: its variables, the caller's signal handlers reset, ``body``; it never
    returns into the caller's stack (``os._exit``)."""
    code = 1
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)  # body() resets the others
        os.environ.update(env)
        target = os.path.join(side, "result.pkl") if local_rank == 0 else None
        body(_Returning(function, target), args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # body() records the failure itself
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


class _Returning:
    """The user's function, whose return value rank 0 leaves in ``target`` for the caller (an
    unpicklable value fails rank 0, with the pickling error as its traceback)."""

    def __init__(self, function: Callable[..., Any], target: Optional[str]):
        self.function = function
        self.target = target

    def __call__(self, *args: Any) -> Any:
        value = self.function(*args)
        if self.target is not None:
            with open(self.target + ".tmp", "wb") as fh:
                pickle.dump(value, fh)
            os.replace(self.target + ".tmp", self.target)
        return value


def _result(side: str) -> Any:
    try:
        with open(os.path.join(side, "result.pkl"), "rb") as fh:
            return pickle.load(fh)
    except FileNotFoundError:
        return None


def _reap(workers: Dict[int, int], codes: Dict[int, int]) -> List[int]:
    """Collect the workers that ended since the last call; returns their local ranks."""
    ended = []
    for local_rank, pid in workers.items():
        if local_rank in codes:
            continue
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped by someone else (a SIGCHLD handler of the caller's)
            done, status = pid, 0
        if done:
            codes[local_rank] = os.waitstatus_to_exitcode(status) if status else 0
            ended.append(local_rank)
    return ended


def _watch(workers: Dict[int, int], codes: Dict[int, int], interval: float, received: _Received) -> List[int]:
    """Wait until every worker ended (returns []) or one failed (returns the failed local ranks);
    raises :class:`_Stopped` when a signal arrived meanwhile."""
    while len(codes) < len(workers):
        received.check()
        failed = [r for r in _reap(workers, codes) if codes[r] != 0]
        if failed:
            return failed
        if len(codes) < len(workers):
            time.sleep(interval)
    return []


def _stop(workers: Dict[int, int], codes: Dict[int, int], sig: int, timeout: float,
          hurry: Callable[[], bool] = lambda: False) -> None:
    """Send ``sig`` to the workers still running, wait up to ``timeout`` s (less once ``hurry()``),
    then SIGKILL them and reap."""
    _reap(workers, codes)
    for local_rank, pid in workers.items():
        if local_rank not in codes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    deadline = time.monotonic() + timeout
    while len(codes) < len(workers) and time.monotonic() < deadline and not hurry():
        time.sleep(0.01)
        _reap(workers, codes)
    for local_rank, pid in workers.items():
        if local_rank not in codes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                codes[local_rank] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            codes.setdefault(local_rank, -signal.SIGKILL)


def _stopped(signum: int, workers: Dict[int, int], codes: Dict[int, int], shutdown_timeout: float,
             grace: float, received: _Received) -> BaseException:
    """Stop the workers after ``signum`` reached this process; what the launch raises. A repeated
    preemption signal during the grace is ignored (SLURM may signal again); an interrupt ends it."""
    name = signal.Signals(signum).name
    preempted = name in _PREEMPTION_SIGNALS
    running = {r for r in workers if r not in codes}
    _stop(workers, codes, signum, grace if preempted else shutdown_timeout, received.hurry)
    from ..process.preemption import PREEMPTED_EXIT_CODE

    if preempted and all(codes[r] in (0, PREEMPTED_EXIT_CODE) for r in workers):
        return JobPreempted(name, dict(codes))
    late = " (after the grace period, killed with SIGKILL)" if any(codes[r] == -signal.SIGKILL for r in running) else ""
    interrupt = KeyboardInterrupt(f"stopped by {name}; every worker was stopped{late}")
    interrupt.signal = signum  # type: ignore[attr-defined]
    return interrupt


def failures_of(failed: List[int], workers: Dict[int, int], codes: Dict[int, int], side: str) -> List[failures.Failure]:
    """The failures of the ``failed`` local ranks (their exit codes, their error files in ``side``),
    in the elastic path's form, plus what other ranks recorded in ``side``. Local."""
    reported: Dict[int, Any] = {}
    for local_rank in failed:
        path = os.path.join(side, f"error-{local_rank}.json")
        data: Dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            with open(path) as fh:
                data = json.load(fh)
        reported[local_rank] = _ProcessFailure(local_rank, workers[local_rank], codes[local_rank], data,
                                               os.path.getmtime(path) if data else time.time())
    return failures.failures_from(_ChildFailed(reported), side)


class _ProcessFailure:
    """What :func:`~anyaccel.launch.failures.failures_from` reads of torch's ``ProcessFailure``."""

    def __init__(self, local_rank: int, pid: int, exitcode: int, error_file_data: Dict[str, Any], timestamp: float):
        self.local_rank, self.pid, self.exitcode = local_rank, pid, exitcode
        self.error_file_data, self.timestamp = error_file_data, timestamp


class _ChildFailed:
    def __init__(self, found: Dict[int, _ProcessFailure]):
        self.failures = found


@contextlib.contextmanager
def _handlers(names: Tuple[str, ...], handler: Any) -> Iterator[None]:
    """``handler`` for the signals ``names`` during the block, the caller's handlers after it.
    Off the main thread, signals stay as they are."""
    saved: Dict[int, Any] = {}
    try:
        for name in names:
            sig = getattr(signal, name, None)
            if sig is not None:
                try:
                    saved[sig] = signal.signal(sig, handler)
                except (ValueError, OSError):  # not the main thread
                    break
        yield
    finally:
        for sig, old in saved.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(sig, old if old is not None else signal.SIG_DFL)
