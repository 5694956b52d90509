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

__all__ = ["Tracker", "TRACKER", "BACKWARD_SYNC", "BACKWARD_LOCAL"]

#: what a rank in ``Accelerator.backward`` on a step that synchronises gradients waits in: the
#: gradient all-reduce (DDP) or reduce-scatter (FSDP), which needs every rank
BACKWARD_SYNC = "backward (gradient all-reduce)"
#: ``Accelerator.backward`` on an accumulation micro-step: gradients stay local, nobody is waited for
BACKWARD_LOCAL = "backward (gradients kept local)"


class Tracker:
    """Where this process's main thread is: the operation it waits in (``op``; ``counted`` when it
    is an anyaccel collective, which every rank must enter in the same order), the number of
    collectives it has started (``seq``) and since when (``since``, monotonic seconds); and how far
    the training has gone (``backwards``: ``Accelerator.backward`` calls; ``batches``: batches the
    prepared loaders yielded), which lets another rank tell whether this one is already past a
    point of the script (:mod:`anyaccel.checkpoint.participation`)."""

    __slots__ = ("op", "seq", "since", "counted", "backwards", "batches")

    def __init__(self) -> None:
        self.op: Optional[str] = None
        self.seq = 0
        self.since = 0.0
        self.counted = False
        self.backwards = 0
        self.batches = 0

    def enter(self, op: str) -> int:
        self.seq += 1
        self.op = op
        self.counted = True
        self.since = time.monotonic()
        return self.seq

    def leave(self) -> None:
        self.op = None
        self.counted = False


TRACKER = Tracker()  # one per process, as the process group is: every collective of the process
