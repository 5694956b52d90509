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


def test_the_groups_keep_the_history_most_of_them_hold_and_among_equals_the_lowest_replica_ranks():
    assert verdict([7, 7, 7]) == 7
    assert verdict([5, 9, 9]) == 9  # 2 of 3
    assert verdict([9, 5]) == 9 and verdict([5, 9]) == 5  # a tie: replica rank 0's
    assert verdict([4, 9, 9, 4]) == 4


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


def _replica(monkeypatch, mine, everyone):
    replica = Replica(FaultToleranceSettings(lighthouse="127.0.0.1:9", group=1, groups=len(everyone)), rank=0,
                      world_size=1, store=None)
    replica._lineage, replica._quorum_ok = mine, True
    calls = []
    monkeypatch.setattr(replica_module, "compare", lambda manager, lineage: calls.append(lineage) or list(everyone))
    return replica, calls


def test_one_history_lets_the_step_go_on_and_is_checked_once_per_quorum(monkeypatch):
    replica, calls = _replica(monkeypatch, 5, [5, 5])
    manager = _Manager()
    replica._check_lineage(manager)
    assert calls == [5] and not manager.reported and replica._checked_quorum == 12


def test_the_group_whose_history_is_kept_fails_the_step_and_says_so(monkeypatch, capsys):
    replica, _ = _replica(monkeypatch, 5, [5, 9])
    manager = _Manager()
    replica._check_lineage(manager)
    assert len(manager.reported) == 1 and str(manager.reported[0]) == (
        "the replica groups of this quorum hold 2 different histories of the same 6 committed steps")
    said = capsys.readouterr().err
    assert replica._quorum_ok and "the history 1 of the 2 groups hold is kept" in said and "this group's is kept" in said


def test_the_group_whose_history_is_not_kept_stops_to_heal_when_restarted(monkeypatch, capsys):
    replica, _ = _replica(monkeypatch, 9, [5, 9, 5])
    with pytest.raises(FaultToleranceError, match=r"replica group 1: the replica groups of this quorum hold 2 "
                                                  r"different histories of the same 6 committed steps, and this "
                                                  r"group's is not the one kept: it heals from a group that kept it "
                                                  r"when its launcher starts it again"):
        replica._check_lineage(_Manager())
    assert not replica._quorum_ok  # (abandon() then sends nothing for the step)
    said = capsys.readouterr().err
    assert "the history 2 of the 3 groups hold is kept" in said and "this group's is not: it stops" in said


def test_a_check_that_cannot_run_fails_the_step_and_runs_again_next_step(monkeypatch):
    replica, calls = _replica(monkeypatch, 5, [5, 5])
    manager = _Manager()
    manager.report_error(RuntimeError("configure failed"))
    replica._check_lineage(manager)  # errored already: nothing sent (as the buckets)
    assert calls == [] and replica._checked_quorum is None

    def gone(manager, lineage):
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
