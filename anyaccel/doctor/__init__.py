"""The hang doctor: which collective every rank is in, and a report instead of a silent hang.

Three parts, per process:

* :data:`TRACKER` (:mod:`anyaccel.doctor.tracker`) — the main thread marks where it is: every
  anyaccel collective (and the backward of a DDP sync step) enters with its operation and a
  sequence number and leaves afterwards. That is a few attribute writes: nothing measurable on the
  hot path. The sequence number also travels
  in the collectives' shape header (:mod:`anyaccel.ops`), so ranks that reach *different*
  collectives at the same point raise at once, naming each rank's call and ``file:line``.
* :class:`Doctor` — a daemon thread with its own client of the job's TCP store (the rendezvous
  store every launcher already runs; nothing on the local filesystem, no signals between
  machines). When this rank has waited in a collective longer than ``hang_timeout`` it asks every
  rank to publish where it is (the main thread's Python stack, read with ``sys._current_frames()``
  while it waits inside C++), prints one report with a verdict, and asks again at growing intervals
  (the wait may be legitimate: rank 0 evaluating while the others wait at a barrier). It answers
  the other ranks' requests, and carries the preemption stop step (:mod:`anyaccel.preemption`).
* Giving up — when the peers (or the job's store) cannot be reached, the doctor ends the process
  with exit :data:`UNREACHABLE_EXIT_CODE` instead of waiting for the process group's timeout:
  the rules are in :mod:`anyaccel.doctor.giveup`.
* :func:`explain` — when a collective finally fails (the process group's timeout, or a peer that
  left: gloo's "connection closed"), the error the user sees is the last report, or which rank left
  with what exit code while this rank waited in which collective, or — a peer that dropped its
  connection without leaving (SIGKILLed, its machine gone) — which rank on which host that was
  (from the address gloo names and the address every rank publishes); the rules are in
  :mod:`anyaccel.doctor.failed_collective`.

Every store operation has a timeout and every failure of the doctor itself is swallowed (once
logged): the doctor must never be what hangs or crashes a job.

The report's text and the user's stack (``file:line`` of a call) are in
:mod:`anyaccel.doctor.report`; when and how the doctor ends a process, in :mod:`anyaccel.doctor.giveup`.

Forks (:mod:`anyaccel.lifetime` calls these): :func:`pause_output` before a fork, so no child
inherits the doctor's stderr lock held; :func:`forget_in_child` in the child, which is not a rank
(the thread and the store connection are the parent's). They stay here, beside the process's
doctor they guard, which is why this module is a little over ~450 lines.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from .. import lazyclass
from ..environment import network
from ..environment.detectors import LaunchFacts
from ..errors import AnyaccelError, CheckpointError
from .report import call_site, format_report as _format_report, library_frame, user_stack
from .tracker import BACKWARD_LOCAL, BACKWARD_SYNC, TRACKER, Tracker

__all__ = ["TRACKER", "Tracker", "BACKWARD_SYNC", "BACKWARD_LOCAL", "waiting", "raise_explained", "Doctor", "Subscription", "start", "subscribe", "current",
           "explain", "note_exit", "call_site", "user_stack", "UNREACHABLE_EXIT_CODE", "pause_output", "resume_output",
           "forget_in_child"]


class waiting:  # noqa: N801 - used as a statement: `with waiting("reduce"):`
    """``with waiting(op):`` — the main thread is in collective ``op`` for the block: the tracker
    says so (``count=False`` leaves the sequence number alone, for waits that are not anyaccel
    collectives, such as DDP's all-reduce in ``backward``), the op in progress before it is current
    again afterwards, and a ``RuntimeError`` from torch.distributed leaves as :func:`explain`'s
    error (the peer that left, or the last hang report). A counted collective entered while the
    process runs a call alone (``TRACKER.alone``: a checkpoint hook calling ``gather`` during
    ``load_state`` on the main process alone) raises :class:`~anyaccel.errors.CheckpointError`
    instead: the others never enter it. Local."""

    __slots__ = ("op", "count", "outer")

    def __init__(self, op: str, count: bool = True):
        self.op, self.count = op, count

    def __enter__(self) -> None:
        self.outer = (TRACKER.op, TRACKER.counted)
        if self.count:
            if TRACKER.alone is not None:
                raise CheckpointError(
                    f"{self.op} (a collective) was called during {TRACKER.alone}: the other processes went on and "
                    "never enter it, so it would wait for ever. A hook registered with register_save_state_pre_hook "
                    "or register_load_state_pre_hook must not call collectives (gather, reduce, wait_for_everyone, "
                    "...) when the main process saves or loads alone: call save_state/load_state on every process, "
                    "or take the collective out of the hook")
            TRACKER.enter(self.op)
        else:
            TRACKER.op, TRACKER.counted, TRACKER.since = self.op, False, time.monotonic()

    def __exit__(self, kind: Any, exc: Optional[BaseException], tb: Any) -> bool:
        TRACKER.op, TRACKER.counted = self.outer
        if exc is not None:
            raise_explained(exc, self.op)
        return False


def raise_explained(exc: BaseException, op: str) -> None:
    """Raise :func:`explain`'s error instead of ``exc`` (a ``RuntimeError`` from torch.distributed
    while the main thread was in ``op``) when the doctor knows more; return otherwise (the caller
    re-raises ``exc``). The rule :class:`waiting` applies, for a hot path that marks the tracker
    inline (``Accelerator.backward``). Local."""
    if isinstance(exc, AnyaccelError):  # anyaccel's own, explained already: what the doctor knows of its cause is added
        cause = exc.__cause__
        if isinstance(cause, RuntimeError) and not isinstance(cause, AnyaccelError) and exc.args:
            better = explain(cause, op)
            if better is not cause:
                exc.args = (f"{exc.args[0]} ({better})", *exc.args[1:])
        return
    if not isinstance(exc, RuntimeError):
        return
    better = explain(exc, op)
    if better is not exc:
        raise better from None


# --------------------------------------------------------------------------------------------
# The doctor
# --------------------------------------------------------------------------------------------


class Subscription:
    """One owner's interest in the process's doctor (an ``Accelerator``'s runtime): its own
    ``hang_timeout``, a ``poll(store)`` the doctor's thread runs every round and an ``on_lost()``
    it calls once if the job's store is given up. :meth:`close` releases it (idempotent); the
    doctor holds nothing of the owner afterwards. Local."""

    __slots__ = ("hang_timeout", "poll", "on_lost", "_doctor")

    def __init__(self, doctor: "Doctor", hang_timeout: float, poll: Any = None, on_lost: Any = None):
        self.hang_timeout = float(hang_timeout)
        self.poll, self.on_lost = poll, on_lost
        self._doctor: Optional[Doctor] = doctor

    @property
    def active(self) -> bool:
        return self._doctor is not None

    def close(self) -> None:
        """Unsubscribe: the doctor forgets this owner's timeout and callbacks. Local; safe twice."""
        doctor, self._doctor = self._doctor, None
        if doctor is not None:
            doctor._unsubscribe(self)


class Doctor:
    """The per-process watcher (see the module docstring). Create with :func:`start`; owners
    take part with :meth:`subscribe`.

    The thread and its store client are the process's (as the process group is); what belongs to
    an owner — its ``hang_timeout``, its preemption callbacks — is a :class:`Subscription` that
    the owner closes. Collectives are the process's too (one process group), so the doctor
    reports a wait once it passes the *smallest* ``hang_timeout`` among the live subscriptions
    that have reports on (``> 0``); with none (no subscriber, or all ``0``) it reports nothing but
    still answers the other ranks' requests."""

    def __init__(self, env: Any, interval: float = 1.0):
        self.rank, self.world = env.rank, env.world_size
        self.interval = interval
        self._address = (env.main_address, env.main_port)
        self._namespace = _namespace(getattr(env, "launch", None) or LaunchFacts())  # (a bare env: one run)
        self._store: Any = None
        self._store_failed = False
        self._store_lock = threading.Lock()
        self._answered = 0
        self._next_report: Dict[int, float] = {}
        from .giveup import GiveUp  # (imported by the first doctor, not at import: the import budget)

        self._giving_up = GiveUp(self)
        self.last_report: Optional[str] = None
        self._subscriptions: List[Subscription] = []  # replaced, never mutated: the thread reads it unlocked
        self._subscriptions_lock = threading.Lock()
        self._lost_store = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="anyaccel-hang-doctor", daemon=True)
        self._main = threading.main_thread().ident
        self._pid = os.getpid()  # a forked child inherits this object, never its thread or store connection
        self._round_done = time.monotonic()  # when the thread last finished a round with the store
        self._thread.start()
        # A store call can block for good when machine 0 vanishes without closing the connection
        # (its link is down): a second thread, which never touches the store, watches for that.
        self._giving_up.start_watchdog()
        atexit.register(self._at_exit)

    # ---- subscriptions ----------------------------------------------------------------------------
    def subscribe(self, hang_timeout: float, poll: Any = None, on_lost: Any = None) -> Subscription:
        """Take part: ``hang_timeout`` seconds (``0``: no reports for this owner), ``poll(store)``
        run by the thread each round, ``on_lost()`` called once when the store is given up (at
        once when it already was). Returns the :class:`Subscription` to close. Local."""
        sub = Subscription(self, hang_timeout, poll, on_lost)
        with self._subscriptions_lock:
            self._subscriptions = self._subscriptions + [sub]
        if on_lost is not None and (self._lost_store or not self._thread.is_alive()):
            _call_quietly(on_lost)  # nobody polls for it any more: its owner falls back now
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._subscriptions_lock:
            self._subscriptions = [s for s in self._subscriptions if s is not sub]

    @property
    def subscriptions(self) -> List[Subscription]:
        """The live subscriptions (a copy)."""
        return list(self._subscriptions)

    @property
    def hang_timeout(self) -> float:
        """The timeout in force: the smallest positive ``hang_timeout`` of the live subscriptions,
        ``0`` (no reports) when there is none."""
        timeouts = [s.hang_timeout for s in self._subscriptions if s.hang_timeout > 0]
        return min(timeouts) if timeouts else 0.0

    # ---- the store ------------------------------------------------------------------------------
    def store(self) -> Any:
        """This process's own client of the job's TCP store (None when there is none). Made by
        whichever thread needs it first (the doctor's, or the main thread explaining a failure
        early in the job), and made afresh after a round whose store calls failed."""
        with self._store_lock:
            return self._connect()

    def _connect(self) -> Any:
        if self._store is None and not self._store_failed:
            try:
                import datetime

                import torch.distributed as dist

                host, port = self._address
                if port is None:
                    raise RuntimeError("no main port")
                client = dist.TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=10),
                                       wait_for_workers=False)
                self._store = dist.PrefixStore(self._namespace, client)
                if not getattr(self, "_published_host", False):  # for reports naming a rank that stops answering
                    self.address = network.address_for_peers(host)  # where peers reach this process
                    self._store.set(f"host/{self.rank}", json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                                     "addr": self.address}))
                    self._published_host = True
            except Exception as exc:  # noqa: BLE001 - the doctor never breaks the job
                self._store_failed = True
                self._say(f"the hang doctor cannot reach the job's store at {self._address}: {exc}; "
                          "hang reports are off for this process")
        return self._store

    def _say(self, text: str) -> None:
        with _OUTPUT_LOCK:  # a fork waits for it (anyaccel.lifetime): the child's stderr must not inherit a held lock
            sys.stderr.write(f"[anyaccel hang doctor] rank {self.rank}: {text}\n")
            sys.stderr.flush()

    # ---- the thread -----------------------------------------------------------------------------
    #: consecutive rounds whose store calls failed before the store is given up (a busy store at
    #: scale can miss one 10 s timeout; a store whose host has left fails every time)
    RETRIES = 5

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.interval):
            try:
                if self.store() is None:
                    self._lost()
                    return
                self._answer()
                self._publish_for_watchers()
                self._maybe_report()
                for sub in self._subscriptions:
                    if sub.poll is not None:
                        sub.poll(self._store)
                failures = 0
                self._round_done = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - e.g. the store's host left at the end of the job
                failures += 1
                if failures < self.RETRIES and not self._stop.is_set():
                    with self._store_lock:  # a fresh client next round: a late reply must not answer the next request
                        self._store = None
                    continue
                self._store_failed = True
                if not self._stop.is_set() and TRACKER.op is not None:  # only where a report could matter
                    self._say(f"stopped watching: the job's store does not answer any more ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:200] if str(exc) else ''})")
                self._lost()
                return

    def _lost(self) -> None:
        self._lost_store = True
        for sub in self._subscriptions:
            if sub.on_lost is not None:
                _call_quietly(sub.on_lost)

    def state(self) -> Dict[str, Any]:
        """This rank's state for a report: operation (``counted``: an anyaccel collective), sequence
        number, progress counters, seconds waited, stack."""
        frame = sys._current_frames().get(self._main)
        op, seq, since, counted = TRACKER.op, TRACKER.seq, TRACKER.since, TRACKER.counted
        return {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "op": op, "seq": seq,
                "counted": bool(op and counted), "backwards": TRACKER.backwards, "syncs": TRACKER.syncs,
                "forwards": TRACKER.forwards,
                "batches": TRACKER.batches,
                "waited": round(time.monotonic() - since, 1) if op else 0.0,
                "stack": user_stack(frame) if frame is not None else []}

    def _answer(self) -> None:
        generation = int(self._store.add("req", 0))
        while self._answered < generation:
            self._answered += 1
            self._store.set(f"state/{self._answered}/{self.rank}", json.dumps(self.state()))

    def _maybe_report(self) -> None:
        timeout = self.hang_timeout
        if timeout <= 0 or TRACKER.op is None:
            return
        waited = time.monotonic() - TRACKER.since
        seq = TRACKER.seq
        due = self._next_report.get(seq, timeout)
        if waited < due:
            return
        self._next_report = {seq: due * 2}  # then at growing intervals
        states = self._collect()
        report = _format_report(states, self.world, timeout)
        self.last_report = report
        waiting = [s["rank"] for s in states.values() if s.get("op") and s.get("waited", 0) >= timeout]
        printed = not waiting or min(waiting) == self.rank  # one report per episode: the lowest waiting rank
        if printed:
            self._say("\n" + report)
        # a mismatch that cannot resolve itself, or the same peers silent twice: end
        self._giving_up.after_report(states, seq, waited, timeout, report, printed=printed)

    def ask(self) -> int:
        """Ask every rank to publish where it is (its doctor's thread answers within about
        ``interval`` seconds); this rank's own state is published at once. Returns the request's
        number, for :meth:`answers`. Local; any thread (the store client is thread-safe); raises
        when the store cannot be reached."""
        store = self.store()
        if store is None:
            raise RuntimeError("the job's store cannot be reached")
        generation = int(store.add("req", 1))
        # (not marked answered here: this thread's _answer must still answer the requests of other
        # ranks numbered below it; it answers this one again too, harmlessly)
        store.set(f"state/{generation}/{self.rank}", json.dumps(self.state()))
        return generation

    @property
    def alive(self) -> bool:
        """Whether this process's doctor still works: its thread runs and its store was not given
        up (a caller waiting on answers falls back to an error otherwise). Local."""
        return self._thread.is_alive() and not self._store_failed and not self._lost_store

    # ---- the main process watched (anyaccel.checkpoint.participation) ----------------------------
    #: store keys: how many processes watch the main process, and its state published for them
    WATCHERS, WATCHED = "watch/0/count", "watch/0/state"

    def watch_main(self, on: bool) -> None:
        """Start (``on``) or stop watching the main process: while any process watches, the main
        process's doctor thread publishes its state every round (:meth:`main_state`), so a watcher
        needs no requests of its own (one key, overwritten). Local; raises on a store failure."""
        store = self.store()
        if store is None:
            raise RuntimeError("the job's store cannot be reached")
        store.add(self.WATCHERS, 1 if on else -1)

    def main_state(self) -> Optional[Dict[str, Any]]:
        """The main process's state as its doctor last published it for watchers (with ``round``,
        which grows each time), ``{"missing": True, "left": ...}`` when it left the job, or None when
        nothing is published yet. Local; raises on a store failure."""
        left = self._left(0)
        if left is not None:
            return {"rank": 0, "missing": True, "left": left}
        store = self.store()
        if store is None or not store.check([self.WATCHED]):
            return None
        state: Dict[str, Any] = json.loads(store.get(self.WATCHED))
        return state

    def _publish_for_watchers(self) -> None:
        if self.rank != 0 or int(self._store.add(self.WATCHERS, 0)) <= 0:
            return
        self._rounds = getattr(self, "_rounds", 0) + 1
        self._store.set(self.WATCHED, json.dumps(dict(self.state(), round=self._rounds)))

    def answers(self, generation: int, missing: bool = False) -> Dict[int, Dict[str, Any]]:
        """The states published so far for request ``generation`` (rank -> state). A rank that
        has not answered but left the job is there as ``{"missing": True, "left": ...}``; with
        ``missing`` every other rank that has not answered is there too (with its host). Local."""
        store = self.store()
        states: Dict[int, Dict[str, Any]] = {}
        for r in range(self.world):
            key = f"state/{generation}/{r}"
            if store is not None and store.check([key]):
                states[r] = json.loads(store.get(key))
                continue
            left = self._left(r)
            if left is not None or missing:
                known = json.loads(store.get(f"host/{r}")) if missing and store is not None and \
                    store.check([f"host/{r}"]) else {}
                states[r] = {"rank": r, "missing": True, "left": left, **known}
        return states

    def _collect(self, wait: float = 4.0) -> Dict[int, Dict[str, Any]]:
        generation = self.ask()
        deadline = time.monotonic() + wait + self.interval
        while time.monotonic() < deadline:
            if len([s for s in self.answers(generation).values() if not s.get("missing")]) == self.world:
                break
            if threading.current_thread() is self._thread:
                # two ranks reporting at once each wait here for the other's answer: keep answering
                # (else each sees the other as silent, and twice silent ends the job with exit 69)
                self._answer()
            time.sleep(0.2)
        return self.answers(generation, missing=True)

    def _left(self, rank: int) -> Optional[Dict[str, Any]]:
        key = f"left/{rank}"
        store = self.store()  # a peer may fail before the thread's first round has connected
        if store is not None and store.check([key]):
            return json.loads(store.get(key))
        return None

    # ---- leaving --------------------------------------------------------------------------------
    def note_exit(self, code: Any, how: str = "its script ended") -> None:
        """Publish that this rank leaves (with ``code``), and how (``how``: where it raised or
        called ``sys.exit``). Called once, by the worker bootstrap with the exit status, or at
        interpreter exit."""
        if getattr(self, "_noted", False) or os.getpid() != self._pid:
            return
        self._noted = True
        try:
            store = self.store()
            if store is not None:
                store.set(f"left/{self.rank}", json.dumps({"code": code, "seq": TRACKER.seq, "how": how}))
        except Exception:  # noqa: BLE001 - leaving must not fail
            pass
        self.stop()  # nothing to watch any more

    def _at_exit(self) -> None:
        if os.getpid() != self._pid:  # a forked child: the thread and the store are the parent's
            return
        self.note_exit("unknown", "the interpreter exited")
        self.stop(wait=3.0)

    def stop(self, wait: float = 0.0) -> None:
        """End the thread; with ``wait``, also wait up to that many seconds for it to finish.

        At interpreter exit it must: a daemon thread still inside a TCP-store call when Python
        finalises is ended by ``pthread_exit`` inside C++ code, and the process aborts with
        "terminate called without an active exception" (seen once in a full test run)."""
        self._stop.set()
        if wait > 0 and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(wait)

    def ranks_at(self, address: str) -> List[Dict[str, Any]]:
        """The ranks that published ``address`` as theirs (``host/<rank>``: rank, host, pid), read
        from the store; [] when it cannot be read."""
        out = []
        try:
            store = self.store()
            for r in range(self.world):
                if r != self.rank and store is not None and store.check([f"host/{r}"]):
                    known = json.loads(store.get(f"host/{r}"))
                    if known.get("addr") == address:
                        out.append(dict(known, rank=r))
        except Exception:  # noqa: BLE001 - explaining must not fail
            return []
        return out

    def peers_that_left(self) -> List[Dict[str, Any]]:
        out = []
        self.store_unreachable = False
        for r in range(self.world):
            if r == self.rank:
                continue
            try:
                left = self._left(r)
                if self._store is None:
                    self.store_unreachable = True
            except Exception:  # noqa: BLE001
                left, self.store_unreachable = None, True
                break  # the store is gone: asking it about every rank would only wait longer
            if left is not None:
                out.append(dict(left, rank=r))
        return out


def _call_quietly(callback: Any) -> None:
    try:
        callback()
    except Exception:  # noqa: BLE001 - the doctor never breaks the job
        pass


def _namespace(launch: Any) -> str:
    """The store prefix of this run's attempt (``Environment.launch``: one prefix per restart)."""
    return f"anyaccel/doctor/{launch.run_name}/{launch.restart_attempt}/"


# --------------------------------------------------------------------------------------------
# The process's doctor
# --------------------------------------------------------------------------------------------

_DOCTOR: Dict[str, Optional[Doctor]] = {"value": None}
_OUTPUT_LOCK = threading.Lock()  # held while the doctor's threads write to stderr
_PAUSED = {"held": False}


def pause_output() -> None:
    """Before a fork (:mod:`anyaccel.lifetime`): wait (at most 1 s) until no doctor thread is
    writing to stderr, and keep it so until :func:`resume_output` or :func:`forget_in_child`."""
    _PAUSED["held"] = _OUTPUT_LOCK.acquire(timeout=1.0)


def resume_output() -> None:
    """After a fork, in the parent: the doctor's threads may write again."""
    if _PAUSED["held"]:
        _PAUSED["held"] = False
        _OUTPUT_LOCK.release()


def forget_in_child() -> None:
    """After a fork, in the child: this process is not a rank. The doctor (its thread exists only
    in the parent, its store connection is the parent's socket) is forgotten, so nothing in the
    child asks or tells the job's store anything."""
    global _OUTPUT_LOCK
    _DOCTOR["value"] = None
    _OUTPUT_LOCK = threading.Lock()
    _PAUSED["held"] = False


def start(env: Any) -> Optional[Doctor]:
    """Start this process's doctor for a multi-process ``env`` (once: a later call returns the
    same one). Local. Returns the doctor, or None for a single process."""
    doctor = _DOCTOR["value"]
    if doctor is not None:
        return doctor
    if env.world_size <= 1 or env.main_port is None:
        return None
    doctor = _DOCTOR["value"] = Doctor(env)
    return doctor


def subscribe(env: Any, hang_timeout: float, poll: Any = None, on_lost: Any = None) -> Optional[Subscription]:
    """Start the process's doctor if needed (:func:`start`) and subscribe to it with this
    owner's ``hang_timeout`` and callbacks (:meth:`Doctor.subscribe`). Local. Returns the
    :class:`Subscription` to close, or None for a single process (no doctor)."""
    doctor = start(env)
    return doctor.subscribe(hang_timeout, poll=poll, on_lost=on_lost) if doctor is not None else None


def current() -> Optional[Doctor]:
    return _DOCTOR["value"]


def note_exit(code: Any, exc: Optional[BaseException] = None) -> None:
    """Tell the other ranks this one leaves, with ``code`` and, for ``exc`` (the exception or
    ``SystemExit`` that ended the script), the user's line that raised it. Worker bootstraps
    call it; local."""
    doctor = _DOCTOR["value"]
    if doctor is None:
        return
    how = "its script ended"
    if exc is not None:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if not library_frame(f.filename)]
        what = "sys.exit" if isinstance(exc, SystemExit) else type(exc).__name__
        how = f"{what} at {os.path.relpath(frames[-1].filename)}:{frames[-1].lineno}" if frames else what
    doctor.note_exit(code, how)


def explain(exc: BaseException, op: str) -> BaseException:
    """The error to raise instead of ``exc`` (a collective that failed in this process): which
    peer left while this rank waited in ``op``, or the last hang report; ``exc`` itself when the
    doctor knows nothing more (the rules: :mod:`anyaccel.doctor.failed_collective`). Local."""
    doctor = _DOCTOR["value"]
    if doctor is None or not isinstance(exc, RuntimeError):
        return exc
    from .failed_collective import explain_failure

    where = f"{op} (collective #{TRACKER.seq}, {call_site(sys._getframe(2))})"
    return explain_failure(doctor, exc, where)


if TYPE_CHECKING:
    from .giveup import UNREACHABLE_EXIT_CODE
else:  # (hidden from type checkers: a module __getattr__ would type every misspelt name Any)
    def _unreachable_exit_code() -> int:  # giveup's, imported when first asked for (the import budget)
        from .giveup import UNREACHABLE_EXIT_CODE

        return UNREACHABLE_EXIT_CODE

    __getattr__, __dir__ = lazyclass.module_attributes(__name__, globals(),
                                                       {"UNREACHABLE_EXIT_CODE": _unreachable_exit_code})
