"""The commit vote of a replica group, decided without torchft's gRPC round trip: :func:`decide`.

torchft's ``Manager.should_commit`` asks the group's ``ManagerServer`` (a gRPC round trip to the
group's rank 0, a Rust thread) to gather the votes of the group's ranks and answer whether all of
them may commit. A group of one process has one vote: the round trip only echoes it (on a loaded
machine it cost 21-24 ms a step, against a step of about 500 ms). A group of several processes
needs the votes gathered, but the group already has a channel for that: its own torch process
group (the one FSDP2 or DDP use inside the group), where the vote is one all-reduce of one integer
(the minimum: every rank's vote must be yes), instead of a gRPC call per rank to rank 0's server
(7.6-19.5 ms a step in the benchmark's 2 x 2 FSDP2 layout).

:func:`decide` does what torchft 0.2.0's ``should_commit`` does, in the same order: finish a
pending recovery, take the gradient group's error, apply a pending heal, vote (enough groups in
the quorum, no error; agreed by every rank of the group), stop serving the healing state, and
count the step (or the failure, raising after ``max_retries`` failures in a row). The torchft
members read are in :data:`.transport.CONTRACT` (torchft is pinned; ``tests/fault_tolerance``
checks them against the installed one).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["decide", "decide_alone", "group_vote"]


def group_vote(local: bool, timeout_s: float) -> bool:
    """Whether every rank of this replica group votes yes (``local``: this rank's vote): one
    all-reduce (minimum) of one integer over the group's default process group (on the CPU under
    gloo, else on the current accelerator), waited for at most ``timeout_s`` (torchft's vote had
    the same bound). A rank that is gone makes it fail (gloo: its sockets reset), a rank that
    stalls makes it time out: ``RuntimeError``, which the caller reports as the vote's failure.
    Collective over the ranks of the group."""
    import datetime

    import torch
    import torch.distributed as dist

    device: Any = "cpu"
    if dist.get_backend() != "gloo" and torch.accelerator.is_available():
        device = torch.accelerator.current_accelerator()
    vote = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
    work = dist.all_reduce(vote, op=dist.ReduceOp.MIN, async_op=True)
    assert work is not None  # (async_op=True returns the work)
    work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    return bool(vote.item())


def decide(manager: Any, agree: Optional[Callable[[bool], bool]] = None) -> bool:
    """``manager.should_commit()`` without the vote's gRPC round trip (module docstring);
    ``agree``: how the group's ranks agree on their votes (:func:`group_vote`), None for a group of
    one process (its vote is the decision). Raises ``RuntimeError`` as torchft does after
    ``max_retries`` failures in a row. Local for one process; collective over the group's ranks
    with ``agree``."""
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
    if agree is not None:
        decision = agree(decision)
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


def decide_alone(manager: Any) -> bool:
    """:func:`decide` for a group of one process. Local."""
    return decide(manager)
