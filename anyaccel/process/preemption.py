"""Checkpoint on preemption: every rank stops at the same batch boundary, saves, and exits 75.

A job is preempted by a signal: SIGTERM (Kubernetes eviction, ``scancel``, ``anyaccel launch``
receiving it) or SIGUSR1 (SLURM's ``--signal=USR1@<seconds>``). Not every rank receives it (only
one machine's launcher may have), and ranks must stop at the *same* step or the checkpoint's
collectives hang. So, without any collective on the hot path:

1. The signal handler only sets a flag. (``anyaccel launch`` forwards a signal it receives to its
   workers and gives them a grace period instead of its usual few seconds before SIGKILL; a
   worker that exits with 75 is never restarted: :mod:`anyaccel.launch.elastic`.)
2. The hang doctor's thread (:mod:`anyaccel.doctor`) publishes the request in the job's store;
   every rank's thread sees it within a second and publishes the next boundary its main thread
   cannot have passed yet (``boundaries + 1``).
3. The stop boundary is the largest of those. At each boundary (before the training loader's next
   batch, at a gradient-sync point) the main thread compares one integer; a rank that reaches a
   boundary while the stop is still being agreed waits there (only the threads must answer, so
   this is a wait of about a second, once), then runs on to the stop boundary.
4. There :meth:`Preemption.boundary` calls its owner's ``on_stop`` (the
   :class:`~anyaccel.accelerator.Accelerator`'s, held weakly), which saves a complete ``save_state``
   checkpoint (atomic as always), rank 0 asks SLURM to requeue the job when it was submitted with
   ``--requeue``, and every rank exits with :data:`PREEMPTED_EXIT_CODE` (75, ``EX_TEMPFAIL``).

Per batch the cost is one call (the loader calls :meth:`Preemption.boundary` itself), an integer
increment and three attribute reads. A single process decides
alone. Local to each process except where a step says otherwise.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

from .. import envvars
from ..errors import ConfigError

__all__ = ["PREEMPTED_EXIT_CODE", "DEFAULT_SIGNALS", "parse_signals", "Preemption", "requeue_slurm_job"]

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later" — start the same command to resume
DEFAULT_SIGNALS = tuple(envvars.PREEMPTION_SIGNALS.default.split(","))  # the default's one home: envvars
_ALLOWED = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGCONT")


def parse_signals(value: Any, source: str = "preemption_signals") -> tuple:
    """``"SIGTERM,SIGUSR1"`` / ``["SIGUSR1"]`` / ``"none"`` → a tuple of signal names (empty:
    off). Names may omit ``SIG``; raises :class:`ConfigError` naming an unknown one."""
    if value is None:
        return DEFAULT_SIGNALS
    items = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    if len(items) == 1 and str(items[0]).strip().lower() in ("none", "no", "off", ""):
        return ()
    names = []
    for item in items:
        name = str(item).strip().upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        if name not in _ALLOWED or getattr(signal, name, None) is None:
            raise ConfigError(f"{source}: {item!r} is not a preemption signal anyaccel can catch; use names from "
                              f"{', '.join(s for s in _ALLOWED if hasattr(signal, s))} (or none to turn it off)")
        if name not in names:
            names.append(name)
    return tuple(names)


class Preemption:
    """One process's side of the protocol (see the module docstring). An ``Accelerator``'s
    runtime owns it: the training loader calls :meth:`boundary`, and the runtime's ``close()``
    calls :meth:`uninstall`. It holds its owner only weakly (``on_stop``, a ``weakref.WeakMethod``),
    so the signal handler and the doctor's subscription never keep an ``Accelerator`` alive."""

    def __init__(self, signals: Sequence[str], rank: int, world_size: int, agree_timeout: float = 120.0):
        self.signals = tuple(signals)
        self.rank, self.world = rank, world_size
        self.agree_timeout = agree_timeout
        self.boundaries = 0  # boundaries the main thread has passed
        self.pending = False  # a stop was asked for, here or on another rank
        self.target: Optional[int] = None  # the boundary where every rank stops
        self.reason: Optional[str] = None
        self._local: Optional[str] = None  # the signal this process received
        self._published = False
        self._answered = False
        self._previous: dict = {}
        self._installed = False
        self.coordinated = world_size <= 1  # several ranks agree only through the hang doctor's store
        self.in_loop: Callable[[], bool] = _yes  # is the training loader being iterated? (set by the owner)
        self.gate: Any = None  # an object whose ``micro_step`` is 0 at a gradient-sync point (the owner's)
        self.on_stop: Any = None  # a weak reference to the owner's ``on_stop(reason)`` (set by the owner)
        self._give_up = False

    # ---- signals ---------------------------------------------------------------------------------
    def install(self) -> bool:
        """Catch the signals (main thread only; returns False elsewhere, where Python cannot)."""
        if self._installed or not self.signals:
            return self._installed
        if threading.current_thread() is not threading.main_thread():
            return False
        for name in self.signals:
            sig = getattr(signal, name)
            previous = signal.getsignal(sig)
            owner = getattr(previous, "__self__", None)
            if isinstance(owner, Preemption) and owner is not self:
                # another Accelerator of this process had the signal: the newest one takes it over
                # (and restores what was there before both), rather than chaining to the old one
                previous = owner._previous.pop(sig, signal.SIG_DFL)
                owner._installed = bool(owner._previous)
            self._previous[sig] = previous
            signal.signal(sig, self._on_signal)
        self._installed = True
        return True

    def __getstate__(self) -> dict:
        """Pickling: signal handlers belong to the process that installed them, so a copy has none."""
        state = dict(self.__dict__)
        state["_previous"], state["_installed"], state["in_loop"], state["on_stop"] = {}, False, _yes, None
        return state

    @property
    def installed(self) -> bool:
        """Whether this object's handlers are installed (see :meth:`install`)."""
        return self._installed

    def uninstall(self) -> None:
        """Put back, for each signal this object still holds, the handler that was there before
        it. Main thread; safe to call twice. Local."""
        for sig, handler in self._previous.items():
            try:
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            except (ValueError, OSError, TypeError):  # not the main thread any more
                pass
        self._previous.clear()
        self._installed = False

    def _on_signal(self, signum: int, frame: Any) -> None:
        if envvars.launcher_gone() or not self.coordinated or self._give_up:  # nobody to stop with, or no boundary came
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self._local is not None:
            return  # a repeat (the launcher forwarding what SLURM already sent): one stop is enough
        if not self.in_loop():  # no training loop running: wait for one to start, but not forever
            threading.Thread(target=self._watch, args=(signum,), name="anyaccel-preemption-watch", daemon=True).start()
        self._local = self.reason = signal.Signals(signum).name
        sys.stderr.write(f"[anyaccel] rank {self.rank}: {self.reason} received; stopping at the next step boundary "
                         "to save a checkpoint\n")
        if self.world <= 1:
            self.pending = True
            self.target = self.boundaries + 1

    def _watch(self, signum: int) -> None:
        """The signal came while no training loop ran (evaluation between epochs, or after the
        loop): if no batch boundary comes within ``agree_timeout`` seconds, the signal takes its
        usual effect (the process ends) instead of being held forever."""
        deadline = time.monotonic() + self.agree_timeout
        start = self.boundaries
        while time.monotonic() < deadline:
            if self.boundaries != start:
                return
            time.sleep(0.1)
        self._give_up = True
        sys.stderr.write(f"[anyaccel] rank {self.rank}: no training batch within {self.agree_timeout:g} s of "
                         f"{self.reason}; it takes its usual effect\n")
        os.kill(os.getpid(), signum)

    # ---- the store (the hang doctor's thread) ------------------------------------------------------
    def store_lost(self) -> None:
        """The doctor gave the job's store up: the ranks can no longer agree on a stop step, so a
        signal from now on takes its usual effect (the process ends) instead of waiting for an
        agreement that cannot come; so does one that came and was not agreed on yet."""
        if self.world > 1:
            self.coordinated = False
            if self._local is not None and self.target is None:  # a signal came and cannot be agreed on now
                self._give_up = True
                os.kill(os.getpid(), signal.Signals[self._local])  # the handler lets it take its usual effect

    def poll(self, store: Any) -> None:
        """Run by the doctor thread every interval with the job's store."""
        if self._local is not None and not self._published:
            store.compare_set("preempt/reason", "", f"{self._local} on rank {self.rank}")
            self._published = True
        if not self._answered and (self._local is not None or store.check(["preempt/reason"])):
            if self.reason is None:
                self.reason = store.get("preempt/reason").decode()
            self.pending = True  # first: the main thread waits at its next boundary from now on ...
            store.set(f"preempt/at/{self.rank}", str(self.boundaries + 1))  # ... which is this one or later
            self._answered = True
        if self._answered and self.target is None:
            keys = [f"preempt/at/{r}" for r in range(self.world)]
            if store.check(keys):  # one round trip for all ranks' answers where the store can (W gets otherwise)
                values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
                self.target = max(int(v) for v in values)

    # ---- the main thread ---------------------------------------------------------------------------
    def boundary(self) -> None:
        """Called by the training loader before each batch (its ``on_batch``). Counts the
        boundaries at gradient-sync points (``gate.micro_step == 0``: never inside an accumulation
        group) and, at the one where every rank stops, calls the owner's ``on_stop(reason)``.
        The per-batch path: keep it to a few attribute reads."""
        gate = self.gate
        if gate is not None and gate.micro_step:
            return
        self.boundaries += 1
        if self.pending:
            self._at_pending_boundary()

    def _at_pending_boundary(self) -> None:
        if self.target is None:
            self._wait_for_target()
        if self.boundaries >= self.target:  # (never greater: see the module docstring)
            self.pending = False
            stop = self.on_stop() if self.on_stop is not None else None
            if stop is not None:
                stop(self.reason or "a preemption signal")

    def _wait_for_target(self) -> None:
        deadline = time.monotonic() + self.agree_timeout
        while self.target is None:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"rank {self.rank}: {self.reason} asked every rank to stop, but not every rank answered within "
                    f"{self.agree_timeout:g} s (a rank died or cannot reach the job's store); no checkpoint was "
                    "written")
            time.sleep(0.005)


def _yes() -> bool:
    return True


def requeue_slurm_job(launch: Optional[Any] = None) -> Optional[str]:
    """When this is a SLURM job submitted with ``--requeue``, run ``scontrol requeue <job>`` and
    return a line saying so (None otherwise, or a line saying why it failed). ``launch``: the
    ``Environment.launch`` facts (read from the launcher's variables when not given). Local; call
    from one rank, after the checkpoint is complete."""
    import shutil
    import subprocess

    from ..environment.detectors import launch_facts

    job = (launch if launch is not None else launch_facts()).slurm_requeue_id
    if not job or shutil.which("scontrol") is None:
        return None
    try:
        shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"could not ask SLURM whether job {job} may be requeued: {exc}"
    if "Requeue=1" not in shown.stdout:
        return None
    # Requeueing ends every process of the job (SIGTERM, SIGKILL after KillWait), scontrol itself
    # included, often before it has answered: it runs with SIGTERM ignored (kept across exec).
    requeue = ["sh", "-c", 'trap "" TERM; exec scontrol requeue "$0"', job]
    try:
        done = subprocess.run(requeue, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:  # never raise: the other ranks wait for this one
        return f"`scontrol requeue {job}` failed: {exc}"
    if done.returncode < 0:
        return (f"`scontrol requeue {job}` was ended by signal {-done.returncode} before it answered; "
                f"`squeue -j {job}` says whether the job was requeued")
    if done.returncode != 0:
        return f"`scontrol requeue {job}` failed: {(done.stderr or done.stdout).strip()}"
    return f"SLURM job {job} requeued; it resumes from this checkpoint when it starts again"
