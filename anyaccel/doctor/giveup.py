"""Giving up: when the hang doctor ends a process whose collective cannot complete.

A collective whose peers cannot be reached never fails by itself (gloo waits for the process
group's timeout, 30 min by default). The doctor (:mod:`anyaccel.doctor`) ends this process, with
exit :data:`UNREACHABLE_EXIT_CODE`, in two cases:

* the same peers did not answer at two reports in a row (``hang_timeout``, then
  ``2 x hang_timeout``) while this rank waited in one collective (:meth:`GiveUp.after_report`);
* the job's store (machine 0) has not answered for ``max(hang_timeout, 15 s)`` (or was given up)
  and this rank has waited ``2 x hang_timeout`` in one collective. A second thread watches that
  (:meth:`GiveUp.start_watchdog`), because a store call may block for good when machine 0
  vanishes without closing the connection; that thread never touches the store.

It prints which rank on which host cannot be reached and why, tells the other ranks through the
store where it still can, and the launcher then stops the rest of that machine. A peer that answers
again in between (a process that was stopped and continued) is only reported.

And it ends the job, with exit 1 and the report as the failure the launcher shows
(:class:`~anyaccel.errors.CollectiveMismatchError`), when its report shows a mismatch that can never
resolve itself (:func:`~anyaccel.doctor.report.sure_mismatch`: a rank in an anyaccel collective while
another is inside the gradient all-reduce of ``accelerator.backward``) — as mismatched anyaccel
collectives already raise on every rank. The rank that printed the report does it. Local to the
process; one :class:`GiveUp` per doctor.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any, Dict, List, Optional, Type

from ..errors import CollectiveMismatchError, CollectiveTimeoutError, PeerExitedError
from ..worker_failure import record_failure
from .report import sure_mismatch
from .tracker import TRACKER

__all__ = ["GiveUp", "UNREACHABLE_EXIT_CODE"]

#: exit status of a process the doctor ends because peers (or the job's store) cannot be reached
UNREACHABLE_EXIT_CODE = 69  # EX_UNAVAILABLE


class GiveUp:
    """The doctor's two rules for ending this process (see the module docstring). ``doctor``
    is the :class:`~anyaccel.doctor.Doctor` (its store, its thread's last round, its timeout and
    its voice); where the main thread waits is :data:`~anyaccel.doctor.tracker.TRACKER`."""

    def __init__(self, doctor: Any):
        self._doctor, self._tracker = doctor, TRACKER
        self._unanswered: Dict[int, List[int]] = {}  # collective seq -> ranks that did not answer its last report

    def after_report(self, states: Dict[int, Dict[str, Any]], seq: int, waited: float, timeout: float,
                     report: str, printed: bool = False) -> None:
        """Called by the doctor's thread after each report on collective ``seq``: end the job when
        the report (``printed`` by this rank) shows a mismatch that cannot resolve itself; give up
        when the same peers were silent (and had not left) at the previous report too."""
        mismatch = sure_mismatch(states, self._doctor.world, timeout) if printed else None
        if mismatch is not None:
            self.end_mismatch(mismatch, report)
        silent = sorted(r for r, st in states.items() if st.get("missing") and not st.get("left"))
        if silent and self._unanswered.get(seq) == silent:  # the same peers, at two reports in a row
            who = ", ".join(f"rank {r} ({states[r].get('host', 'host unknown')})" for r in silent)
            self.give_up(f"{who} has not answered for {waited - timeout:.0f} s while this rank waited "
                         f"{waited:.0f} s in {self._tracker.op} (collective #{seq}): its host is unreachable "
                         "(network down, machine gone) or its processes are stopped", report,
                         error=CollectiveTimeoutError)
        self._unanswered = {seq: silent}

    def start_watchdog(self) -> None:
        """Start the thread that watches the store's silence (it never calls the store itself)."""
        threading.Thread(target=self._watch_store, name="anyaccel-hang-doctor-watchdog", daemon=True).start()

    def _watch_store(self) -> None:
        """End this process when it has waited ``2 x hang_timeout`` in one collective while the
        job's store has not answered for ``max(hang_timeout, 15 s)`` (or was given up): without
        machine 0 the collective cannot complete."""
        doctor, tracker = self._doctor, self._tracker
        while not doctor._stop.wait(doctor.interval):
            op, seq, since = tracker.op, tracker.seq, tracker.since
            if doctor.hang_timeout <= 0 or op is None:
                continue
            now = time.monotonic()
            silent = now - doctor._round_done
            if now - since >= 2 * doctor.hang_timeout and (doctor._store_failed or
                                                           silent >= max(doctor.hang_timeout, 15.0)):
                host, port = doctor._address
                self.give_up(f"the job's store on machine 0 ({host}:{port}) has not answered this host "
                             f"({socket.gethostname()}) for {silent:.0f} s and this rank has waited {now - since:.0f} s "
                             f"in {op} (collective #{seq}): machine 0 is unreachable or gone", None, tell=False,
                             error=PeerExitedError)

    def end_mismatch(self, why: str, report: str) -> None:
        """End this process with exit 1 for the mismatch ``why``: the report becomes the failure the
        launcher shows (a :class:`CollectiveMismatchError` in the worker's error file), the other
        ranks are told, and the launcher stops them."""
        doctor = self._doctor
        doctor._say(f"ending the job: {why}. Ending this process (exit 1); the launcher stops the others.")
        error = CollectiveMismatchError(f"the hang doctor ended the job: {why}\n{report}")
        try:
            record_failure(error, doctor.rank)
            if doctor._store is not None:
                doctor._store.set(f"left/{doctor.rank}", json.dumps({
                    "code": 1, "seq": self._tracker.seq, "how": "the hang doctor ended it: mismatched collectives (its report "
                    "says where)"}))
        except Exception:  # noqa: BLE001 - ending must not fail
            pass
        _flush()
        os._exit(1)

    def give_up(self, why: str, report: Optional[str], tell: bool = True,
                error: Type[BaseException] = CollectiveTimeoutError) -> None:
        """End this process (the collective it waits in cannot complete): say why, record it as
        ``error`` (the failure the launcher shows for this rank, as for an exception: not "exited
        without a Python exception"), tell the others."""
        doctor = self._doctor
        advice = ("Check the network and the machine named, then resume from the last checkpoint.")
        doctor._say(f"giving up: {why}. Ending this process (exit {UNREACHABLE_EXIT_CODE}); the launcher stops the "
                    f"rest of this machine. {advice}" + (f"\n{report}" if report and report != doctor.last_report else ""))
        try:
            record_failure(error(f"the hang doctor ended rank {doctor.rank} ({socket.gethostname()}, exit "
                                 f"{UNREACHABLE_EXIT_CODE}): {why}. {advice}"), doctor.rank)
        except Exception:  # noqa: BLE001 - ending must not fail
            pass
        _flush()
        try:
            if tell and doctor._store is not None:
                doctor._store.set(f"left/{doctor.rank}", json.dumps({
                    "code": UNREACHABLE_EXIT_CODE, "seq": self._tracker.seq, "how": f"the hang doctor ended it: {why}"}))
        except Exception:  # noqa: BLE001 - the store may be what is unreachable
            pass
        os._exit(UNREACHABLE_EXIT_CODE)


def _flush() -> None:
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing to flush
            pass
