"""``anyaccel launch --fault_tolerance`` before anything starts (anyaccel/launch/replica_groups.py and
the plan's fault-tolerance phase): what each replica group's launcher is told, the final report
and exit status, and what this release refuses. The launch itself: tests/fault_tolerance/test_fault_tolerance_multiprocess.py."""

from __future__ import annotations

import signal

import pytest

from anyaccel.launch.plan import PlanError
from anyaccel.launch.replica_groups import group_plan, groups_of, lighthouse_address, summary

from test_plan import plan


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


def test_under_parallelism_config_dp_replicate_is_the_groups_and_each_group_gets_the_other_sizes():
    p = plan(num_processes=4, fault_tolerance="on", dp_replicate_size=2,
             dp_shard_size=2)
    assert (p.replica_group, p.replica_group_size, groups_of(p)) == (None, 2, 2)
    g = group_plan(p, 1, "127.0.0.1:4242", restarts_left=1)
    env = g.env_dict()
    assert (g.nproc_per_node, g.num_processes, g.replica_group, g.main_process_port) == (2, 2, 1, None)
    assert (env["ANYACCEL_REPLICA_GROUP"], env["ANYACCEL_REPLICA_GROUPS"]) == ("1", "2")
    assert (env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"], env["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("1", "2")


def test_a_launch_told_its_replica_group_is_that_group_on_any_number_of_machines():
    """One SLURM job step per group (examples/slurm/fault_tolerance.sbatch): every process of the launch is the group."""
    told = {"ANYACCEL_REPLICA_GROUP": "1", "ANYACCEL_REPLICA_GROUPS": "3"}
    p = plan(num_processes=4, num_machines=2, main_process_ip="10.0.0.1", fault_tolerance="lh:29510", env=told,
             dp_shard_size=4)
    assert (p.replica_group, p.replica_groups, p.replica_group_size, p.mode) == (1, 3, 4, "agent")
    env = p.env_dict()
    assert (env["ANYACCEL_REPLICA_GROUP"], env["ANYACCEL_REPLICA_GROUPS"], env["ANYACCEL_FAULT_TOLERANCE"]) == \
        ("1", "3", "lh:29510")
    with pytest.raises(PlanError, match="give the address of the job's Lighthouse instead"):
        plan(num_processes=2, fault_tolerance="on", env=told)


@pytest.mark.parametrize("machine", [0, 1])
def test_on_several_machines_each_starts_its_share_of_the_groups_and_machine_0_the_lighthouse(machine):
    """--fault_tolerance on --num_machines 2: machine k runs groups 2k and 2k+1 (a group never spans
    machines: each its own agent on loopback), every group told the job's 4 groups and machine 0's
    Lighthouse at the main process's address and port (which no job-wide rendezvous uses), also with
    --max_restarts and the static rendezvous (each group's agent restarts it on its own machine)."""
    p = plan(num_processes=4, num_machines=2, machine_rank=machine, main_process_ip="10.0.0.1", main_process_port=29510,
             fault_tolerance="on", max_restarts=2)
    assert (groups_of(p), p.replica_groups_here, p.first_replica_group, p.replica_group_size) == (4, 2, 2 * machine, 1)
    assert lighthouse_address(p) == "10.0.0.1:29510"
    g = group_plan(p, 2 * machine + 1, lighthouse_address(p), restarts_left=2)
    env = g.env_dict()
    assert (g.num_machines, g.machine_rank, g.main_process_ip, g.main_process_port, g.rdzv_backend) == \
        (1, 0, "127.0.0.1", None, "static")
    assert (g.nproc_per_node, g.replica_group) == (1, 2 * machine + 1)
    assert (env["ANYACCEL_REPLICA_GROUP"], env["ANYACCEL_REPLICA_GROUPS"], env["ANYACCEL_FAULT_TOLERANCE"]) == \
        (str(2 * machine + 1), "4", "10.0.0.1:29510")
    fsdp = plan(num_processes=8, num_machines=2, machine_rank=machine, main_process_ip="10.0.0.1", fault_tolerance="on",
                dp_replicate_size=4, dp_shard_size=2)
    assert (groups_of(fsdp), fsdp.replica_groups_here, fsdp.first_replica_group, fsdp.replica_group_size) == \
        (4, 2, 2 * machine, 2)
    assert lighthouse_address(fsdp) == "10.0.0.1:29500"
    assert lighthouse_address(plan(num_processes=2, fault_tolerance="on")) is None  # one machine: loopback, its own


def test_a_group_told_by_the_environment_that_spans_machines_keeps_its_own_multi_machine_rendezvous():
    """The SLURM form with one group over two machines: its agent's rendezvous is the job's (c10d
    for restarts, as without fault tolerance); only a launch that starts its machine's groups meets
    per group on loopback (and says that a --rdzv_backend it was given is ignored)."""
    told = {"ANYACCEL_REPLICA_GROUP": "1", "ANYACCEL_REPLICA_GROUPS": "3"}
    multi = dict(num_processes=4, num_machines=2, machine_rank=1, main_process_ip="10.0.0.1", fault_tolerance="lh:29510",
                 env=told, max_restarts=2)
    assert plan(rdzv_backend="c10d", **multi).rdzv_backend == "c10d"
    with pytest.raises(PlanError, match="needs --rdzv_backend c10d"):
        plan(**multi)
    p = plan(num_processes=4, num_machines=2, machine_rank=0, main_process_ip="10.0.0.1", fault_tolerance="on",
             rdzv_backend="c10d", max_restarts=2)
    assert p.rdzv_backend == "static" and any("--rdzv_backend c10d is ignored" in n for n in p.notes), p.notes
    half = plan(num_processes=4, num_machines=2, machine_rank=0, main_process_ip="10.0.0.1", fault_tolerance="on",
                max_restarts=2, env={"ANYACCEL_REPLICA_GROUP": "1"})  # one of the two: not told (as _fault_tolerance)
    assert (half.rdzv_backend, half.replica_group, half.replica_groups_here) == ("static", None, 2)


def test_several_machines_without_a_machine_rank_are_refused():
    """Each machine starts the groups of its rank: one left at the default 0 would start groups 0..n-1
    a second time (training on their data) and leave the others' share unstarted."""
    with pytest.raises(PlanError, match="pass --machine_rank K on machine K"):
        plan(num_processes=4, num_machines=2, main_process_ip="10.0.0.1", fault_tolerance="on")


def test_on_gpus_each_group_of_a_machine_gets_its_own_gpus(monkeypatch):
    """Each group has its own agent, which numbers its ranks from 0: without its own
    CUDA_VISIBLE_DEVICES every group would train on the machine's first GPUs."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    p = plan(gpus=4, fault_tolerance="on", dp_replicate_size=2, dp_shard_size=2, num_processes=4)
    assert [group_plan(p, g, "h:1", 0).env_dict()["CUDA_VISIBLE_DEVICES"] for g in (0, 1)] == ["0,1", "2,3"]
    p = plan(gpus=8, fault_tolerance="on", num_processes=8, num_machines=2, machine_rank=1, main_process_ip="10.0.0.1",
             gpu_ids="4,5,6,7")
    assert [group_plan(p, g, "h:1", 0).env_dict()["CUDA_VISIBLE_DEVICES"] for g in (4, 7)] == ["4", "7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    p = plan(gpus=2, fault_tolerance="on", num_processes=2)
    assert [group_plan(p, g, "h:1", 0).env_dict()["CUDA_VISIBLE_DEVICES"] for g in (0, 1)] == ["3", "1"]
    # more processes than GPUs (the plan allows it, with a note): the groups share them in turn, none is left without
    p = plan(gpus=2, fault_tolerance="on", num_processes=4)
    assert [group_plan(p, g, "h:1", 0).env_dict()["CUDA_VISIBLE_DEVICES"] for g in range(4)] == ["3", "1", "3", "1"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    p = plan(gpus=4, fault_tolerance="on", num_processes=4, gpu_ids="1,3")
    assert [group_plan(p, g, "h:1", 0).env_dict()["CUDA_VISIBLE_DEVICES"] for g in range(4)] == ["1", "3", "1", "3"]
    assert "CUDA_VISIBLE_DEVICES" not in group_plan(plan(num_processes=2, fault_tolerance="on"), 1, "h:1", 0).env_dict()


def test_machine_0_serves_the_lighthouse_while_groups_elsewhere_heartbeat(monkeypatch):
    """Machine 0's groups ended first: the Lighthouse stays up while the others' groups heartbeat
    (their quorums need it), says so once, and stops when none does, or at once where its status
    cannot be read (saying so)."""
    from anyaccel.launch import replica_groups

    class Counting:
        def __init__(self, counts):
            self.counts = list(counts)

        def heartbeating(self):
            return self.counts.pop(0)

    clock = [0.0]
    monkeypatch.setattr(replica_groups.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr(replica_groups.time, "monotonic", lambda: clock[0])
    said = []
    # a group that restarts is silent a while (here 5 s): served on; it stops 30 s after the last heartbeat
    lighthouse = Counting([2, 1] + [0] * 5 + [1] + [0] * 31 + [7])
    replica_groups._serve_the_other_machines(lighthouse, [], said.append)
    assert lighthouse.counts == [7] and len(said) == 1 and "(2 heartbeating" in said[0]
    said.clear()
    replica_groups._serve_the_other_machines(Counting([None]), [], said.append)
    assert len(said) == 1 and "could not be read" in said[0]
    replica_groups._serve_the_other_machines(Counting([3]), [15], said.append)  # a signal came (even while the
    # groups ran, when the forwarding queue was emptied): stop now


def test_a_machine_rank_that_does_not_fit_the_main_address_is_refused_from_a_config_file_and_said_from_a_flag():
    """One config file shared by every machine (a home directory on NFS) gives each machine_rank 0:
    every machine would start groups 0..n-1 and train on their data. Machine 0 is the one at the
    main address; a rank from a file that does not fit is refused, one given as a flag is said (NAT)."""
    from anyaccel.errors import CLIError
    from anyaccel.launch import replica_groups

    assert replica_groups.owns_address("127.0.0.1") is True and replica_groups.owns_address("192.0.2.99") is False
    said = []
    zero_elsewhere = plan(num_processes=2, num_machines=2, main_process_ip="192.0.2.99", fault_tolerance="on",
                          config={"machine_rank": 0, "num_machines": 2, "main_process_ip": "192.0.2.99"})
    assert dict(zero_elsewhere.sources)["machine_rank"] == "config file"
    with pytest.raises(CLIError, match="machine_rank 0 .from the config file.*not an address of this machine"):
        replica_groups._check_machine_rank(zero_elsewhere, said.append)
    one_here = plan(num_processes=2, num_machines=2, main_process_ip="127.0.0.1", fault_tolerance="on",
                    config={"machine_rank": 1, "num_machines": 2, "main_process_ip": "127.0.0.1"})
    with pytest.raises(CLIError, match="machine_rank 1 .*is an address of this machine"):
        replica_groups._check_machine_rank(one_here, said.append)
    flagged = plan(num_processes=2, num_machines=2, machine_rank=0, main_process_ip="192.0.2.99", fault_tolerance="on")
    replica_groups._check_machine_rank(flagged, said.append)
    assert len(said) == 1 and said[0].startswith("warning: machine_rank 0 (from flag)")
    replica_groups._check_machine_rank(plan(num_processes=2, num_machines=2, machine_rank=0,
                                            main_process_ip="127.0.0.1", fault_tolerance="on"), said.append)
    assert len(said) == 1  # fits: nothing said


def test_the_lighthouse_counts_the_groups_that_heartbeat_to_it():
    import datetime

    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseClient

    from anyaccel.fault_tolerance.lighthouse import Lighthouse

    lighthouse = Lighthouse(1, host="0.0.0.0")
    try:
        assert lighthouse.heartbeating() == 0
        LighthouseClient(f"http://127.0.0.1:{lighthouse.port}", datetime.timedelta(seconds=5)).heartbeat("group_7")
        assert lighthouse.heartbeating() == 1
        assert lighthouse.asking() == 0  # heartbeating, but no group has asked for a quorum
    finally:
        lighthouse.close()


def test_the_min_replicas_and_the_lighthouse_address_reach_the_plan():
    p = plan(num_processes=2, fault_tolerance="http://lh:29510", fault_tolerance_min_replicas=2)
    assert (p.fault_tolerance, p.fault_tolerance_min_replicas) == ("lh:29510", 2)
    assert p.env_dict()["ANYACCEL_FAULT_TOLERANCE_MIN_REPLICAS"] == "2"


@pytest.mark.parametrize("flags, message", [
    (dict(num_processes=6, num_machines=2, main_process_ip="10.0.0.1", dp_replicate_size=3, dp_shard_size=2),
     "does not divide over 2 machines"),
    (dict(num_processes=2, strategy="fsdp"), "the fsdp strategy .*cannot split"),
    (dict(num_processes=4, dp_shard_size=4), "set dp_replicate_size to the number of groups"),
    (dict(num_processes=4, dp_replicate_size=2, pp_size=2), "pp_size to 1"),
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
