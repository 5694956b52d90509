"""anyaccel under a real SLURM of two nodes: one slurmd per host of the two-host cluster
(``scripts/cluster.sh slurm start``; ``make test-cluster``).

Jobs are submitted from host 0 with the real ``srun``/``sbatch``, which place tasks on both hosts
and set every SLURM_* variable themselves: no launcher, the ranks and the main address come from
SLURM (the node list names host 0; its address comes from the hosts' /etc/hosts).
"""

from __future__ import annotations

import re
import sys
import time

import pytest
import torch

from .harness import SCRIPTS, wait_all

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
PREEMPT = SCRIPTS / "train_preempt.py"


def _finished(slurm, procs, timeout):
    outs = wait_all(procs, timeout=timeout)  # not cluster=: that would kill the daemons
    for proc, out in zip(procs, outs):
        assert proc.returncode == 0, out[-4000:]
    return outs


def test_srun_four_tasks_on_two_nodes_train_like_one_process(slurm, tmp_path):
    """`srun -N2 -n4 python script.py` (2 tasks per host, batch 2 each) ends with the weights one
    process reaches with batch 8: SLURM's variables gave 4 ranks of one job over both hosts."""
    where = "echo task $SLURM_PROCID of $SLURM_NTASKS on $(hostname); exec \"$@\""
    four = slurm.popen(["srun", "-N2", "-n4", "--kill-on-bad-exit=1", "sh", "-c", where, "-", sys.executable,
                        SCRIPTS / "ddp_equivalence.py", tmp_path / "four.pt", 2])
    one = slurm.cluster.popen(0, [sys.executable, SCRIPTS / "ddp_equivalence.py", tmp_path / "one.pt", 8])
    out = _finished(slurm, [four, one], timeout=240)[0]
    placed = sorted(re.findall(r"task (\d) of 4 on (\S+)", out))
    host0, host1 = (h.name for h in slurm.cluster.hosts)
    assert placed == [("0", host0), ("1", host0), ("2", host1), ("3", host1)], out[-3000:]
    four_w, one_w = torch.load(tmp_path / "four.pt"), torch.load(tmp_path / "one.pt")
    assert four_w.keys() == one_w.keys()
    for key in one_w:
        torch.testing.assert_close(four_w[key], one_w[key], rtol=0, atol=1e-5)


def test_srun_one_task_per_node_running_anyaccel_launch(slurm, tmp_path):
    """`srun -N2 --ntasks-per-node=1 anyaccel launch`: each task is its node's launcher (machine
    rank from SLURM_NODEID, main address the node list's first host); one worker per host, one
    job: disjoint shards, every sample gathered once."""
    import json

    proc = slurm.popen(["srun", "-N2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "anyaccel", "launch", "--cpu",
                        "--num_processes", 2, SCRIPTS / "launch_train.py", "--out", tmp_path, "--epochs", 1])
    out = _finished(slurm, [proc], timeout=240)[0]
    host0 = slurm.cluster.hosts[0].name
    assert f"machine 0 of 2, main {host0}:" in out and f"machine 1 of 2, main {host0}:" in out, out[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (r0["world"], r0["node_rank"], r1["node_rank"], r1["master_addr"]) == (2, 0, 1, host0)
    assert not set(r0["seen"]) & set(r1["seen"]) and sorted(r0["gathered"]) == list(range(37))


def test_the_hang_doctor_names_the_stuck_rank_and_its_host(slurm):
    """hang_timeout=3 under `srun -N2 -n2`: rank 0 (host 0) waits in reduce while rank 1 (host 1)
    sleeps; rank 0's report names rank 1, its host, and the line it is on."""
    hang = slurm.popen(["srun", "-N2", "-n2", "--kill-on-bad-exit=1", sys.executable, SCRIPTS / "doctor_checks.py",
                        "hang"])
    out = wait_all([hang], timeout=180)[0]
    assert hang.returncode != 0, out[-4000:]
    host0, host1 = (h.name for h in slurm.cluster.hosts)
    assert f"rank 0 ({host0}, pid" in out and f"rank 1 ({host1}, pid" in out, out[-4000:]
    assert "verdict: rank 1 has not reached reduce" in out and "rank 1 is in `time.sleep(25)`" in out, out[-4000:]


def _wait_for(path, log, what, timeout):
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {timeout} s; job log:\n" + (log.read_text()[-4000:] if log.exists() else "(none)"))
        time.sleep(0.3)
    return time.monotonic()


def _release_when_held(slurm, job, weights, timeout=120):
    """SLURM holds a requeued job (Reason=BeginTime, cred_expire): its own policy, not what is
    tested here. Start it at once when it is held (what an admin's `scontrol update` does)."""
    deadline = time.monotonic() + timeout
    while not weights.exists() and time.monotonic() < deadline:
        show = slurm.run(["scontrol", "show", "job", job]).stdout
        if "JobState=PENDING" in show and "Reason=BeginTime" in show:
            slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
            return
        if "Restarts=1" in show and "JobState=RUNNING" in show:
            return  # started again without a hold (between the request and the hold it is COMPLETING)
        time.sleep(0.3)


def test_sbatch_requeue_usr1_checkpoints_every_rank_requeues_and_resumes_bitwise(slurm, tmp_path, preempt_reference):
    """`sbatch -N2 --requeue` a one-task-per-node training job; `scancel --signal=USR1` mid-run:
    both ranks (one per host) save at the same step and exit 75, rank 0 requeues the job, SLURM
    starts it again on both hosts, and `accelerator.resume()` ends bitwise at the weights of an
    uninterrupted run (the session's reference, conftest.py; the srun tests above show srun's
    ranks train like a launcher's)."""
    log, marker, weights = tmp_path / "job.out", tmp_path / "marker", tmp_path / "w.pt"
    script = tmp_path / "preempt.sbatch"
    script.write_text("#!/bin/bash\n"
                      f"srun --kill-on-bad-exit=1 {sys.executable} {PREEMPT} --project {tmp_path / 'p'} --out {weights}"
                      f" --sleep 0.3 --marker {marker}\n")
    sub = slurm.run(["sbatch", "-N2", "--ntasks-per-node=1", "--requeue", "--open-mode=append", "--parsable",
                     f"--output={log}", script])
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job = sub.stdout.strip().split(";")[0]
    _wait_for(marker, log, "marker step (training did not start)", 180)
    shown = slurm.run(["scontrol", "show", "job", job]).stdout
    assert "NumNodes=2" in shown and re.search(r"\bNodeList=\S+\[0-1\]", shown), shown
    signalled = time.monotonic()
    sig = slurm.run(["scancel", "--signal=USR1", job])
    assert sig.returncode == 0, sig.stdout + sig.stderr
    _release_when_held(slurm, job, weights)
    done = _wait_for(weights, log, "final weights (the requeued job did not finish)", 300)
    time.sleep(1)
    text = log.read_text()
    assert "SIGUSR1: every rank saved" in text and f"SLURM job {job} requeued" in text, text[-4000:]
    for host in slurm.cluster.hosts:  # anyaccel's preempted exit code, as srun reports it
        assert re.search(rf"{host.name}: task \d: Exited with exit code 75", text), text[-4000:]
    resumed = set(re.findall(r"rank (\d) resumed at epoch (\d+) step (\d+) from (\S+)", text))
    checkpoints = {r for r in resumed if r[3] != "None"}
    assert {r[0] for r in checkpoints} == {"0", "1"}, text[-4000:]
    assert len({r[1:] for r in checkpoints}) == 1, checkpoints  # the same step and checkpoint on both ranks
    assert checkpoints.pop()[3].startswith(str(tmp_path / "p" / "checkpoints")), text[-4000:]
    assert "Restarts=1" in slurm.run(["scontrol", "show", "job", job]).stdout
    a, b = torch.load(preempt_reference), torch.load(weights)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"FIGURE slurm requeue: USR1 to resumed-and-finished {done - signalled:.1f} s (two nodes, requeue included)")
