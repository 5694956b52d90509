"""``anyaccel launch --fault_tolerance`` before anything starts (anyaccel/launch/replica_groups.py and
the plan's fault-tolerance phase): what each replica group's launcher is told, the final report
and exit status, and what this release refuses. The launch itself: tests/multiprocess/test_fault_tolerance.py."""

from __future__ import annotations

import signal

import pytest

from anyaccel.launch.plan import PlanError
from anyaccel.launch.replica_groups import group_plan, summary

from unit.launch.test_plan import plan


def test_each_group_gets_one_process_its_index_the_count_and_the_lighthouse():
    p = plan(num_processes=3, fault_tolerance="on", max_restarts=2)
    assert (p.fault_tolerance, p.fault_tolerance_min_replicas, p.nproc_per_node) == ("on", 1, 3)
    g = group_plan(p, 2, "127.0.0.1:4242", restarts_left=2)
    env = g.env_dict()
    assert (g.nproc_per_node, g.num_processes, g.replica_group, g.max_restarts) == (1, 1, 2, 2)
    assert (env["ANYACCEL_FAULT_TOLERANCE"], env["ANYACCEL_REPLICA_GROUP"], env["ANYACCEL_REPLICA_GROUPS"]) == \
        ("127.0.0.1:4242", "2", "3")
    assert env["OMP_NUM_THREADS"] == "1"  # the groups share the machine
    assert "ANYACCEL_REPLICA_GROUP_RESTART" not in env
    assert group_plan(p, 0, "h:1", 1, restart=1).env_dict()["ANYACCEL_REPLICA_GROUP_RESTART"] == "1"


def test_the_min_replicas_and_the_lighthouse_address_reach_the_plan():
    p = plan(num_processes=2, fault_tolerance="http://lh:29510", fault_tolerance_min_replicas=2)
    assert (p.fault_tolerance, p.fault_tolerance_min_replicas) == ("lh:29510", 2)
    assert p.env_dict()["ANYACCEL_FAULT_TOLERANCE_MIN_REPLICAS"] == "2"


@pytest.mark.parametrize("flags, message", [
    (dict(num_processes=4, num_machines=2, main_process_ip="10.0.0.1"), "runs on one machine in this release"),
    (dict(num_processes=2, strategy="fsdp"), "the fsdp strategy .*cannot split"),
    (dict(num_processes=2, fault_tolerance_min_replicas=3), "more than the 2 replica groups"),
])
def test_what_this_release_cannot_do_is_refused_before_anything_starts(flags, message):
    with pytest.raises(PlanError, match=message):
        plan(fault_tolerance="on", **flags)


def test_the_summary_says_what_happened_to_each_group_and_picks_the_exit_status():
    assert summary({0: 0, 1: 0}, {}) == (0, "replica groups: group 0 finished; group 1 finished")
    code, line = summary({0: 0, 1: 1}, {1: 1})
    assert code == 0 and "group 1 lost: exit 1 (its launcher started again 1x)" in line and "finished on the" in line
    assert summary({0: 75, 1: 75}, {})[0] == 75
    code, line = summary({0: -signal.SIGKILL, 1: 1}, {})
    assert code == 1 and "killed by SIGKILL" in line
