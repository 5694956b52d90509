"""The single-process tests; the multi-process ones (real launches, marked slow) are in tests/environment/test_slurm_multiprocess.py.

SLURM without a cluster: the processes `srun` would start, started here with the variables
srun sets (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_STEP_ID, SLURM_NODEID, ...). That is
all srun does for a task, so these are real SLURM-shaped jobs of 2 gloo ranks on one host."""



from anyaccel import cli

from conftest import SCRIPTS, clean_env

TRAIN = str(SCRIPTS / "launch_train.py")


def srun_env(job_id, procid, ntasks, nnodes, nodeid, localid, nodelist, **extra):
    per_node = ntasks // nnodes
    env = {
        "SLURM_JOB_ID": str(job_id), "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid), "SLURM_NTASKS": str(ntasks),
        "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_NNODES": str(nnodes), "SLURM_STEP_NUM_NODES": str(nnodes),
        "SLURM_NODELIST": nodelist, "SLURM_STEP_NODELIST": nodelist, "SLURM_JOB_NODELIST": nodelist,
        "SLURM_TASKS_PER_NODE": f"{per_node}(x{nnodes})", "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nnodes})",
    }  # fmt: skip
    return clean_env(**env, **extra)


def test_mismatched_process_count_inside_srun_is_an_error_not_a_hang(monkeypatch, capsys):
    for key, value in srun_env(4242, procid=0, ntasks=2, nnodes=1, nodeid=0, localid=0, nodelist="n1").items():
        if key.startswith("SLURM_"):
            monkeypatch.setenv(key, value)
    assert cli.main(["launch", "--num_processes", "4", TRAIN, "--out", "x"]) == 2
    err = capsys.readouterr().err
    assert "srun started 2 tasks" in err and "Traceback" not in err


def test_batch_script_without_srun_asking_for_machines_is_an_error(monkeypatch, capsys):
    for key in ("SLURM_STEP_ID", "SLURM_STEPID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_NODELIST", "n[1-2]")
    code = cli.main(["launch", "--num_machines", "2", "--main_process_ip", "n1", TRAIN])
    err = capsys.readouterr().err
    assert code == 2 and "not by srun" in err and "srun --ntasks-per-node=1 anyaccel launch" in err
