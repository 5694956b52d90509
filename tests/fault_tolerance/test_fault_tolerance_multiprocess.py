"""Per-step fault tolerance with real processes: ``anyaccel launch --fault_tolerance on`` with 2
replica groups of 2 processes each, FSDP2 inside every group (``--parallelism_config_dp_replicate_size
2 --parallelism_config_dp_shard_size 2``: torchft manages the replica dimension), or tensor
parallelism inside every group (``--parallelism_config_tp_size 2`` instead: the MLP's first layer
cut by columns, its last by rows), or sequence parallelism inside every group
(``--parallelism_config_sp_size 2``: a transformers Llama with tied embeddings), or expert
parallelism inside every group (``--parallelism_config_ep_size 2`` with ``dp_shard_size 2``: a
transformers Qwen3-MoE, half of every layer's experts on each rank), running
tests/fault_tolerance/ft_train.py; every process of one group is SIGKILLed mid-epoch.

One launched job carries every check (a launch and a restart cost seconds each on a loaded
2-core box): the other group commits its next step within a bound and none of its processes is
restarted; the killed group is restarted by its own agent, each of its ranks heals in
``resume()`` from the same rank of the live group (only what that rank holds: its FSDP2 shards,
tensor-parallel slices or experts) and from then on holds
bitwise that rank's weights, learning rate, RNG state and loader position at every step. (Groups
of one process run the same protocol: the unit tests in tests/fault_tolerance, and
``python -m benchmarks --only fault_tolerance``.) The seconds measured are written to
``FT_FIGURES`` when set (``python -m benchmarks`` reads them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CONSOLE_SCRIPT, SCRIPTS, clean_env

pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")

#: seconds from the kill to the survivor's first step committed without the dead group, at most: the
#: Lighthouse's heartbeat timeout (3 s) leaves the dead group out of the next quorum; the rest is
#: the failed step, the new gloo group and slack for a loaded machine
COMMIT_BOUND_S = 3.0 + 12.0


GROUP_SIZE = 2  # ranks per replica group (FSDP2 shards, or tensor-parallel ranks)


#: how the 2 processes of a group split the model: FSDP2 (dp_shard), tensor parallelism (tp),
#: sequence parallelism (sp, Ulysses: a transformers Llama, each rank half of every sequence, FSDP2's
#: shard over the group's 2 ranks), or expert parallelism (ep: a transformers Qwen3-MoE, each rank 4
#: of every layer's 8 experts, the tokens sent to their experts' rank and back, FSDP2's shard over
#: the group's 2 ranks for the rest)
INSIDE = {"fsdp2": ["--parallelism_config_dp_shard_size"], "tp": ["--parallelism_config_tp_size"],
          "sp": ["--parallelism_config_sp_size"],
          "ep": ["--parallelism_config_dp_shard_size", str(GROUP_SIZE), "--parallelism_config_ep_size"]}
#: the model each runs (ft_train.py's FT_MODEL)
MODEL = {"sp": "llama", "ep": "moe"}


def _records(out: Path, group: int, rank: int = 0) -> list:
    path = out / f"group_{group}_rank_{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _steps(records: list, pid=None) -> dict:
    return {r["committed"]: r for r in records if r["event"] == "step" and (pid is None or r["pid"] == pid)}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("inside", sorted(INSIDE))
def test_a_killed_replica_group_leaves_the_other_training_then_heals_shard_by_shard_and_matches_bitwise(
        tmp_path, inside):
    out = tmp_path / "out"
    out.mkdir()
    # at most 128 steps a process (8 epochs of 16; sequence parallelism, whose ranks share a batch: 4 of 32),
    # the kill after about 6: the survivor trains alone at FT_ALONE_SLEEP a step, up to about 60 s, and
    # _check_rank wants 20 steps in common after the heal, so the killed group's restart (and, for the
    # transformers models, their import) has about 50 s (2.4 s for the MoE on a quiet machine; over 7 s once
    # in a loaded CI). Both groups end 35 steps after the heal (FT_TOGETHER): the rest would check nothing more
    env = clean_env(FT_OUT=str(out), FT_EPOCHS="4" if inside == "sp" else "8", FT_TOGETHER="30",
                    FT_ALONE_SLEEP=os.environ.get("FT_ALONE_SLEEP", "0.5"), FT_MODEL=MODEL.get(inside, "mlp"))
    launcher = subprocess.Popen(
        [sys.executable, "-c", CONSOLE_SCRIPT, "launch", "--cpu", "--fault_tolerance", "on", "--num_processes", "4",
         "--parallelism_config_dp_replicate_size", "2", *INSIDE[inside], str(GROUP_SIZE),
         "--max_restarts", "1", str(SCRIPTS / "ft_train.py")],
        env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:  # mid-epoch 0: a few steps that both groups took together
            together = [r for r in _steps(_records(out, 1)).values() if r["participants"] == 2]
            if len(together) >= 5:
                break
            assert launcher.poll() is None, launcher.stdout.read()
            assert time.monotonic() < deadline, "the two replica groups never trained together"
            time.sleep(0.05)
        victims = {_records(out, 1, rank)[-1]["pid"] for rank in range(GROUP_SIZE)}  # every process of group 1
        killed_at = time.time()
        for victim in victims:
            os.kill(victim, signal.SIGKILL)
        output, _ = launcher.communicate(timeout=420)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, output[-6000:]
    restart_line = [line for line in output.splitlines() if line.startswith("anyaccel launch: replica group 1:")
                    and "killed by SIGKILL" in line]
    assert restart_line and "(restart 1 of 1)" in restart_line[0], output[-3000:]
    assert "replica groups: group 0 finished; group 1 finished" in output, output[-3000:]
    for rank in range(GROUP_SIZE):
        _check_rank(out, rank, victims, killed_at, output)
    if inside == "ep":  # the experts were split: rank r of each group held the same 4 of every layer's 8, before
        # and after the restart (4 processes, 2 of them restarted: 6 starts), and sent tokens to the other rank
        for rank in range(GROUP_SIZE):
            starts = [r["experts"] for group in (0, 1) for r in _records(out, group, rank) if r["event"] == "start"]
            assert len(starts) == 3 and all(s["held"] == [[4 * rank, 4]] * 2 for s in starts), (rank, starts)
            ends = [r["experts"] for group in (0, 1) for r in _records(out, group, rank) if r["event"] == "end"]
            assert len(ends) == 2 and all(e["held"] == [[4 * rank, 4]] * 2 and e["bytes_sent"] > 0 for e in ends), ends
    if os.environ.get("FT_FIGURES") and inside == "fsdp2":
        Path(os.environ["FT_FIGURES"]).write_text(json.dumps(_figures(out, killed_at)))


def _check_rank(out: Path, rank: int, victims: set, killed_at: float, output: str) -> None:
    """Rank ``rank`` of the survivor (group 0) and of the killed group (group 1)."""
    g0, g1 = _records(out, 0, rank), _records(out, 1, rank)
    # the survivor: one process all along, its next committed step within the bound, training on alone
    assert [r["event"] for r in g0].count("start") == 1 and len({r["pid"] for r in g0}) == 1
    # (a step whose all-reduce finished before the kill may still commit after it: count from the
    # first step taken without the dead group)
    alone = [r for r in g0 if r["event"] == "step" and r["t"] > killed_at and r["stepped"] and r["participants"] == 1]
    assert alone, f"rank {rank} of the survivor never trained alone"
    commit_s = alone[0]["t"] - killed_at
    assert commit_s < COMMIT_BOUND_S, (rank, commit_s, output[-3000:])
    # the killed group: restarted once, each rank healed from the same rank of the survivor in resume()
    starts = [r for r in g1 if r["event"] == "start"]
    assert len(starts) == 2 and starts[1]["pid"] not in victims
    restart = starts[1]
    assert restart["resumed"] and restart["resumed"].startswith("a live replica group"), restart
    heal = restart["heals"][-1]
    assert heal["bytes"] > 1_000 and heal["step"] == restart["committed"] > 0
    # from the heal on: bitwise the survivor's shards, learning rate, RNG and loader position
    mine, theirs = _steps(g1, pid=restart["pid"]), _steps(g0)
    common = sorted(set(mine) & set(theirs))
    assert len(common) >= 20 and common[0] == restart["committed"] + 1, (common[:3], restart)
    for step in common:
        for key in ("sha", "lr", "rng", "epoch", "position", "participants"):
            assert mine[step][key] == theirs[step][key], (rank, step, key, mine[step], theirs[step])
    ends = {r["group"]: r for r in g0 + g1 if r["event"] == "end"}
    assert ends[0]["sha"] == ends[1]["sha"] and ends[0]["committed"] == ends[1]["committed"]
    assert ends[0]["uncommitted"] <= 1  # at most the step in flight when the peer died


def _figures(out: Path, killed_at: float) -> dict:
    """The seconds and bytes the benchmark table shows: the slowest rank's."""
    g0 = [r for rank in range(GROUP_SIZE) for r in _records(out, 0, rank)]
    restarts = [[r for r in _records(out, 1, rank) if r["event"] == "start"][-1] for rank in range(GROUP_SIZE)]
    heals = [r["heals"][-1] for r in restarts]
    alone = min(r["t"] for r in g0 if r["event"] == "step" and r["t"] > killed_at and r["participants"] == 1)
    return {"kill_to_commit_s": alone - killed_at, "heal_bytes": sum(h["bytes"] for h in heals),
            "heal_fetch_s": max(h["fetch_s"] for h in heals), "heal_total_s": max(h["total_s"] for h in heals),
            "restart_to_heal_s": max(r["t"] for r in restarts) - killed_at, "group_size": GROUP_SIZE}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_inside_groups_told_by_the_environment_keeps_every_rank_of_a_group_equal_through_a_kill_and_heal(
        tmp_path, monkeypatch, free_port):
    """The SLURM example's shape with 2 processes a node: one ``anyaccel launch --fault_tolerance
    HOST:PORT --num_processes 2`` per group, told its group (``ANYACCEL_REPLICA_GROUP``/``_GROUPS``),
    so DDP splits the batch inside each group; a Lighthouse served here. Every process of group 1 is
    SIGKILLed mid-epoch; its agent restarts it and it heals. Checked: what the FSDP2 test checks, per
    rank, and that the 2 ranks of a group hold the same weights at every step, as DDP's replicas
    must. Before 2026-11-30 they did not: the average over the groups started from each rank's own
    gradient (a parameter's hook runs before DDP's reducer writes the group's average into ``.grad``)
    and its result was copied over DDP's, so the ranks of a group drifted apart from the first step."""
    from anyaccel.fault_tolerance.lighthouse import Lighthouse

    monkeypatch.setenv("RUST_LOG", os.environ.get("RUST_LOG", "error"))  # (its Lighthouse logs each quorum)
    out = tmp_path / "out"
    out.mkdir()
    lighthouse = Lighthouse(min_replicas=1)
    launchers = []
    logs = [tmp_path / f"launch_{group}.log" for group in (0, 1)]  # (files: nothing to drain while they run)

    def outputs():
        return [log.read_text() if log.exists() else "" for log in logs]

    try:
        for group in (0, 1):
            # 8 epochs of 16 steps a process (2 groups x 2 ranks read 512 samples in batches of 8): time
            # enough, alone (about 60 s), for the killed group's restart on a loaded machine
            env = clean_env(FT_OUT=str(out), FT_EPOCHS="8", FT_ALONE_SLEEP="0.5", FT_TOGETHER="30",
                            ANYACCEL_REPLICA_GROUPS="2",
                            ANYACCEL_REPLICA_GROUP=str(group))
            with open(logs[group], "w") as log:
                launchers.append(subprocess.Popen(
                    [sys.executable, "-c", CONSOLE_SCRIPT, "launch", "--cpu", "--fault_tolerance", lighthouse.address,
                     "--num_processes", "2", "--main_process_port", str(free_port()), "--max_restarts", "1",
                     str(SCRIPTS / "ft_train.py")], env=env, cwd=str(tmp_path), stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 240
        while sum(r["participants"] == 2 for r in _steps(_records(out, 1)).values()) < 5:
            assert all(p.poll() is None for p in launchers), [o[-3000:] for o in outputs()]
            assert time.monotonic() < deadline, "the two replica groups never trained together"
            time.sleep(0.05)
        victims = {_records(out, 1, rank)[-1]["pid"] for rank in range(GROUP_SIZE)}
        killed_at = time.time()
        for victim in victims:
            os.kill(victim, signal.SIGKILL)
        for p in launchers:
            p.wait(timeout=300)
    finally:
        for p in launchers:
            if p.poll() is None:
                p.kill()
        lighthouse.close()
    assert [p.returncode for p in launchers] == [0, 0], [o[-3000:] for o in outputs()]
    assert "healed from a live peer" in outputs()[1], outputs()[1][-3000:]
    for rank in range(GROUP_SIZE):
        _check_rank(out, rank, victims, killed_at, outputs()[1])
    for group in (0, 1):  # DDP's replicas: both ranks of a group hold the same weights at every step
        pid = [r for r in _records(out, group, 1) if r["event"] == "start"][-1]["pid"]
        first, second = _steps(_records(out, group, 0)), _steps(_records(out, group, 1), pid=pid)
        common = sorted(set(first) & set(second))
        assert len(common) >= 20, (group, common[:3])
        for step in common:
            assert first[step]["sha"] == second[step]["sha"], (group, step)


#: the step group 1's backward raises in (both groups take part in every step: the test's
#: --fault_tolerance_min_replicas 2)
RAISE_AT = 8


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_backward_that_raises_in_one_group_is_voted_down_there_and_the_group_heals_and_lines_up(tmp_path):
    """2 groups of 1 process; group 1's backward raises in step RAISE_AT after its last layer's
    buckets left (one gradient a bucket), and the script goes on. Group 1 sends the rest of the step
    (zeros) and votes it down; group 0 commits it (DDP's default, find_unused_parameters off: no
    flags travel, so group 0 cannot know), group 1, one step behind, heals from group 0 at its next
    quorum, and every later step commits in both with bitwise equal weights (their all-reduces still
    line up). Before: group 1 never took another step with group 0, which went on alone. (With
    find_unused_parameters no group commits the step: tests/fault_tolerance/test_averaging.py.)"""
    out = tmp_path / "out"
    out.mkdir()
    env = clean_env(FT_OUT=str(out), FT_EPOCHS="1", FT_RAISE_AT=str(RAISE_AT))
    done = subprocess.run(
        [sys.executable, "-c", CONSOLE_SCRIPT, "launch", "--cpu", "--fault_tolerance", "on", "--num_processes", "2",
         # both groups in every quorum: a group that starts seconds late (a loaded machine) cannot find the
         # other past RAISE_AT already (no group is lost in this test)
         "--fault_tolerance_min_replicas", "2", str(SCRIPTS / "ft_train.py")], env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-6000:]
    g0, g1 = _records(out, 0), _records(out, 1)
    raised = [r for r in g1 if r["event"] == "raised"]
    assert len(raised) == 1 and raised[0]["committed"] == RAISE_AT - 1 and raised[0]["uncommitted"] == 1, raised
    assert f"replica group 1: step {RAISE_AT} not committed (FaultToleranceError: this replica group's backward raised" \
        in done.stdout, done.stdout[-3000:]
    assert f"replica group 0: step {RAISE_AT} not committed" not in done.stdout
    # group 0 skips at most the step group 1 heals in (it sits that one out: 1 of the 2 groups min_replicas asks)
    skipped = [r["committed"] for r in g0 if r["event"] == "step" and not r["stepped"] and r["t"] > raised[0]["t"] - 5]
    assert skipped in ([], [RAISE_AT]), skipped
    assert "replica group 1: healed from a live peer" in done.stdout, done.stdout[-3000:]
    mine, theirs = _steps(g1), _steps(g0)
    first = [r for r in g0 if r["event"] == "step" and r["committed"] == RAISE_AT][0]
    assert first["stepped"] and first["t"] > raised[0]["t"] - 5  # group 0 committed the step group 1 raised in
    after = [step for step in sorted(set(mine) & set(theirs)) if step > RAISE_AT]
    assert len(after) >= 15 and after[0] <= RAISE_AT + 2, after[:3]
    for step in sorted(set(mine) & set(theirs)):
        assert mine[step]["sha"] == theirs[step]["sha"], step
    assert all(mine[step]["participants"] == theirs[step]["participants"] == 2 for step in after[1:])
    ends = {r["group"]: r for r in g0 + g1 if r["event"] == "end"}
    assert ends[0]["sha"] == ends[1]["sha"] and ends[0]["committed"] == ends[1]["committed"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_backward_that_raises_in_a_group_of_two_fsdp2_processes_ends_that_group_which_heals_when_restarted(tmp_path):
    """2 groups of 2 FSDP2 processes; group 1's backward raises in step RAISE_AT on both its ranks.
    FSDP2 cannot go on after that, so group 1's processes end at once, sending nothing more of the
    step; group 0 sees a group that died (its step does not commit) and goes on, never restarted;
    group 1's launcher starts it again, it heals shard by shard, and every later step is bitwise
    equal. Before: group 1 sent the rest of the step and went on; its next step boundary failed in
    FSDP2 ("Trying to resize storage that is not resizable") and group 0's rank 0 was aborted by
    gloo (EnforceNotMet), so both groups restarted."""
    out = tmp_path / "out"
    out.mkdir()
    # 4 epochs (16 steps each): group 0 trains alone ~40 steps at FT_ALONE_SLEEP after the raise, ~12 s, so that
    # group 1's restart (a new interpreter importing torch: seconds on a loaded machine) finds it live; with 2
    # epochs (~7 s) it once came back after group 0 had ended, found no live peer and stopped (a loaded CI)
    env = clean_env(FT_OUT=str(out), FT_EPOCHS="4", FT_RAISE_AT=str(RAISE_AT), FT_ALONE_SLEEP="0.3")
    done = subprocess.run(
        [sys.executable, "-c", CONSOLE_SCRIPT, "launch", "--cpu", "--fault_tolerance", "on", "--num_processes", "4",
         "--parallelism_config_dp_replicate_size", "2", "--parallelism_config_dp_shard_size", "2", "--max_restarts", "1",
         str(SCRIPTS / "ft_train.py")], env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=270)
    assert done.returncode == 0, done.stdout[-6000:]
    assert "EnforceNotMet" not in done.stdout and "resize storage" not in done.stdout, done.stdout[-4000:]
    for rank in range(GROUP_SIZE):
        assert (f"replica group 1, rank {rank}: its backward raised (BackwardRaised: raised in backward): the strategy "
                "inside a group of 2 processes cannot go on") in done.stdout, done.stdout[-4000:]
        g0, g1 = _records(out, 0, rank), _records(out, 1, rank)
        assert len({r["pid"] for r in g0}) == 1  # group 0 never restarted
        assert len({r["pid"] for r in g1}) == 2  # group 1 ended and was started again
        restarted = [r for r in g1 if r["event"] == "start"][-1]
        assert restarted["heals"] and restarted["committed"] >= RAISE_AT - 1, restarted
        mine, theirs = _steps(g1, pid=restarted["pid"]), _steps(g0)
        common = sorted(set(mine) & set(theirs))
        assert len(common) >= 10, common
        for step in common:
            assert mine[step]["sha"] == theirs[step]["sha"], (rank, step)
        ends = [[r for r in records if r["event"] == "end"][-1] for records in (g0, g1)]
        assert ends[0]["sha"] == ends[1]["sha"] and ends[0]["committed"] == ends[1]["committed"], ends
    assert "replica group 1: healed from a live peer" in done.stdout


APART_AT = 6


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_groups_that_meet_again_with_different_histories_of_one_step_count_are_found_and_made_equal(tmp_path):
    """3 groups of 1 process, ``min_replicas`` 1 (the default). The backwards of groups 1 and 2 raise
    in step APART_AT: group 0 commits the step, they vote it down. Group 0 then waits (heartbeating)
    before its next quorum, so theirs forms without it (2 of the 3 groups the Lighthouse hears from)
    and they take the step again, on other batches: all three now count APART_AT committed steps,
    with two sets of weights. When they meet, the lineage check (anyaccel/fault_tolerance/lineage.py)
    finds the two histories: no group of that quorum commits the step, each group whose history is
    not kept stops and its launcher starts it again, it heals in resume() (its loader moved to the
    others'), and every later step is bitwise equal in all three. Before: torchft heals only a lower
    count, so they went on with different weights for good, silently. (Which groups meet first
    depends on the order the Lighthouse hears them in: all three, and groups 1 and 2 are kept, or
    group 0 with one of them, a tie the first group in the quorum's order wins; either ends equal.)"""
    out = tmp_path / "out"
    out.mkdir()
    env = clean_env(FT_OUT=str(out), FT_EPOCHS="3", FT_RAISE_AT=str(APART_AT), FT_APART_AT=str(APART_AT),
                    FT_RAISE_GROUPS="1,2", FT_ALONE_SLEEP="0.3")
    done = subprocess.run(
        [sys.executable, "-c", CONSOLE_SCRIPT, "launch", "--cpu", "--fault_tolerance", "on", "--num_processes", "3",
         "--max_restarts", "1", str(SCRIPTS / "ft_train.py")], env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=270)
    assert done.returncode == 0, done.stdout[-6000:]
    records = {g: _records(out, g) for g in range(3)}
    apart = {g: [r for r in records[g] if r["event"] == "apart"] for g in range(3)}
    assert apart[0][0]["found"] and all(apart[g][0]["committed"] == APART_AT for g in range(3)), apart
    # groups 1 and 2 took step APART_AT again without group 0, which had committed it with them: other weights
    assert apart[1][0]["sha"] == apart[2][0]["sha"] != _steps(records[0])[APART_AT]["sha"], apart
    assert f"hold 2 different histories of the same {APART_AT} committed steps" in done.stdout, done.stdout[-4000:]
    lost = [g for g in range(3) if len({r["pid"] for r in records[g]}) == 2]  # stopped, and started again
    assert lost and len(lost) < 3, (lost, done.stdout[-3000:])
    for g in lost:
        assert f"replica group {g}: the replica groups of this quorum hold 2 different histories" in done.stdout
        assert f"replica group {g}: healed from a live peer" in done.stdout, done.stdout[-3000:]
        restarted = [r for r in records[g] if r["event"] == "start"][-1]
        assert restarted["heals"] and restarted["committed"] >= APART_AT, restarted
    # from the heals on, every step two groups both took is bitwise equal, and all end equal
    kept = next(g for g in range(3) if g not in lost)
    theirs = _steps(records[kept])
    for g in lost:
        mine = _steps(records[g], pid=[r for r in records[g] if r["event"] == "start"][-1]["pid"])
        common = sorted(set(mine) & set(theirs))
        assert len(common) >= 10, common
        for step in common:
            assert mine[step]["sha"] == theirs[step]["sha"], (g, step)
    ends = [[r for r in records[g] if r["event"] == "end"][-1] for g in range(3)]
    assert len({(e["sha"], e["committed"]) for e in ends}) == 1, ends


TIE_AT = 6


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_group_resumed_from_its_own_checkpoint_at_the_live_groups_count_heals_from_them_on_a_tie(
        tmp_path, monkeypatch):
    """The lineage check's tie-break, launched (anyaccel/fault_tolerance/lineage.py, ``verdict``): 2 groups
    of 1 process, one ``anyaccel launch --fault_tolerance HOST:PORT`` per group (the SLURM form), a
    Lighthouse served here. Group 0 first trains TIE_AT steps alone and saves its state, under a
    Lighthouse of its own (another run: its quorums numbered from 1, as group 1's will be, so only the
    quorums' member ids tell the two histories apart; before 2026-11-30 they were taken for one). Later group 1,
    from scratch and alone, trains TIE_AT steps of its own (other quorums: another history) and waits,
    asking nothing; group 0 is started again and resumes from its checkpoint; once the Lighthouse has
    its request (alone it forms no quorum while group 1 heartbeats: torchft's rule against half the
    groups), group 1 goes on and asks too. They meet, both at TIE_AT committed steps, with different
    histories, one group each: a tie. Group 1 has committed steps with its history, group 0 none since
    loading its own, so group 1's is kept, though group 0 is first in torchft's order (the rule before
    2026-11-30 kept the first group's, and stopped group 1, which has no restart here). Group 0 heals
    from group 1 at once, in ``resume()`` (one count lower); neither process restarts, and from then on
    every step of the two is bitwise equal, and both end at one count."""
    from anyaccel.fault_tolerance.lighthouse import Lighthouse

    monkeypatch.setenv("RUST_LOG", os.environ.get("RUST_LOG", "error"))  # (its Lighthouse logs each quorum)
    out = tmp_path / "out"
    out.mkdir()
    earlier = Lighthouse(min_replicas=1)  # the first run's
    lighthouse = Lighthouse(min_replicas=1)
    logs = {name: tmp_path / f"{name}.log" for name in ("first", "group_1", "group_0")}
    running = {}

    def launch(name, group, **knobs):
        env = clean_env(FT_OUT=str(out), FT_EPOCHS="1", FT_ALONE_SLEEP="0.05", ANYACCEL_REPLICA_GROUPS="2",
                        ANYACCEL_REPLICA_GROUP=str(group), **knobs)
        address = (earlier if name == "first" else lighthouse).address
        with open(logs[name], "w") as log:
            running[name] = subprocess.Popen(
                [sys.executable, "-c", CONSOLE_SCRIPT, "launch", "--cpu", "--fault_tolerance", address,
                 "--num_processes", "1", "--max_restarts", "0", str(SCRIPTS / "ft_train.py")],
                env=env, cwd=str(tmp_path), stdout=log, stderr=subprocess.STDOUT)

    def text(name):
        return logs[name].read_text() if logs[name].exists() else ""

    def texts():
        return {name: text(name)[-3000:] for name in logs}

    try:
        launch("first", 0, FT_SAVE_AT=str(TIE_AT))
        assert running["first"].wait(timeout=120) == 0, text("first")[-3000:]
        earlier.close()
        assert list((tmp_path / "replica_group_0" / "checkpoints").iterdir()), text("first")[-3000:]
        launch("group_1", 1, FT_WAIT_AT=str(TIE_AT), FT_WAIT_FOR="go")
        deadline = time.monotonic() + 120
        while TIE_AT not in _steps(_records(out, 1)):  # group 1 has committed its TIE_AT steps and waits
            assert running["group_1"].poll() is None and time.monotonic() < deadline, text("group_1")[-3000:]
            time.sleep(0.05)
        launch("group_0", 0)
        while (lighthouse.asking() or 0) < 1:  # group 0's resume() has asked (group 1 asks nothing while it waits)
            assert running["group_1"].poll() is None and running["group_0"].poll() is None, texts()
            assert time.monotonic() < deadline + 120, texts()
            time.sleep(0.05)
        (out / "go").touch()
        for name in ("group_1", "group_0"):
            running[name].wait(timeout=150)
    finally:
        for p in running.values():
            if p.poll() is None:
                p.kill()
        earlier.close()
        lighthouse.close()
    assert [running[n].returncode for n in ("group_1", "group_0")] == [0, 0], texts()
    first, g1 = _records(out, 0), _records(out, 1)
    assert len({r["pid"] for r in g1}) == 1  # group 1 never stopped
    runs = [r for r in first if r["event"] == "start"]
    assert len(runs) == 2 and runs[0]["pid"] != runs[1]["pid"], runs
    saved, resumed = _steps(first, pid=runs[0]["pid"]), runs[1]
    # two histories of TIE_AT steps: group 0's first run and group 1 alone reached other weights, both in their
    # Lighthouse's quorum 1 (only the quorums' member ids tell them apart)
    assert saved[TIE_AT]["sha"] != _steps(g1)[TIE_AT]["sha"]
    alone = {}  # group 1's first line of each count (the tie's step, not committed, repeats count TIE_AT)
    for r in g1:
        if r["event"] == "step":
            alone.setdefault(r["committed"], r)
    assert {saved[s]["quorum"] for s in range(1, TIE_AT + 1)} == {alone[s]["quorum"] for s in range(1, TIE_AT + 1)} \
        == {1}, (saved, alone)
    assert [r["found"] for r in g1 if r["event"] == "waited"] == [True]
    # group 0 loaded its own checkpoint (TIE_AT steps), the check kept group 1's history, group 0 healed in resume()
    assert resumed["restored"] == TIE_AT and resumed["heals"] and resumed["committed"] == TIE_AT, resumed
    assert f"hold 2 different histories of the same {TIE_AT} committed steps" in text("group_0"), texts()
    assert "replica rank 0 has committed no step since its history was loaded" in text("group_0"), texts()
    assert "as many groups hold another" in text("group_1"), texts()
    assert "this group's is kept" in text("group_1"), texts()
    assert "it heals from a group that kept its history now, in resume()" in text("group_0"), texts()
    assert "healed from a live peer" in text("group_0"), texts()
    mine, theirs = _steps(first, pid=resumed["pid"]), _steps(g1)
    common = sorted(set(mine) & set(theirs))
    assert len(common) >= 10, common
    for step in common:
        assert mine[step]["sha"] == theirs[step]["sha"], step
    ends = [[r for r in records if r["event"] == "end"][-1] for records in (first, g1)]
    assert ends[0]["sha"] == ends[1]["sha"] and ends[0]["committed"] == ends[1]["committed"], ends
