"""Where this process's main thread is, for the hang doctor: :data:`TRACKER`.

Every anyaccel collective (and the backward of a DDP sync step) enters with its operation and a
sequence number and leaves afterwards (:class:`anyaccel.doctor.waiting`): a few attribute writes,
nothing measurable on the hot path. The doctor's thread (:mod:`anyaccel.doctor`) and its giving-up
rules (:mod:`anyaccel.doctor.giveup`) read it; the sequence number also travels in the
collectives' shape header (:mod:`anyaccel.ops`). Local to the process.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

__all__ = ["Tracker", "TRACKER", "BACKWARD_SYNC", "BACKWARD_LOCAL", "FORWARD_SYNC", "FORWARD_BUFFERS", "FORWARD_WAITS",
           "mark_forward_sync"]

#: what a rank in ``Accelerator.backward`` on a step that synchronises gradients waits in: the
#: gradient all-reduce (DDP) or reduce-scatter (FSDP), which needs every rank
BACKWARD_SYNC = "backward (gradient all-reduce)"
#: ``Accelerator.backward`` on an accumulation micro-step (or under ``no_sync``): gradients stay
#: local, nobody is waited for
BACKWARD_LOCAL = "backward (gradients kept local)"
#: the forward of a model whose parameters are sharded (FSDP2, N-D): it all-gathers them, which
#: needs every rank of the sharding group (:func:`mark_forward_sync`)
FORWARD_SYNC = "forward (parameter all-gather)"
#: the forward of a DDP model that broadcasts its buffers from rank 0 first (``broadcast_buffers``,
#: a model with buffers, after a training forward) or joins uneven inputs: it needs every rank too
FORWARD_BUFFERS = "forward (buffer broadcast)"
#: the forward waits, counted alike (the same number on every rank at a point every rank reaches)
FORWARD_WAITS = (FORWARD_SYNC, FORWARD_BUFFERS)


class Tracker:
    """Where this process's main thread is: the operation it waits in (``op``; ``counted`` when it
    is an anyaccel collective, which every rank must enter in the same order), the number of
    collectives it has started (``seq``) and since when (``since``, monotonic seconds); and how far
    the training has gone (``backwards``: ``Accelerator.backward`` calls; ``syncs``: those that
    synchronised gradients, the same number on every rank at any point every rank reaches;
    ``forwards``: forwards of a sharded model; ``batches``: batches the prepared loaders yielded,
    for reports only); ``alone``: the call this process runs without the others (a
    ``save_state``/``load_state`` on the main process alone), during which an anyaccel collective
    raises instead of waiting for ever (:class:`anyaccel.doctor.waiting`). A
    rank blocked in a collective numbered past another's count, or in a synchronising backward or
    forward it entered after that other rank stopped, is waiting for it
    (:mod:`anyaccel.checkpoint.participation`, :func:`anyaccel.doctor.report.sure_mismatch`)."""

    __slots__ = ("op", "seq", "since", "counted", "backwards", "syncs", "forwards", "batches", "alone")

    def __init__(self) -> None:
        self.op: Optional[str] = None
        self.seq = 0
        self.since = 0.0
        self.counted = False
        self.backwards = 0
        self.syncs = 0
        self.forwards = 0
        self.batches = 0
        self.alone: Optional[str] = None

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


def _compiling() -> bool:
    """Whether Dynamo is tracing (the hooks then do nothing: a write of the clock would break the
    compiled graph, so a compiled forward is not marked)."""
    import torch

    return bool(torch.compiler.is_compiling())


def _enter_forward(module: Any, args: Any) -> None:
    if _compiling():
        return
    when = getattr(module, "_anyaccel_forward_when", None)
    if when is not None and not when(module):  # this forward of the model is local
        return
    if TRACKER.op is None:  # (inside another marked wait, that one stays what the doctor says)
        TRACKER.op, TRACKER.counted, TRACKER.since = module._anyaccel_forward_op, False, time.monotonic()
        TRACKER.forwards += 1


def _leave_forward(module: Any, args: Any, output: Any) -> None:
    if _compiling():
        return
    if TRACKER.op == module._anyaccel_forward_op:
        TRACKER.op = None


def mark_forward_sync(root: Any, op: str = FORWARD_SYNC, when: Optional[Callable[[Any], bool]] = None) -> None:
    """Mark ``root``'s forward as a wait for every rank: the tracker says ``op`` during it and
    counts it — every forward (a model whose parameters a sharded strategy all-gathers in it:
    :data:`FORWARD_SYNC`), or those for which ``when(root)``, asked before the forward, is true (a
    DDP model's forwards that broadcast buffers: :data:`FORWARD_BUFFERS`). Two hooks that write a
    few attributes; run before the strategy's own pre-forward hook. Local."""
    if getattr(root, "_anyaccel_forward_marked", False):
        return
    root._anyaccel_forward_op, root._anyaccel_forward_when = op, when
    root.register_forward_pre_hook(_enter_forward, prepend=True)
    root.register_forward_hook(_leave_forward, always_call=True)
    root._anyaccel_forward_marked = True
