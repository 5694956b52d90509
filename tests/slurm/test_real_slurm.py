"""anyaccel under a real SLURM (one node, started by ``scripts/slurm_cluster.sh``; ``make test-slurm``).

Jobs are submitted with the real ``srun``/``sbatch`` of that cluster, which set every SLURM_*
variable themselves: no launcher (``srun -n 2 python``), ``anyaccel launch`` as the one task of the
node and as every task, the example batch script, and a batch script that forgets ``srun``.
Skipped when no cluster answers (``SLURM_CONF`` unset or ``sinfo`` failing); what one node cannot
show (several nodes) is covered by tests/environment/test_slurm_multiprocess.py with the variables srun sets.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CONSOLE_SCRIPT, ROOT, SCRIPTS, clean_env

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
TRAIN = str(SCRIPTS / "launch_train.py")
CONF = os.environ.get("SLURM_CONF") or "/var/tmp/anyaccel-slurm/slurm.conf"


def _cluster_up() -> str:
    if shutil.which("srun") is None:
        return "srun is not installed (make test-slurm installs and starts a one-node cluster)"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10,
                             env=dict(os.environ, SLURM_CONF=CONF))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"sinfo failed: {exc}"
    if out.returncode != 0 or not out.stdout.strip():
        return f"no SLURM cluster answers at {CONF} (start one with scripts/slurm_cluster.sh start)"
    return ""


@pytest.fixture(autouse=True, scope="module")
def _slurm_cluster():
    """Skip the module's tests where no cluster answers; asked when one of them runs, not at
    collection (``sinfo`` waits up to 10 s for an absent cluster, and ``make test`` collects this
    file to deselect it)."""
    why = _cluster_up()
    if why:
        pytest.skip(why)


def env(**extra) -> dict:
    """The test's environment without launcher/SLURM variables, plus this cluster and the venv."""
    out = clean_env(SLURM_CONF=CONF, **extra)
    out["PATH"] = os.path.dirname(sys.executable) + os.pathsep + out.get("PATH", "")
    return out


def run(cmd, cwd=ROOT, timeout=240, **extra) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env(**extra))
    return proc


_ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
          "PREEMPTED")


def sbatch_wait(args, timeout: float) -> subprocess.CompletedProcess:
    """`sbatch --wait ARGS`, asking every 0.2 s: sbatch's own --wait asks slurmctld every 2 s and
    more (32 s at most), seconds of a test's time per job. The job's exit code as the return code
    (sbatch's), ``scontrol show job`` as stdout (where JobState and ExitCode say why)."""
    import time

    sub = run(["sbatch", "--parsable", *args])
    if sub.returncode != 0:
        return sub
    job = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    while True:
        show = run(["scontrol", "show", "job", "-o", job]).stdout
        state = re.search(r"\bJobState=(\S+)", show)
        if state and state.group(1) in _ENDED:
            code = re.search(r"\bExitCode=(\d+):(\d+)", show)
            status = 0 if state.group(1) == "COMPLETED" else int(code.group(1)) if code and code.group(1) != "0" else 1
            return subprocess.CompletedProcess(sub.args, status, show, sub.stderr)
        if time.monotonic() > deadline:
            run(["scancel", job])
            raise subprocess.TimeoutExpired(sub.args, timeout, output=show)
        time.sleep(0.2)


def ranks(out: Path, n: int):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def test_srun_without_a_launcher(tmp_path):
    """`srun -n 2 python train.py`: two ranks from SLURM's own variables, a real gloo group,
    disjoint shards, every sample gathered once."""
    proc = run(["srun", "-n", "2", "--kill-on-bad-exit=1", sys.executable, TRAIN, "--out", tmp_path, "--epochs", "1"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r0, r1 = ranks(tmp_path, 2)
    assert (r0["rank"], r1["rank"], r0["world"]) == (0, 1, 2)
    assert not set(r0["seen"]) & set(r1["seen"])
    assert sorted(r0["gathered"]) == list(range(37))


def test_srun_one_task_running_anyaccel_launch(tmp_path):
    """One task per node: the task is the node's agent and starts the 2 processes."""
    proc = run(["srun", "-n", "1", "anyaccel", "launch", "--num_processes", "2", "--cpu", TRAIN, "--out", tmp_path,
                "--epochs", "1"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r0, r1 = ranks(tmp_path, 2)
    assert r0["world"] == r1["world"] == 2 and not set(r0["seen"]) & set(r1["seen"])


def test_srun_every_task_running_anyaccel_launch_spawns_nothing_twice(tmp_path):
    """Several tasks per node: every task *is* a worker; 2 tasks give exactly 2 ranks."""
    proc = run(["srun", "-n", "2", "anyaccel", "launch", "--cpu", TRAIN, "--out", tmp_path, "--epochs", "1"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r0, r1 = ranks(tmp_path, 2)
    assert r0["world"] == 2 and sorted(p.name for p in tmp_path.glob("rank*.json")) == ["rank0.json", "rank1.json"]


def test_the_example_batch_script(tmp_path):
    """`sbatch examples/slurm/one_node.sbatch`, with the GPU request turned off on this CPU node and
    a shorter run (extra flags after the script reach the training script): one epoch of 128 images,
    one step of batch 64 per rank."""
    log = tmp_path / "job.out"
    proc = sbatch_wait(["--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0", f"--output={log}",
                        ROOT / "examples" / "slurm" / "one_node.sbatch", "--epochs", "1", "--limit", "128",
                        "--output_dir", tmp_path / "ckpt"], timeout=300)
    text = log.read_text() if log.exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + text
    assert "launched by slurm: 2 process(es) on 1 node(s)" in text, text
    assert "epoch 0:" in text and (tmp_path / "ckpt" / "epoch_0.pt").exists()


def test_a_batch_script_without_srun_runs_one_process_and_says_why(tmp_path):
    script = tmp_path / "no_srun.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --ntasks=2\n{sys.executable} {TRAIN} --out {tmp_path} --epochs 1\n")
    log = tmp_path / "job.out"
    proc = sbatch_wait([f"--output={log}", script], timeout=180)
    text = log.read_text()
    assert proc.returncode == 0, proc.stderr + text
    (r0,) = ranks(tmp_path, 1)
    assert r0["world"] == 1 and not (tmp_path / "rank1.json").exists()
    assert "SLURM allocated 2 tasks but this process was started by the batch script" in text


PREEMPT = str(SCRIPTS / "train_preempt.py")


def test_scancel_usr1_checkpoints_requeues_and_the_requeued_job_resumes_to_the_same_weights(tmp_path):
    """`sbatch --requeue` a 2-task srun job; `scancel --signal=USR1` mid-training: both ranks save
    at the same step, rank 0 runs `scontrol requeue`, SLURM starts the job again, and
    `accelerator.resume()` continues to bitwise the weights of an uninterrupted 2-process run.
    That run is `anyaccel launch`ed beside the job, outside SLURM: the job sleeps between steps,
    and SLURM would run a second 2-task job on this node's 2 CPUs only after it (ranks train the
    same under srun and the launcher: tests/cluster compares them bitwise)."""
    import time

    import torch

    full = subprocess.Popen([sys.executable, "-c", CONSOLE_SCRIPT, "launch", "--cpu", "--num_processes", "2", PREEMPT,
                             "--project", str(tmp_path / "full"), "--out", str(tmp_path / "full.pt")], cwd=ROOT,
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log, marker, weights = tmp_path / "job.out", tmp_path / "m", tmp_path / "w.pt"
    script = tmp_path / "preempt.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --cpus-per-task=1\n#SBATCH --requeue\n#SBATCH --open-mode=append\n"
        f"srun {sys.executable} {PREEMPT} --project {tmp_path / 'p'} --out {weights} --sleep 0.3 --marker {marker}\n")
    sub = run(["sbatch", "--parsable", f"--output={log}", script])
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 180
        while not marker.exists():
            assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
            time.sleep(0.2)
        sig = run(["scancel", "--signal=USR1", job])
        assert sig.returncode == 0, sig.stderr
        deadline = time.monotonic() + 300
        released = False
        while not weights.exists():
            assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
            if not released:
                # SLURM holds a requeued job ~2 minutes (Reason=BeginTime): its own policy, not what is
                # tested here; start it now (what an admin's `scontrol update` does)
                show = run(["scontrol", "show", "job", job])
                if "JobState=PENDING" in show.stdout and "Reason=BeginTime" in show.stdout:
                    released = run(["scontrol", "update", f"JobId={job}", "StartTime=now"]).returncode == 0
            time.sleep(0.5)
        time.sleep(1)
    finally:
        run(["scancel", job])
        if full.poll() is None and not weights.exists():  # the test failed before it waited for it
            full.kill()
    text = log.read_text()
    assert "SIGUSR1: every rank saved" in text and "requeued" in text, text
    assert full.wait(timeout=240) == 0, full.communicate()[0][-3000:]
    assert "resumed at epoch 0 step 0 from None" in text and "from " + str(tmp_path / "p" / "checkpoints") in text
    a, b = torch.load(tmp_path / "full.pt"), torch.load(weights)
    assert all(torch.equal(a[k], b[k]) for k in a)
