"""Where this process's main thread is, for the hang doctor: :data:`TRACKER`.

Every anyaccel collective (and the backward of a DDP sync step) enters with its operation and a
sequence number and leaves afterwards (:class:`anyaccel.doctor.waiting`): a few attribute writes,
nothing measurable on the hot path. The doctor's thread (:mod:`anyaccel.doctor`) and its giving-up
rules (:mod:`anyaccel.doctor.giveup`) read it; the sequence number also travels in the
collectives' shape header (:mod:`anyaccel.ops`). Local to the process.
"""

from __future__ import annotations

import time
from typing import Optional

__all__ = ["Tracker", "TRACKER"]


class Tracker:
    """Where this process's main thread is: the anyaccel collective it is in (``op``), the number
    of collectives it has started (``seq``) and since when (``since``, monotonic seconds)."""

    __slots__ = ("op", "seq", "since")

    def __init__(self) -> None:
        self.op: Optional[str] = None
        self.seq = 0
        self.since = 0.0

    def enter(self, op: str) -> int:
        self.seq += 1
        self.op = op
        self.since = time.monotonic()
        return self.seq

    def leave(self) -> None:
        self.op = None


TRACKER = Tracker()  # one per process, as the process group is: every collective of the process
