"""SLURM without a cluster: the processes `srun` would start, started here with the variables
srun sets (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_STEP_ID, SLURM_NODEID, ...). That is
all srun does for a task, so these are real SLURM-shaped jobs of 2 gloo ranks on one host."""

import json
import subprocess
import sys

import pytest


from conftest import free_port_in
from test_slurm import TRAIN, srun_env  # helpers shared with the unit tests
TIMEOUT = 180


def job_id_with_free_port():
    """A SLURM job id whose derived rendezvous port (15000 + id % 17000) is free right now (and
    below 32768, where Linux picks ephemeral ports, so no other test's socket takes it meanwhile)."""
    return free_port_in(15000, 31999, "127.0.0.1") - 15000


def run_tasks(commands_and_envs):
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for cmd, env in commands_and_envs]  # fmt: skip
    outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, "\n\n".join(f"TASK {i} (rc {q.returncode}):\n{e}" for i, (q, (_, e)) in enumerate(zip(procs, outs)))
    return procs, outs


def ranks(out):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_srun_python_script_forms_the_group_with_no_code_change(tmp_path):
    job = job_id_with_free_port()
    tasks = [([sys.executable, TRAIN, "--out", str(tmp_path), "--epochs", "1"],
              srun_env(job, procid=r, ntasks=2, nnodes=1, nodeid=0, localid=r, nodelist="localhost"))
             for r in (0, 1)]  # fmt: skip
    run_tasks(tasks)
    r0, r1 = ranks(tmp_path)
    assert (r0["source"], r0["world"], r1["rank"]) == ("slurm", 2, 1)
    assert not set(r0["seen"]) & set(r1["seen"]) and sorted(r0["seen"] + r1["seen"]) == list(range(64))
    assert sorted(r0["gathered"]) == list(range(37))


@pytest.mark.slow
def test_srun_anyaccel_launch_with_tasks_per_node_does_not_spawn_twice(tmp_path):
    job = job_id_with_free_port()
    tasks = [([sys.executable, "-m", "anyaccel.cli", "launch", "--cpu", TRAIN, "--out", str(tmp_path), "--epochs", "1"],
              srun_env(job, procid=r, ntasks=2, nnodes=1, nodeid=0, localid=r, nodelist="localhost"))
             for r in (0, 1)]  # fmt: skip
    procs, _ = run_tasks(tasks)
    r0, r1 = ranks(tmp_path)
    assert r0["world"] == r1["world"] == 2 and r0["source"] == "slurm"
    assert [r0["pid"], r1["pid"]] == [p.pid for p in procs], "each srun task is itself the worker"
    assert r0["env"]["ANYACCEL_USE_CPU"] == "1"


@pytest.mark.slow
def test_srun_anyaccel_launch_with_one_task_per_node_is_the_node_agent(tmp_path):
    job = job_id_with_free_port()
    tasks = [([sys.executable, "-m", "anyaccel.cli", "launch", "--cpu", "--num_processes", "2", TRAIN,
               "--out", str(tmp_path), "--epochs", "1"],
              srun_env(job, procid=n, ntasks=2, nnodes=2, nodeid=n, localid=0, nodelist="localhost,localhost"))
             for n in (0, 1)]  # fmt: skip
    procs, outs = run_tasks(tasks)
    r0, r1 = ranks(tmp_path)
    assert (r0["world"], r0["node_rank"], r1["node_rank"], r0["source"]) == (2, 0, 1, "torchrun")
    assert [r0["ppid"], r1["ppid"]] == [p.pid for p in procs], "each node's task started its node's worker"
    assert not set(r0["seen"]) & set(r1["seen"])
