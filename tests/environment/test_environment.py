"""Environment resolution: launcher variables in, one immutable Environment out.

This is the one place where faked environment variables are right: resolution is a pure function
of the mapping it is given.
"""

import dataclasses

import pytest

from anyaccel.environment import DistributedType, resolve_environment
from anyaccel.errors import JobEnvironmentError
from anyaccel.slurm import expand_nodelist, slurm_port_from_job_id


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    import anyaccel.devices as devices

    monkeypatch.setattr(devices, "cuda_device_count", lambda: 0)
    monkeypatch.setattr(devices, "mps_available", lambda: False)


def test_single_process_default():
    env = resolve_environment({})
    assert (env.world_size, env.rank, env.local_rank, env.source) == (1, 0, 0, "single")
    assert env.device == "cpu" and env.backend is None
    assert env.distributed_type is DistributedType.NO


def test_environment_is_immutable():
    env = resolve_environment({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.rank = 3


def test_torchrun_variables():
    env = resolve_environment({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                               "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29511"})
    assert (env.world_size, env.rank, env.local_rank, env.local_world_size) == (4, 3, 1, 2)
    assert (env.node_rank, env.num_nodes) == (1, 2)
    assert (env.main_address, env.main_port) == ("10.0.0.1", 29511)
    assert env.source == "torchrun"


def test_cpu_world_two_is_a_real_gloo_group():
    env = resolve_environment({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_PORT": "1234"})
    assert env.backend == "gloo" and env.device == "cpu"
    assert env.distributed_type is DistributedType.MULTI_CPU


def test_cuda_device_from_local_rank(monkeypatch):
    import anyaccel.devices as devices

    monkeypatch.setattr(devices, "cuda_device_count", lambda: 4)
    env = resolve_environment({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"})
    assert env.device == "cuda:1" and env.backend == "nccl"
    assert env.distributed_type is DistributedType.MULTI_GPU


def test_gpus_shared_by_several_ranks_use_gloo(monkeypatch):
    import anyaccel.devices as devices

    monkeypatch.setattr(devices, "cuda_device_count", lambda: 1)
    env = resolve_environment({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert env.device == "cuda:0" and env.backend == "gloo"
    assert any("share" in w for w in env.warnings)


def test_cpu_flag_and_variable_force_cpu(monkeypatch):
    import anyaccel.devices as devices

    monkeypatch.setattr(devices, "cuda_device_count", lambda: 2)
    assert resolve_environment({}, cpu=True).device == "cpu"
    assert resolve_environment({"ANYACCEL_USE_CPU": "1"}).device == "cpu"
    assert resolve_environment({}).device == "cuda:0"


@pytest.mark.parametrize("nodelist,expected", [
    ("node1", ["node1"]),
    ("gpu[07-08,11]", ["gpu07", "gpu08", "gpu11"]),
    ("a[1-2],b,c[3]", ["a1", "a2", "b", "c3"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("n[009-011]", ["n009", "n010", "n011"]),
])
def test_expand_nodelist(nodelist, expected):
    assert expand_nodelist(nodelist) == expected


@pytest.mark.parametrize("bad", ["gpu[07-08", "gpu07]", "gpu[9-7]", "gpu[a-b]"])
def test_malformed_nodelist_is_a_clear_error(bad):
    with pytest.raises(JobEnvironmentError, match="SLURM_NODELIST"):
        expand_nodelist(bad)


SRUN = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
        "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}


def test_srun_variables():
    env = resolve_environment(SRUN)
    assert env.source == "slurm"
    assert (env.world_size, env.rank, env.local_rank, env.local_world_size) == (4, 3, 1, 2)
    assert (env.node_rank, env.num_nodes) == (1, 2)
    assert env.main_address == "gpu07"
    assert env.main_port == slurm_port_from_job_id(4242)


def test_slurm_port_is_per_job_and_overridable():
    assert slurm_port_from_job_id(1) != slurm_port_from_job_id(2)
    assert resolve_environment({**SRUN, "MASTER_PORT": "12345"}).main_port == 12345
    assert resolve_environment({**SRUN, "MASTER_ADDR": "head"}).main_address == "head"


def test_sbatch_without_srun_runs_one_process_with_a_warning():
    env = resolve_environment({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_NNODES": "1"})
    assert env.world_size == 1
    assert any("srun" in w for w in env.warnings)


def test_slurm_can_be_disabled():
    assert resolve_environment({**SRUN, "ANYACCEL_DISABLE_SLURM": "1"}).world_size == 1


@pytest.mark.parametrize("gpu_vars", [{"SLURM_STEP_GPUS": "4,5"}, {"SLURM_STEP_GPUS": "0-1"},
                                      {"SLURM_GPUS_ON_NODE": "2"}])
def test_srun_with_a_gpu_bound_to_each_task_uses_nccl(monkeypatch, gpu_vars):
    # `srun --gpus-per-task=1`: each task sees only its own GPU, so 2 tasks on a node see 1 GPU each
    import anyaccel.devices as devices

    monkeypatch.setattr(devices, "cuda_device_count", lambda: 1)
    env = resolve_environment({**SRUN, **gpu_vars})
    assert env.device == "cuda:0" and env.backend == "nccl"
    assert not any("share" in w for w in env.warnings)
    assert not hasattr(env, "gpus_on_node")


def test_srun_tasks_sharing_the_steps_only_gpu_use_gloo_and_say_how_to_override(monkeypatch):
    import anyaccel.devices as devices

    monkeypatch.setattr(devices, "cuda_device_count", lambda: 1)
    env = resolve_environment({**SRUN, "SLURM_STEP_GPUS": "0"})
    assert env.backend == "gloo"
    assert any("share 1 visible GPU" in w and "ANYACCEL_BACKEND=nccl" in w for w in env.warnings)


def test_forcing_nccl_drops_the_shared_gpu_fallback_and_its_warning(monkeypatch):
    import anyaccel.devices as devices

    monkeypatch.setattr(devices, "cuda_device_count", lambda: 1)
    env = resolve_environment({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                               "ANYACCEL_BACKEND": "nccl"})
    assert env.device == "cuda:0" and env.backend == "nccl"
    assert not any("share" in w for w in env.warnings)


def test_torchrun_wins_over_slurm():
    env = resolve_environment({**SRUN, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert env.source == "torchrun" and env.world_size == 2


def test_open_mpi_variables():
    env = resolve_environment({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
                               "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (env.source, env.world_size, env.rank, env.local_rank) == ("mpi", 2, 1, 1)
    assert env.main_address == "127.0.0.1" and env.main_port == 29500


def test_pmi_variables():
    env = resolve_environment({"PMI_SIZE": "4", "PMI_RANK": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
                               "MASTER_ADDR": "h0"})
    assert (env.source, env.world_size, env.rank, env.local_rank, env.node_rank) == ("mpi", 4, 2, 0, 1)


def test_pmi_local_rank_without_mpich_variables():
    env = resolve_environment({"PMI_SIZE": "2", "PMI_RANK": "1", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "2"})
    assert (env.source, env.world_size, env.rank, env.local_rank, env.node_rank) == ("mpi", 2, 1, 1, 0)


def test_multi_node_mpi_without_master_addr_is_an_error():
    with pytest.raises(JobEnvironmentError, match="MASTER_ADDR"):
        resolve_environment({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0",
                             "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})


@pytest.mark.parametrize("env,match", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, "rank 2"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "world size 0"),
    ({"RANK": "0", "WORLD_SIZE": ""}, "WORLD_SIZE is empty"),  # was a TypeError from int | None arithmetic
    ({"RANK": "", "WORLD_SIZE": "2"}, "RANK is empty"),
    ({"PMI_SIZE": "", "PMI_RANK": "0"}, "PMI_SIZE is empty"),
])
def test_inconsistent_variables_are_named(env, match):
    with pytest.raises(JobEnvironmentError, match=match):
        resolve_environment(env)


def test_detection_does_not_initialise_cuda():
    import torch

    resolve_environment()
    assert not torch.cuda.is_initialized()


def test_kubernetes_style_variables_one_process_per_pod(monkeypatch):
    # a training operator sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: one process per pod, one GPU each
    import anyaccel.devices as devices

    monkeypatch.setattr(devices, "cuda_device_count", lambda: 1)
    env = resolve_environment({"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"})
    assert (env.local_rank, env.local_world_size, env.node_rank, env.num_nodes) == (0, 1, 3, 4)
    assert env.device == "cuda:0" and env.backend == "nccl" and not env.warnings
    env = resolve_environment({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "NODE_RANK": "1", "NNODES": "2",
                               "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (env.local_rank, env.local_world_size, env.node_rank, env.num_nodes) == (1, 4, 1, 2)


def test_a_node_rank_without_the_local_size_does_not_make_gpus_look_shared(monkeypatch):
    # 2 machines x 4 GPUs, LOCAL_RANK and NODE_RANK set, LOCAL_WORLD_SIZE and NNODES not
    import anyaccel.devices as devices

    monkeypatch.setattr(devices, "cuda_device_count", lambda: 4)
    env = resolve_environment({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "NODE_RANK": "1",
                               "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert env.device == "cuda:1" and env.backend == "nccl"
    assert env.node_rank == 1 and env.num_nodes >= 2
    # one machine, LOCAL_RANK only (no node rank): as before, 8 ranks share 4 GPUs through gloo
    env = resolve_environment({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "5", "MASTER_PORT": "1"})
    assert env.backend == "gloo" and env.local_world_size == 8


def test_rank_and_world_size_alone_on_one_machine_give_each_rank_its_own_gpu(monkeypatch):
    # e.g. a batch script that exports RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS MASTER_ADDR=127.0.0.1
    import anyaccel.devices as devices

    monkeypatch.setattr(devices, "cuda_device_count", lambda: 2)
    for rank in (0, 1):
        env = resolve_environment({"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": "1", "SLURM_PROCID": str(rank), "SLURM_JOB_ID": "7"})
        assert (env.local_rank, env.local_world_size, env.num_nodes) == (rank, 2, 1)
        assert env.device == f"cuda:{rank}" and env.backend == "nccl"
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 1)  # 2 ranks, 1 GPU: shared, as before
    env = resolve_environment({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "1"})
    assert env.backend == "gloo" and any("share" in w for w in env.warnings)


def test_machine_counts_without_local_sizes_are_read_the_same_on_every_machine():
    base = {"MASTER_ADDR": "node0", "MASTER_PORT": "1"}
    env = resolve_environment({**base, "RANK": "3", "WORLD_SIZE": "4", "NNODES": "2"})  # ranks in blocks per machine
    assert (env.local_rank, env.local_world_size, env.node_rank, env.num_nodes) == (1, 2, 1, 2)
    env = resolve_environment({**base, "RANK": "2", "WORLD_SIZE": "3", "NNODES": "2"})  # 2 + 1: no error
    assert (env.local_world_size, env.node_rank, env.num_nodes) == (2, 1, 2)
    counts = {resolve_environment({**base, "RANK": str(r), "WORLD_SIZE": "8", "LOCAL_RANK": str(r % 4),
                                   "NODE_RANK": str(r // 4)}).num_nodes for r in (0, 5)}
    assert counts == {2}  # node 0 and node 1 agree that there are several machines
