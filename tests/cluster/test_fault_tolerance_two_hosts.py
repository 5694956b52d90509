"""Per-step fault tolerance (torchft) over the two hosts (scripts/cluster.sh; ``make test-cluster``).

One replica group per host, started the two ways a job on several machines has: both hosts first by
``anyaccel launch --fault_tolerance on --num_machines 2 --machine_rank K --main_process_ip
192.0.2.10 --main_process_port 29510`` (machine 0's launcher serves the Lighthouse there, heartbeat
timeout 3 s, join timeout 1 s; each starts its machine's share of the groups: group K), and host 1,
after its reboot, as one job step of docs/guides/fault-tolerance.md's SLURM section, ``anyaccel
launch --fault_tolerance 192.0.2.10:29510`` told its group (``ANYACCEL_REPLICA_GROUP``/
``ANYACCEL_REPLICA_GROUPS``); both running tests/fault_tolerance/ft_train.py (one JSON line per step: committed step, groups in the
quorum, weights' SHA-256). Host 1's cable is pulled mid-training: host 0's group commits its next
step within a bound and goes on alone, none of its processes restarting; host 1's processes are
then killed (a host that lost its network is rebooted), its cable plugged in again and its launch
started again, as the SLURM example's loop does: it heals from host 0 in ``resume()`` and from
then on both groups hold bitwise the same weights, learning rate, RNG state and loader position.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from . import figures
from .fault_tools import Tail, end_all, no_process_left
from .harness import CONSOLE_SCRIPT, ROOT, clean_env

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")

FT_TRAIN = ROOT / "tests" / "fault_tolerance" / "ft_train.py"
PORT = 29510
HEARTBEAT_S = 3.0  # the Lighthouse leaves a group out of the next quorum once its heartbeat is this old
TIMEOUT_S = 5  # TORCHFT_TIMEOUT_SEC: an all-reduce (or vote, or transfer) that long is given up
#: seconds from the cut to host 0's first step committed without host 1, at most. A pulled cable
#: resets no socket, so the all-reduce in flight ends only at torchft's timeout (TIMEOUT_S); by
#: then host 1's heartbeat is older than HEARTBEAT_S (its clock started at the cut too), so the
#: next quorum forms at once without it. The rest is one step and slack for a loaded machine.
COMMIT_BOUND_S = max(TIMEOUT_S, HEARTBEAT_S) + 10.0


def _records(out: Path, group: int) -> list:
    """Group ``group``'s lines so far (a line still being written, without its newline, is left out)."""
    path = out / f"group_{group}_rank_0.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]


def _steps(records: list, pid=None) -> dict:
    return {r["committed"]: r for r in records if r["event"] == "step" and (pid is None or r["pid"] == pid)}


def _until(what: str, check, timeout: float, tails) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline or any(t.proc.poll() is not None for t in tails):
            for t in tails:
                if t.proc.poll() is not None:
                    t.end(5)  # the reader thread's last lines
            pytest.fail(f"(exit statuses {[t.proc.returncode for t in tails]}) "
                        f"{what} did not happen within {timeout:.0f} s:\n" + "\n----\n".join(t.text()[-3000:] for t in tails))
        time.sleep(0.05)


@pytest.mark.timeout(500)  # 60-110 s at a load average of 2-12, 260 s at 25: mostly the processes' start
def test_h_link_cut_under_fault_tolerance_the_other_host_goes_on_and_the_restarted_host_heals_bitwise(cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # 6 epochs of 32 steps; alone, a group sleeps 1 s per step: up to ~3 minutes for host 1 to come
    # back on a loaded machine (80 s seen at a load average of 25); together, a step takes ~20 ms
    base = dict(FT_OUT=str(out), FT_EPOCHS="6", FT_ALONE_SLEEP="1.0", TORCHFT_TIMEOUT_SEC=str(TIMEOUT_S))

    def launch(group: int, attempt: int = 0) -> Tail:
        # --max_restarts 1, as the SLURM example: a join that fails (its transfer past TIMEOUT_S on a loaded
        # machine) ends the worker, and its agent starts it again to heal anew (host 0's never restarts: checked)
        common = [sys.executable, "-c", CONSOLE_SCRIPT, "launch", "--cpu", "--max_restarts", 1]
        if attempt == 0:  # machine `group` of a two-machine launch: its share of the groups (machine 0: the Lighthouse)
            return Tail(cluster.popen(group, common + ["--fault_tolerance", "on", "--num_machines", 2, "--machine_rank",
                                                       group, "--main_process_ip", cluster.hosts[0].addr,
                                                       "--main_process_port", PORT, "--num_processes", 2, FT_TRAIN],
                                      env=clean_env(**base)))
        # started again after its host's reboot as one job step of the SLURM example, told its group
        env = clean_env(**base, ANYACCEL_REPLICA_GROUPS="2", ANYACCEL_REPLICA_GROUP=str(group),
                        ANYACCEL_REPLICA_GROUP_RESTART=str(attempt))
        return Tail(cluster.popen(group, common + ["--fault_tolerance", f"{cluster.hosts[0].addr}:{PORT}",
                                                   "--num_processes", 1, FT_TRAIN], env=env))

    tails = [launch(0), launch(1)]
    _until("5 steps of both groups together",
           lambda: sum(r["participants"] == 2 for r in _steps(_records(out, 0)).values()) >= 5, 240, tails)
    cluster.link(1, up=False)
    cut = time.time()
    _until("2 steps of host 0 alone", lambda: len([r for r in _records(out, 0) if r["event"] == "step" and r["t"] > cut
                                                   and r["stepped"] and r["participants"] == 1]) >= 2, 30 + TIMEOUT_S, tails[:1])
    cluster.kill(1)  # host 1 is rebooted: every process of it dies, without a word to host 0
    tails[1].end(20)
    first_host1 = tails[1].text()
    cluster.link(1, up=True)
    back = time.time()
    tails[1] = launch(1, attempt=1)  # what the SLURM example's loop does for a lost job step
    outs = end_all(tails, 300, cluster)
    codes = [t.proc.returncode for t in tails]
    assert codes == [0, 0], f"exit statuses {codes}:\n" + "\n---- host 1 ----\n".join(o[-5000:] for o in outs)
    no_process_left(cluster, within=15)
    assert (f"fault tolerance: 2 replica groups of 1 process (1 on this machine: 0-0), torchft Lighthouse at "
            f"{cluster.hosts[0].addr}:{PORT} (started here)") in outs[0], outs[0][-3000:]
    assert (f"fault tolerance: 2 replica groups of 1 process (1 on this machine: 1-1), torchft Lighthouse at "
            f"{cluster.hosts[0].addr}:{PORT} (machine 0's)") in first_host1, first_host1[-3000:]

    _check_and_record(out, outs, cut, back)


def _check_and_record(out: Path, outs: list, cut: float, back: float) -> None:
    """What the records say after the run (module docstring); the FIGURE line and the figures row."""
    g0, g1 = _records(out, 0), _records(out, 1)
    # host 0: one process all along, never restarted; its next committed step within the bound
    assert [r["event"] for r in g0].count("start") == 1 and len({r["pid"] for r in g0}) == 1, g0[:2]
    assert "starting the workers again" not in outs[0], outs[0][-3000:]
    alone = [r for r in g0 if r["event"] == "step" and r["t"] > cut and r["stepped"] and r["participants"] == 1]
    commit_s = alone[0]["t"] - cut
    assert commit_s < COMMIT_BOUND_S, (commit_s, outs[0][-3000:])
    # host 1 after its restart: healed from host 0 in resume(), then bitwise host 0 at every step
    restart = [r for r in g1 if r["event"] == "start"][-1]
    assert restart["resumed"] and restart["resumed"].startswith("a live replica group"), restart
    heal = restart["heals"][-1]
    assert heal["bytes"] > 1_000 and heal["step"] == restart["committed"] > alone[0]["committed"], restart
    mine, theirs = _steps(g1, pid=restart["pid"]), _steps(g0)
    common = sorted(set(mine) & set(theirs))
    assert len(common) >= 10 and common[0] == restart["committed"] + 1, (common[:3], restart)
    for step in common:
        for key in ("sha", "lr", "rng", "epoch", "position", "participants"):
            assert mine[step][key] == theirs[step][key], (step, key, mine[step], theirs[step])
    ends = {r["group"]: r for r in g0 + g1 if r["event"] == "end"}
    assert ends[0]["sha"] == ends[1]["sha"] and ends[0]["committed"] == ends[1]["committed"], ends
    lost = ends[0]["uncommitted"]
    assert lost <= 2, ends[0]  # the step in flight at the cut (and at most one more, around the heal)
    healed_s = restart["t"] - back
    print(f"FIGURE h link cut, --fault_tolerance: host 0 committed its next step {commit_s:.1f} s after the cut "
          f"(bound {COMMIT_BOUND_S:g} s), no process of it restarted; host 1's launch, started again, healed "
          f"{healed_s:.1f} s later ({heal['bytes']:,} bytes in {heal['fetch_s']:.2f} s, {heal['total_s']:.2f} s with "
          f"the quorum); {lost} step(s) not committed; weights bitwise equal at every step after the heal")
    figures.record("h", "recovered", commit_s, f"{lost} (not committed, batch skipped; nothing redone)",
                   f"host 0's group committed its next step without host 1 {commit_s:.1f} s after the cut (TORCHFT_TIMEOUT_SEC "
                   f"{TIMEOUT_S}, heartbeat timeout {HEARTBEAT_S:g} s), no process of it restarted; host 1's launch, "
                   f"started again, healed from host 0 {healed_s:.1f} s later: {heal['bytes']:,} bytes in "
                   f"{heal['fetch_s']:.2f} s ({heal['total_s']:.2f} s with its quorum); weights bitwise equal afterwards",
                   extra={"kill_to_commit_s": round(commit_s, 2), "restart_to_heal_s": round(healed_s, 2),
                          "heal_bytes": heal["bytes"], "heal_fetch_s": round(heal["fetch_s"], 3),
                          "heal_total_s": round(heal["total_s"], 3), "uncommitted": lost, "restarts_of_others": 0})
