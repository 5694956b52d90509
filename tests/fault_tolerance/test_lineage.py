"""The lineage check (anyaccel/fault_tolerance/lineage.py): the fingerprint of a committed history,
which history the groups of a quorum keep, and what each group does when they differ. The real
case, with launched processes: test_fault_tolerance_multiprocess.py::test_groups_that_meet_again_..."""

from __future__ import annotations

import pytest

pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")

from anyaccel.errors import FaultToleranceError  # noqa: E402
from anyaccel.fault_tolerance import replica as replica_module  # noqa: E402
from anyaccel.fault_tolerance.lineage import MASK, advance, verdict  # noqa: E402
from anyaccel.fault_tolerance.replica import Replica  # noqa: E402
from anyaccel.fault_tolerance.settings import FaultToleranceSettings  # noqa: E402


def test_a_history_is_the_steps_and_the_quorums_they_were_committed_in():
    start = advance(0, quorum_id=3, step=1)
    assert advance(0, 3, 1) == start and 0 <= start <= MASK  # the same in every group and every process
    assert advance(start, 3, 2) != advance(start, 4, 2)  # the same step, committed in another quorum
    assert advance(start, 3, 2) != advance(advance(start, 3, 2), 3, 3)


def test_two_runs_with_the_same_quorum_ids_at_the_same_steps_hold_different_histories():
    """A new Lighthouse numbers its quorums from 1 again: the member ids (with a uuid of each group's
    process) tell two runs apart; the same members, in any order, make the same history."""
    from types import SimpleNamespace

    from anyaccel.fault_tolerance.lineage import QuorumMembers

    one, other = ("anyaccel_group_0:aaa", "anyaccel_group_1:bbb"), ("anyaccel_group_0:ccc", "anyaccel_group_1:ddd")
    assert advance(0, 1, 1, one) != advance(0, 1, 1, other)
    assert advance(0, 1, 1, one) == advance(0, 1, 1, tuple(reversed(one)))
    answers = iter([SimpleNamespace(quorum_id=1, replica_ids=list(reversed(one))),
                    SimpleNamespace(quorum_id=2, replica_ids=list(other))])
    client = SimpleNamespace(_quorum=lambda **kwargs: next(answers), should_commit=lambda: "asked")
    members = QuorumMembers(client)
    with pytest.raises(FaultToleranceError, match="last quorum torchft's client answered was None"):
        members.of(1)  # (never silently without members: the groups' lineages would differ)
    assert members.should_commit() == "asked"  # (everything else: the client's)
    assert members._quorum(step=0).quorum_id == 1 and members.of(1) == one
    members._quorum(step=1)
    assert members.of(2) == tuple(sorted(other))
    with pytest.raises(FaultToleranceError, match="quorum 1 was asked for"):
        members.of(1)  # only the last quorum's


def test_torchfts_quorum_answer_carries_its_members_ids():
    from torchft._torchft import QuorumResult

    assert hasattr(QuorumResult, "replica_ids")


def test_the_groups_keep_the_history_most_of_them_hold_and_among_equals_the_lowest_replica_ranks():
    assert verdict([7, 7, 7]) == 7
    assert verdict([5, 9, 9]) == 9  # 2 of 3
    assert verdict([9, 5]) == 9 and verdict([5, 9]) == 5  # a tie: replica rank 0's
    assert verdict([4, 9, 9, 4]) == 4


def test_on_a_tie_the_history_groups_trained_is_kept_over_one_just_loaded():
    """A group restarted from its own checkpoint, at the live groups' count with another history,
    must not stop the groups that were training (before: replica rank 0 won every tie, resumed or not).
    ``trained``: the group committed a step with its history since it was loaded (checkpoint or heal)."""
    assert verdict([5, 9], trained=[False, True]) == 9  # rank 0 just resumed, rank 1 training
    assert verdict([5, 9], trained=[True, False]) == 5
    assert verdict([5, 9], trained=[False, False]) == 5 and verdict([5, 9], trained=[True, True]) == 5  # rank 0's
    assert verdict([5, 9, 9, 5], trained=[False, True, False, False]) == 9  # among equals: more of them trained it
    assert verdict([5, 9, 5, 9], trained=[False, True, False, True]) == 9
    assert verdict([5, 5, 9], trained=[False, False, True]) == 5  # most groups still decide first


class _SummingGroup:
    """torchft's gradient group as :func:`compare` uses it (``size()``, ``_rank``, ``allreduce``), for
    one replica rank of a quorum whose other ranks' tensors are given: the all-reduce sums them."""

    def __init__(self, rank, others):
        self._rank, self._others = rank, others

    def size(self):
        return len(self._others) + 1

    def allreduce(self, tensors, opts):
        from types import SimpleNamespace

        from torch.distributed import ReduceOp

        assert opts.reduceOp == ReduceOp.SUM
        for other in self._others:
            tensors[0] += other
        return SimpleNamespace(wait=lambda: True)


def test_compare_gives_every_groups_history_and_whether_it_trained_it_by_replica_rank():
    import torch

    from anyaccel.fault_tolerance.lineage import compare

    big = MASK - 3  # (near 2**62: exact in the int64 sum)
    # replica rank 1 of 3: rank 0 sent history 5, not trained; rank 2 history `big`, trained
    others = [torch.tensor([5, 0, 0, 0, 0, 0]), torch.tensor([0, 0, big, 0, 0, 1])]
    manager = type("M", (), {"_pg": _SummingGroup(1, others)})()
    assert compare(manager, 9, trained=True) == ([5, 9, big], [False, True, True])
    manager = type("M", (), {"_pg": _SummingGroup(1, others)})()
    assert compare(manager, 9, trained=False) == ([5, 9, big], [False, False, True])


class _Manager:
    """The members of torchft's Manager that Replica._check_lineage reads."""

    def __init__(self, quorum_id=12):
        self._quorum_id, self.reported = quorum_id, []

    def errored(self):
        return self.reported[-1] if self.reported else None

    def report_error(self, error):
        self.reported.append(error)

    def current_step(self):
        return 6


def _replica(monkeypatch, mine, everyone, trained=None):
    """Replica group 1 holding ``mine``, having trained it; the check's all-reduce answers
    ``everyone`` (by replica rank) and ``trained`` (default: every group trained its history);
    ``calls``: the (lineage, trained) this group sent."""
    replica = Replica(FaultToleranceSettings(lighthouse="127.0.0.1:9", group=1, groups=len(everyone)), rank=0,
                      world_size=1, store=None)
    replica._lineage, replica._quorum_ok, replica._trained = mine, True, True
    calls = []

    def compare(manager, lineage, trained=True):
        calls.append((lineage, trained))
        return list(everyone), list(flags if flags is not None else [True] * len(everyone))

    flags = trained
    monkeypatch.setattr(replica_module, "compare", compare)
    return replica, calls


def test_one_history_lets_the_step_go_on_and_is_checked_once_per_quorum(monkeypatch):
    replica, calls = _replica(monkeypatch, 5, [5, 5])
    manager = _Manager()
    replica._check_lineage(manager)
    assert calls == [(5, True)] and not manager.reported and replica._checked_quorum == 12


def test_the_group_whose_history_is_kept_fails_the_step_and_says_so(monkeypatch, capsys):
    replica, _ = _replica(monkeypatch, 5, [5, 9])
    manager = _Manager()
    replica._check_lineage(manager)
    assert len(manager.reported) == 1 and str(manager.reported[0]) == (
        "the replica groups of this quorum hold 2 different histories of the same 6 committed steps")
    said = capsys.readouterr().err
    assert replica._quorum_ok and "kept: the history 1 of the 2 groups hold, 5 (as many groups hold another: of " \
        "those, the one more groups hold that committed a step with it since it was loaded, then the first " \
        "group's in torchft's order of replica ids as text); no group commits this step" in said
    assert "this group's is kept" in said and replica._lineage_error is manager.reported[0] and not replica._rejoin


def test_in_resume_the_group_whose_history_is_not_kept_reports_it_and_heals_there_instead_of_stopping(monkeypatch,
                                                                                                     capsys):
    replica, _ = _replica(monkeypatch, 9, [5, 9])
    replica._joining, manager = True, _Manager()
    replica._check_lineage(manager)  # (no raise: join() heals it, its loaders not iterating yet)
    assert replica._rejoin and replica._lineage_error is manager.reported[0]
    assert "this group's, 9, is not: it heals from a group that kept its history now, in resume()" in \
        capsys.readouterr().err


def test_a_group_resumed_from_its_own_checkpoint_loses_a_tie_to_a_training_group_and_heals_in_resume(
        monkeypatch, capsys):
    """Replica rank 0 resumed from a checkpoint of history 5 at the live group's count; rank 1 (this
    group, group 1) was training with history 9. Before, rank 0's history won the tie and the live
    group had to stop and be restarted; now the history a group trained is kept, and the resumed one
    heals in resume() (test_in_resume_the_group_whose_history_is_not_kept_... above)."""
    replica, sent = _replica(monkeypatch, 9, [5, 9], trained=[False, True])
    manager = _Manager()
    replica._check_lineage(manager)  # (no raise: this group goes on; the step commits nowhere)
    assert sent == [(9, True)] and replica._lineage_error is manager.reported[0] and not replica._rejoin
    said = capsys.readouterr().err
    assert ("by replica rank [5, 9]; replica rank 0 has committed no step since its history was loaded (from a "
            "checkpoint or a heal); kept: the history 1 of the 2 groups hold, 9 (as many groups hold another") in said
    assert "no group commits this step; this group's is kept" in said
    resumed, sent = _replica(monkeypatch, 5, [5, 9], trained=[False, True])
    resumed.load_state_dict({"step": 6, "lineage": 5})  # (what resume() restores from the group's checkpoint)
    resumed._joining, manager = True, _Manager()
    resumed._check_lineage(manager)
    assert sent == [(5, False)] and resumed._rejoin  # join() heals it now, one count lower
    said = capsys.readouterr().err
    assert "this group's, 5, is not: it heals from a group that kept its history now, in resume()" in said


def test_a_group_trained_its_history_once_it_commits_a_step_and_not_after_loading_one(monkeypatch):
    """The flag the tie-break reads: not at start, nor after a checkpoint or a heal is loaded (also
    when the check of the quorum it resumed in could not run and runs in the training loop); set by
    the first committed step."""
    from types import SimpleNamespace

    replica = Replica(FaultToleranceSettings(lighthouse="127.0.0.1:9", group=1, groups=2), rank=0, world_size=1,
                      store=None)
    assert not replica._trained
    replica._averaged, replica._settled = True, True
    replica._manager = SimpleNamespace(errored=lambda: None, _quorum_id=3, current_step=lambda: 7)
    monkeypatch.setattr(replica_module, "decide", lambda manager, vote: True)
    assert replica.commit() and replica._trained
    replica._manager = None  # (before the first quorum, as resume() loads a checkpoint)
    replica.load_state_dict({"step": 7, "lineage": 11})
    assert not replica._trained and replica._lineage == 11
    replica._trained = True
    replica._healing = SimpleNamespace(load=lambda healed, loaders: 7)
    replica._load({"lineage": 12})
    assert not replica._trained and replica._lineage == 12
    # a check first run in the training loop (the one of the quorum it healed or resumed in could not run)
    sent = []
    monkeypatch.setattr(replica_module, "compare", lambda m, lineage, trained=True: sent.append((lineage, trained))
                        or ([12, 13], [True, True]))
    replica._joining, replica._quorum_ok = False, True
    replica._check_lineage(_Manager())  # (replica rank 0's 12 kept: both trained theirs; this group's)
    assert sent == [(12, False)]


def test_the_group_whose_history_is_not_kept_stops_to_heal_when_restarted(monkeypatch, capsys):
    replica, _ = _replica(monkeypatch, 9, [5, 9, 5])
    replica._manager = manager = _Manager()
    with pytest.raises(FaultToleranceError, match=r"replica group 1: the replica groups of this quorum hold 2 "
                                                  r"different histories of the same 6 committed steps, and this "
                                                  r"group's is not the one kept: it heals from a group that kept it "
                                                  r"when its launcher starts it again"):
        replica._check_lineage(manager)
    assert not replica._quorum_ok  # (abandon() then sends nothing for the step)
    assert "is not the one kept" in str(manager.reported[-1])  # (recorded too: a script that catches it sends nothing)
    said = capsys.readouterr().err
    assert "by replica rank [5, 9, 5]; kept: the history 2 of the 3 groups hold, 5; no group commits this step" in said
    assert "this group's, 9, is not: it stops" in said  # (no tie: no word of the tie-break)
    assert "a raising backward without find_unused_parameters=True, or a failed vote" in said
    # a script that catches it and goes on gets it again at its next step: its process must end
    with pytest.raises(FaultToleranceError, match="is not the one kept"):
        replica.begin_step()


def test_a_check_that_cannot_run_fails_the_step_and_runs_again_next_step(monkeypatch):
    replica, calls = _replica(monkeypatch, 5, [5, 5])
    manager = _Manager()
    manager.report_error(RuntimeError("configure failed"))
    replica._check_lineage(manager)  # errored already: nothing sent (as the buckets)
    assert calls == [] and replica._checked_quorum is None

    def gone(manager, lineage, trained=True):
        raise RuntimeError("Connection reset by peer")

    monkeypatch.setattr(replica_module, "compare", gone)
    manager = _Manager()
    replica._check_lineage(manager)
    assert "Connection reset" in str(manager.reported[0]) and replica._checked_quorum is None


def test_the_history_travels_with_a_heal_and_in_checkpoints():
    replica = Replica(FaultToleranceSettings(lighthouse="127.0.0.1:9", group=0, groups=2), rank=0, world_size=1,
                      store=None)
    replica.load_state_dict({"step": 4, "batches_committed": 8, "lineage": 77})
    assert replica.state_dict() == {"step": 4, "batches_committed": 8, "lineage": 77}
    replica.load_state_dict({"step": 4, "batches_committed": 8})  # a checkpoint of an earlier release
    assert replica.state_dict()["lineage"] == 0


def test_a_peer_sends_the_history_of_its_step_boundary_and_the_healed_group_takes_it():
    from types import SimpleNamespace

    sender = Replica(FaultToleranceSettings(lighthouse="127.0.0.1:9", group=0, groups=2), rank=0, world_size=1,
                     store=None)
    sender._boundary = SimpleNamespace(resolve=lambda: {"step": 3})
    sender._lineage, sender._boundary_lineage = 99, 41  # (it committed again after the boundary the peer reads)
    sent = sender._state_dict()
    assert sent == {"step": 3, "lineage": 41}
    healed = Replica(FaultToleranceSettings(lighthouse="127.0.0.1:9", group=1, groups=2), rank=0, world_size=1,
                     store=None)
    healed._healing = SimpleNamespace(load=lambda state, loaders: state["step"])
    healed._load(sent)
    assert healed._lineage == 41 and healed.healed_step == 3


class _Committing:
    """A torchft Manager with the members the vote (anyaccel/fault_tolerance/vote.py) reads, whose step commits
    (or, ``groups_needed`` above the 2 taking part, does not)."""

    def __init__(self, groups_needed=1):
        from types import SimpleNamespace

        self._recovery_event, self._healing, self._errored, self._max_retries = None, False, None, 20
        self._min_replica_size, self._commit_failures = groups_needed, 0
        self._step, self._batches_committed, self._quorum_id = 6, 12, 4
        self._pg = SimpleNamespace(errored=lambda: None)
        self._checkpoint_transport = SimpleNamespace(disallow_checkpoint=lambda: None)

    def num_participants(self):
        return 2

    def errored(self):
        return None

    def current_step(self):
        return self._step


@pytest.mark.parametrize("commits", [True, False])
def test_a_committed_step_and_its_quorum_advance_the_history_and_an_uncommitted_one_does_not(commits, capsys):
    replica = Replica(FaultToleranceSettings(lighthouse="127.0.0.1:9", group=0, groups=2), rank=0, world_size=1,
                      store=None)
    replica._manager, replica._averaged, replica._lineage = _Committing(1 if commits else 3), True, 55
    assert replica.commit() is commits
    assert replica._lineage == (advance(55, quorum_id=4, step=7) if commits else 55)


def _joining(monkeypatch, kept: bool):
    """A group in resume() whose quorum's check kept (``kept``) or did not keep its history; its second
    quorum (after the one that did not keep it) heals it."""
    from types import SimpleNamespace

    from anyaccel.fault_tolerance.replica import HealReport

    replica = Replica(FaultToleranceSettings(lighthouse="127.0.0.1:9", group=0, groups=2), rank=0, world_size=1,
                      store=None)
    errors = []
    manager = SimpleNamespace(_step=6, errored=lambda: errors[-1] if errors else None, report_error=errors.append)
    replica._manager, quorums = manager, []

    def begin_step():
        quorums.append(manager._step)
        errors.clear()  # (torchft's start_quorum)
        if len(quorums) == 1:  # the check of _check_lineage, as it ends when another history is kept or this one
            replica._lineage_error = FaultToleranceError("the replica groups of this quorum hold 2 different ...")
            manager.report_error(SimpleNamespace(original_exception=replica._lineage_error))
            replica._rejoin, replica._pending = not kept, True
        else:
            replica.heals.append(HealReport(6, 100, 0.1, 0.2))

    monkeypatch.setattr(replica, "begin_step", begin_step)
    return replica, quorums


def test_in_resume_a_group_whose_history_is_kept_goes_on_and_its_first_step_does_not_commit(monkeypatch):
    """(ftreview, HIGH) join() raised 'could not join the running job' on the error the kept group itself
    reported, ending the group whose history was kept."""
    replica, quorums = _joining(monkeypatch, kept=True)
    assert replica.join() is None and quorums == [6]


def test_in_resume_a_group_whose_history_is_not_kept_heals_at_once_one_count_lower(monkeypatch):
    """(ftreview) A group restarted from its own checkpoint of the history that was not kept, at the
    others' count, would have stopped again at every restart: it now heals in resume(), its loaders
    with it."""
    replica, quorums = _joining(monkeypatch, kept=False)
    heal = replica.join()
    assert quorums == [6, 5] and heal is not None and heal.step == 6 and not replica._rejoin


class _Quorums:
    """A torchft Manager for Replica.join() through the real begin_step/_settle/_check_lineage: each
    start_quorum forms a new quorum whose highest count is ``highest``; as torchft, a member below it
    heals (its state applied by _apply_pending_state_dict: the kept history, lineage 5)."""

    def __init__(self, replica, highest):
        from types import SimpleNamespace

        self._replica, self.highest, self.asked = replica, highest, []
        self._step, self._quorum_id, self._quorum_future, self._healing, self._errored = 6, 0, None, False, None
        self.count = SimpleNamespace(transfers=0, seconds=0.0, bytes=0)

    def start_quorum(self):
        import concurrent.futures

        self.asked.append(self._step)
        self._errored, self._quorum_id = None, self._quorum_id + 1
        self._quorum_future = concurrent.futures.Future()
        self._quorum_future.set_result(None)
        self._healing = self._step < self.highest

    def _apply_pending_state_dict(self):
        self._step = self.highest
        self.count.transfers, self.count.bytes = self.count.transfers + 1, self.count.bytes + 100
        self._replica._load({"lineage": 5})

    def errored(self):
        return self._errored

    def report_error(self, error):
        from types import SimpleNamespace

        self._errored = SimpleNamespace(original_exception=error)

    def current_step(self):
        return self._step

    def num_participants(self):
        return 2

    def is_participating(self):
        return True


@pytest.mark.parametrize("someone_kept_it", [True, False])
def test_resume_heals_a_group_whose_history_is_not_kept_through_the_real_quorum_steps(monkeypatch, someone_kept_it):
    """join() -> begin_step -> _settle -> _check_lineage (not kept, count 6) -> one count lower -> the next
    quorum heals it from a group at 6 (its history then kept: the check passes). With no group at 6
    left in that quorum it would have gone on a count behind its own weights: it stops instead."""
    from types import SimpleNamespace

    replica = Replica(FaultToleranceSettings(lighthouse="127.0.0.1:9", group=1, groups=2), rank=0, world_size=1,
                      store=None)
    manager = _Quorums(replica, highest=6 if someone_kept_it else 5)
    replica._manager, replica._lineage = manager, 9
    replica._transport = SimpleNamespace(count=manager.count)
    replica._healing = SimpleNamespace(load=lambda healed, loaders: 6, boundary=lambda: None)
    monkeypatch.setattr(replica_module, "compare", lambda m, lineage, trained=True: ([5, lineage], [True, trained]))
    if someone_kept_it:
        heal = replica.join()
        assert manager.asked == [6, 5] and heal is not None and heal.step == 6 and heal.bytes == 100
        assert replica._lineage == 5 and manager.errored() is None and not replica._rejoin
    else:
        with pytest.raises(FaultToleranceError, match="could not heal from a group that kept it"):
            replica.join()
        assert manager.asked == [6, 5]
