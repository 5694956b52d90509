"""Which committed history a replica group holds, and a check that the groups of a quorum hold one:
:func:`advance`, :func:`compare`, :func:`verdict`, :class:`QuorumMembers`.

A group's *lineage* is a 62-bit fingerprint of the steps it committed and the quorum each was
committed in (torchft's ``quorum_id`` and the quorum's member ids, which the Lighthouse gives every
member of a quorum alike):
advanced at each commit, carried in the healing state (a healed group takes its peer's) and in
checkpoints (with torchft's step count). Groups that committed the same steps in the same quorums
hold the same lineage; the step count alone does not tell them apart.

Why it is needed: a step can commit in some groups and not in others (a group whose ``backward``
raised votes its step down while the others, without ``find_unused_parameters``, commit it:
:mod:`.averaging`), and the group left one step behind normally heals from a group that committed
it at its next quorum. If that quorum forms without every group that committed (they asked the
Lighthouse more than its join timeout late: a long evaluation or save at that step boundary), the
groups behind are the highest there, train the step again on other batches, and reach the same
count as the groups that committed it the first time, with other weights. torchft heals only a
group whose count is lower, so when they next meet nothing would tell them apart and their
weights would differ for good: a silent divergence. (A group resumed from a checkpoint of another
run at the live groups' count is the same case. A new Lighthouse numbers its quorums from 1 again,
so the lineage also hashes each quorum's members, whose ids carry a uuid made by each group's rank 0
at each start: two runs with the same quorum ids at the same steps still hold different lineages.)

The check: in the first step of every quorum (a new ``quorum_id``: whenever the membership
changed, so whenever groups that were apart meet again), every rank all-reduces its group's
lineage with the same rank of every other group, before the step's first gradient bucket
(:meth:`~anyaccel.fault_tolerance.replica.Replica._settle`). When they differ, :func:`verdict`
keeps the lineage most groups hold (a tie: the one more groups hold that committed a step with it
since it was loaded, so that a group just restarted from its own checkpoint, or just healed from such
a group, does not outvote the groups that trained their history; then the one of the group first in
the quorum's order); the
step commits nowhere (the gradients were computed on different weights); a group with another
lineage heals from a group that kept its own: at once, one count lower, when the check ran in
``resume()`` (its loaders not iterating yet); in the training loop by stopping with
:class:`~anyaccel.errors.FaultToleranceError`, so that its launcher starts it again and it heals
in ``resume()`` (its loader, which went on apart, is set to theirs there; with no restart left,
or one launch per group, it must be started again by hand). From then on every group's weights
are equal again. One batch per group is skipped, and the groups that healed lose the steps they
took apart. A check that could not run (a group gone) fails its step; torchft's Lighthouse then
forms a new quorum (it does after any step that did not commit), whose first step checks again.
Local, except :func:`compare`, which is collective over the replica groups of the quorum.
"""

from __future__ import annotations

import hashlib
from typing import Any, List, Optional, Tuple

import torch

__all__ = ["advance", "compare", "verdict", "MASK", "QuorumMembers"]

#: lineages are kept below 2**62 (exact in an int64 sum of one per slot)
MASK = (1 << 62) - 1


def advance(lineage: int, quorum_id: int, step: int, members: Tuple[str, ...] = ()) -> int:
    """The lineage after committing ``step`` (torchft's count after it) in quorum ``quorum_id``, whose
    ``members`` are its groups' replica ids (torchft's, each ending in a uuid its group's rank 0 made
    when it started: :class:`QuorumMembers`), the same in every group of the quorum. Local, pure."""
    text = f"{lineage}:{quorum_id}:{step}" + (f":{','.join(sorted(members))}" if members else "")
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & MASK


class QuorumMembers:
    """torchft's ``ManagerClient`` (a ``Manager``'s ``_client``), remembering the replica ids of the
    last quorum it answered (:attr:`last`: ``(quorum_id, sorted ids)``) for :func:`advance`; every
    other call goes to the client unchanged. The ids carry a uuid per group and start, so that
    two runs under different Lighthouses, which both number their quorums from 1, do not make the same
    lineage out of the same ids and steps. Local (``_quorum`` runs on torchft's quorum thread; the
    commit that reads :attr:`last` follows the quorum's answer)."""

    def __init__(self, client: Any):
        self._client = client
        self.last: Tuple[Optional[int], Tuple[str, ...]] = (None, ())

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        self.last = (int(quorum.quorum_id), tuple(sorted(str(x) for x in quorum.replica_ids)))
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def of(self, quorum_id: int) -> Tuple[str, ...]:
        """The member ids of quorum ``quorum_id``, which must be the last one answered (the commit that
        asks waited for it): anything else raises :class:`~anyaccel.errors.FaultToleranceError`
        rather than advance this group's lineage unlike its peers'. Local."""
        last_id, members = self.last
        if last_id != quorum_id:
            from ..errors import FaultToleranceError

            raise FaultToleranceError(
                f"the lineage of a step committed in quorum {quorum_id} was asked for, but the last quorum torchft's "
                f"client answered was {last_id}: anyaccel and the installed torchft disagree on when a quorum is "
                "answered (report it, with torchft's version)")
        return members


def compare(manager: Any, lineage: int, trained: bool = True) -> Tuple[List[int], List[bool]]:
    """Every group's lineage, and whether it ``trained`` it (committed a step with it since it was
    loaded from a checkpoint or a heal), by replica rank in this quorum: one all-reduce (a sum of
    one slot per group and value) of ``2 x size`` integers on torchft's gradient group, waited for
    within its timeout.
    Raises what the all-reduce raises (a group gone: the caller records it and the step does not
    commit). Collective over the replica groups of the quorum (rank ``r`` of each)."""
    from torch.distributed import AllreduceOptions, ReduceOp

    pg = manager._pg
    size = pg.size()
    slots = torch.zeros(2 * size, dtype=torch.int64)
    slots[pg._rank] = lineage
    slots[size + pg._rank] = 1 if trained else 0
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp(ReduceOp.SUM)
    pg.allreduce([slots], opts).wait()
    values = [int(x) for x in slots.tolist()]
    return values[:size], [x > 0 for x in values[size:]]


def verdict(lineages: List[int], trained: Optional[List[bool]] = None) -> int:
    """The lineage the groups keep: the one most of them hold; among equally many, the one more
    of the groups that ``trained`` theirs hold (:func:`compare`); then the one of the lowest
    replica rank. Local, pure."""
    flags = trained if trained is not None else [False] * len(lineages)
    counts = {x: lineages.count(x) for x in lineages}
    most = max(counts.values())
    tied = [x for x in lineages if counts[x] == most]
    training = {x: sum(1 for y, up in zip(lineages, flags) if y == x and up) for x in tied}
    best = max(training.values())
    return next(x for x in tied if training[x] == best)
