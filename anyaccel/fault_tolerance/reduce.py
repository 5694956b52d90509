"""One bucket's average over the replica groups, without torchft's per-call Python: :func:`start_average`.

torchft's ``Manager.allreduce`` does four things for a tensor: it skips the all-reduce once the
step has an error, zeros the tensor of a group that sits the step out (healing), starts a SUM
all-reduce on the gradient group, and, on ``wait()``, divides by the number of groups taking
part, recording an error instead of raising. Around them it builds, per call, a
``_ManagedWork`` with a chain of ``torch.futures`` callbacks and a ``future_timeout`` (a timer
registered on torchft's event-loop thread, for a future that is already complete when the chain
is built). In the benchmark's 2 x 2 FSDP2 layout that machinery was 1.0 ms of rank 0's CPU per
step for two buckets (0.34 ms to start, 0.70 ms to wait: ``benchmarks/README.md``, seventh
session), against a step of about 26 ms.

:func:`start_average` does the four things, in torchft 0.2.0's order, and nothing else: the
same all-reduce on the same group (so its bound is the group's ``timeout_s``, as torchft's
``wait`` relies on), the same in-place division (``tensor /= participants``: bitwise what
torchft's callback computes), the same error recorded with ``Manager.report_error`` (the step
then does not commit). The torchft members read are in :data:`.transport.CONTRACT`, and
``tests/fault_tolerance`` checks the order against the installed ``Manager.allreduce``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["start_average", "GroupAverage"]


class GroupAverage:
    """The average of one tensor over the replica groups, started; :meth:`wait` finishes it."""

    __slots__ = ("_manager", "_work", "_tensor", "_participants")

    def __init__(self, manager: Any, work: Any, tensor: torch.Tensor, participants: int):
        self._manager, self._work, self._tensor, self._participants = manager, work, tensor, participants

    def wait(self) -> bool:
        """Wait for the all-reduce and divide by the groups taking part; an error is recorded on
        the manager (the step does not commit) and returns False, as torchft's ``wait``. Local
        (the all-reduce it waits for is collective over the replica groups)."""
        if self._work is None:  # the step had an error already: nothing was sent
            return True
        try:
            self._work.wait()
        except Exception as exc:  # gloo: a peer's sockets reset, or the group's timeout_s passed
            self._manager.report_error(exc)
            return False
        self._tensor /= self._participants
        return True


def start_average(manager: Any, tensor: torch.Tensor) -> GroupAverage:
    """Start the average of ``tensor`` (floating point, averaged in place) over the replica groups
    of the step's quorum, which must have answered already: torchft's ``Manager.allreduce`` with
    ``ReduceOp.AVG`` minus its per-call futures (module docstring). Collective over the replica
    groups of the quorum; an error is recorded, not raised."""
    from torch.distributed import AllreduceOptions, ReduceOp

    if manager.errored():
        return GroupAverage(manager, None, tensor, 1)
    participants: int = manager.num_participants()
    if not manager.is_participating():
        tensor.zero_()
    work: Optional[Any] = None
    try:
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp(ReduceOp.SUM)
        work = manager._pg.allreduce([tensor], opts)
    except Exception as exc:
        manager.report_error(exc)
    return GroupAverage(manager, work, tensor, participants)
