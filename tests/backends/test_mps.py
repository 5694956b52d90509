"""Apple MPS device selection (environment detection unit).

No Apple GPU exists on this machine, so device *availability* is monkeypatched; everything else is
the real :func:`anyaccel.environment.resolve_environment`. The rules a Mac user relies on:

* one process, no CUDA, MPS available → ``mps`` (no process group, no backend);
* several processes → CPU with the gloo backend and a warning saying why (MPS has no
  multi-process communication backend);
* ``cpu=True`` / ``ANYACCEL_USE_CPU=1`` → CPU even though MPS is there;
* CUDA, when present, wins over MPS (never both on one machine, but the order must be fixed).
"""

import pytest

from anyaccel.environment import DistributedType, resolve_environment

TWO_PROCS = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.fixture
def apple(monkeypatch):
    """A Mac: MPS available, no CUDA."""
    import anyaccel.devices as devices

    monkeypatch.setattr(devices, "cuda_device_count", lambda: 0)
    monkeypatch.setattr(devices, "mps_available", lambda: True)


def test_single_process_uses_mps(apple):
    env = resolve_environment({})
    assert env.device_type == "mps" and env.device == "mps"
    assert env.backend is None and env.world_size == 1
    assert env.distributed_type is DistributedType.NO
    assert env.warnings == ()


def test_multi_process_falls_back_to_cpu_with_warning(apple):
    env = resolve_environment(TWO_PROCS)
    assert env.device_type == "cpu" and env.backend == "gloo"
    assert env.distributed_type is DistributedType.MULTI_CPU
    # The user asked for 2 processes on a Mac: they must be told why the GPU is not used.
    assert any("MPS" in w and "CPU" in w for w in env.warnings), env.warnings


def test_cpu_flag_forces_cpu(apple):
    env = resolve_environment({}, cpu=True)
    assert env.device_type == "cpu" and env.backend is None
    assert env.warnings == ()


def test_cpu_environment_variable_forces_cpu(apple):
    env = resolve_environment({"ANYACCEL_USE_CPU": "1"})
    assert env.device_type == "cpu"


def test_cpu_flag_multi_process_has_no_mps_warning(apple):
    # The user chose the CPU: no warning about the GPU not being used.
    env = resolve_environment(TWO_PROCS, cpu=True)
    assert env.device_type == "cpu" and env.backend == "gloo"
    assert not any("MPS" in w for w in env.warnings)


def test_cuda_wins_over_mps(monkeypatch):
    import anyaccel.devices as devices

    monkeypatch.setattr(devices, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(devices, "mps_available", lambda: True)
    env = resolve_environment({})
    assert env.device == "cuda:0"


def test_no_mps_no_cuda_is_cpu(monkeypatch):
    import anyaccel.devices as devices

    monkeypatch.setattr(devices, "cuda_device_count", lambda: 0)
    monkeypatch.setattr(devices, "mps_available", lambda: False)
    env = resolve_environment({})
    assert env.device_type == "cpu" and env.warnings == ()
