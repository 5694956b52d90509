"""Per-step fault tolerance with real processes: ``anyaccel launch --fault_tolerance on`` with 2
replica groups of 1 process (tests/scripts/ft_train.py), one of them SIGKILLed mid-epoch.

One launched job carries every check (a launch and a restart cost seconds each on a loaded
2-core box): the survivor commits its next step within a bound and is never restarted; the killed
group is restarted by its own agent, heals from the survivor in ``resume()`` and from then on has
bitwise the survivor's weights, learning rate, RNG state and loader position at every step. The
seconds measured are written to ``FT_FIGURES`` when set (``python -m benchmarks`` reads them)."""

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


def _records(out: Path, group: int) -> list:
    path = out / f"group_{group}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _steps(records: list, pid=None) -> dict:
    return {r["committed"]: r for r in records if r["event"] == "step" and (pid is None or r["pid"] == pid)}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_replica_group_leaves_the_other_training_then_heals_from_it_and_matches_it_bitwise(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env = clean_env(FT_OUT=str(out))
    launcher = subprocess.Popen(
        [sys.executable, "-c", CONSOLE_SCRIPT, "launch", "--cpu", "--fault_tolerance", "on", "--num_processes", "2",
         "--max_restarts", "1", str(SCRIPTS / "ft_train.py")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:  # mid-epoch 0: a few steps that both groups took together
            together = [r for r in _steps(_records(out, 1)).values() if r["participants"] == 2]
            if len(together) >= 5:
                break
            assert launcher.poll() is None, launcher.stdout.read()
            assert time.monotonic() < deadline, "the two replica groups never trained together"
            time.sleep(0.05)
        victim = together[-1]["pid"]
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        output, _ = launcher.communicate(timeout=420)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, output[-6000:]
    assert "replica group 1: worker rank 0 was killed by SIGKILL; starting the workers again (restart 1 of 1)" in output
    assert "replica groups: group 0 finished; group 1 finished" in output, output[-3000:]

    g0, g1 = _records(out, 0), _records(out, 1)
    # the survivor: one process all along, its next committed step within the bound, training on alone
    assert [r["event"] for r in g0].count("start") == 1 and len({r["pid"] for r in g0}) == 1
    # (a step whose all-reduce finished before the kill may still commit after it: count from the
    # first step taken without the dead group)
    alone = [r for r in g0 if r["event"] == "step" and r["t"] > killed_at and r["stepped"] and r["participants"] == 1]
    assert alone, "the survivor never trained alone"
    commit_s = alone[0]["t"] - killed_at
    assert commit_s < COMMIT_BOUND_S, (commit_s, output[-3000:])
    # the killed group: restarted once, healed from the survivor in resume()
    starts = [r for r in g1 if r["event"] == "start"]
    assert len(starts) == 2 and starts[1]["pid"] != victim
    restart = starts[1]
    assert restart["resumed"] and restart["resumed"].startswith("a live replica group"), restart
    (heal,) = restart["heals"]
    assert heal["bytes"] > 10_000 and heal["step"] == restart["committed"] > 0
    # from the heal on: bitwise the survivor's weights, learning rate, RNG and loader position
    mine, theirs = _steps(g1, pid=restart["pid"]), _steps(g0)
    common = sorted(set(mine) & set(theirs))
    assert len(common) >= 20 and common[0] == restart["committed"] + 1, (common[:3], restart)
    for step in common:
        for key in ("sha", "lr", "rng", "epoch", "position", "participants"):
            assert mine[step][key] == theirs[step][key], (step, key, mine[step], theirs[step])
    ends = {r["group"]: r for r in g0 + g1 if r["event"] == "end"}
    assert ends[0]["sha"] == ends[1]["sha"] and ends[0]["committed"] == ends[1]["committed"]
    assert ends[0]["uncommitted"] <= 1  # at most the step in flight when the peer died
    if os.environ.get("FT_FIGURES"):
        Path(os.environ["FT_FIGURES"]).write_text(json.dumps({
            "kill_to_commit_s": commit_s, "heal_bytes": heal["bytes"], "heal_fetch_s": heal["fetch_s"],
            "heal_total_s": heal["total_s"], "restart_to_heal_s": restart["t"] - killed_at}))
