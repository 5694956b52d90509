"""The commit vote of a replica group of **one** process, decided where it is asked: :func:`decide_alone`.

torchft's ``Manager.should_commit`` asks the group's ``ManagerServer`` (a gRPC round trip to the
group's rank 0, a Rust thread) to gather the votes of the group's ranks and answer whether all of
them may commit. A group of one process has one vote: the round trip only echoes it (on a loaded
machine it cost 21-24 ms a step, against a step of about 500 ms). :func:`decide_alone` does what
torchft 0.2.0's ``should_commit`` does, in the same order, without that round trip: finish a
pending recovery, take the gradient group's error, apply a pending heal, vote (enough groups in
the quorum, no error), stop serving the healing state, and count the step (or the failure, raising
after ``max_retries`` failures in a row). Groups of several processes vote through torchft's
server as before. The torchft members read are in :data:`.transport.CONTRACT` (torchft is pinned;
``tests/fault_tolerance`` checks them against the installed one). Local (no communication).
"""

from __future__ import annotations

from typing import Any

__all__ = ["decide_alone"]


def decide_alone(manager: Any) -> bool:
    """``manager.should_commit()`` for a group of one process, without the vote's round trip
    (module docstring). Raises ``RuntimeError`` as torchft does after ``max_retries`` failures in
    a row. Local."""
    import torch

    if manager._recovery_event is not None:  # a heal received on an accelerator's recovery stream
        manager._recovery_event.synchronize()
        manager._recovery_event = None
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()
    error = manager._pg.errored()
    if error:
        manager.report_error(error)
    if manager._healing:
        manager._apply_pending_state_dict()
    participants = manager.num_participants()
    decision = participants >= manager._min_replica_size and manager._errored is None
    manager._checkpoint_transport.disallow_checkpoint()  # waits for a transfer in flight
    if decision:
        manager._step += 1
        manager._batches_committed += participants
        manager._commit_failures = 0
    else:
        manager._commit_failures += 1
        if manager._max_retries is not None and manager._commit_failures > manager._max_retries:
            raise RuntimeError(f"should_commit failed {manager._commit_failures} times consecutively, exceeding "
                               f"max_retries={manager._max_retries}")
    return decision
