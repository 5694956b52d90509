"""One parser for every ANYACCEL_* variable: the same text means the same thing everywhere."""

import os

import pytest

from anyaccel import envvars
from anyaccel.environment import resolve_environment
from anyaccel.errors import ConfigError
from anyaccel.launch.plan import slurm_step
from anyaccel.slurm import read_slurm

TRUE = ["1", "true", "yes", "on", "ON", "True", " yes "]
FALSE = ["0", "false", "no", "off", "OFF", ""]

SLURM_STEP = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
              "SLURM_NODELIST": "node1", "SLURM_NNODES": "1"}
MPI = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
       "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_PORT": "29511"}


@pytest.mark.parametrize("text", TRUE)
def test_every_reader_agrees_on_yes(text):
    # The launcher -> worker contract (what a plain Accelerator() reads) ...
    assert envvars.worker_settings({"ANYACCEL_USE_CPU": text}).cpu is True
    assert envvars.worker_settings({"ANYACCEL_DEBUG": text}).debug is True
    # ... environment detection (SLURM and MPI switches) ...
    assert resolve_environment({**SLURM_STEP, "ANYACCEL_DISABLE_SLURM": text}).source == "single"
    assert resolve_environment({**MPI, "ANYACCEL_DISABLE_MPI": text}).source == "single"
    # ... and the launch planner's SLURM reading.
    assert read_slurm({**SLURM_STEP, "ANYACCEL_DISABLE_SLURM": text}) is None
    assert slurm_step({**SLURM_STEP, "ANYACCEL_DISABLE_SLURM": text}) is None


@pytest.mark.parametrize("text", FALSE)
def test_every_reader_agrees_on_no(text):
    assert envvars.worker_settings({"ANYACCEL_USE_CPU": text}).cpu in (False, None)  # empty = not told
    assert resolve_environment({**SLURM_STEP, "ANYACCEL_DISABLE_SLURM": text}).source == "slurm"
    assert resolve_environment({**MPI, "ANYACCEL_DISABLE_MPI": text}).source == "mpi"
    assert slurm_step({**SLURM_STEP, "ANYACCEL_DISABLE_SLURM": text}) is not None


def test_text_that_is_neither_is_an_error_naming_the_variable():
    with pytest.raises(ConfigError, match="ANYACCEL_DISABLE_SLURM='maybe'"):
        resolve_environment({**SLURM_STEP, "ANYACCEL_DISABLE_SLURM": "maybe"})
    with pytest.raises(ConfigError, match="ANYACCEL_USE_CPU"):
        envvars.worker_settings({"ANYACCEL_USE_CPU": "sometimes"})
    with pytest.raises(ConfigError, match="ANYACCEL_GRADIENT_ACCUMULATION_STEPS has the value .four.; allowed: an integer >= 1"):
        envvars.worker_settings({"ANYACCEL_GRADIENT_ACCUMULATION_STEPS": "four"})


def test_what_the_launcher_writes_the_worker_reads_back():
    env = envvars.worker_env(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=4, debug=False)
    assert env == {"ANYACCEL_USE_CPU": "1", "ANYACCEL_MIXED_PRECISION": "bf16",
                   "ANYACCEL_GRADIENT_ACCUMULATION_STEPS": "4"}  # defaults are not written
    assert envvars.worker_settings(env) == envvars.WorkerSettings(cpu=True, mixed_precision="bf16",
                                                                  gradient_accumulation_steps=4)
    assert envvars.worker_settings({}) == envvars.WorkerSettings()
    with pytest.raises(TypeError, match="unknown setting 'colour'"):
        envvars.worker_env(colour="red")


def test_every_variable_is_declared_once_and_read_lazily(monkeypatch):
    names = [v.name for v in envvars.ALL]
    # anyaccel's own prefix, or Accelerate's names for what `accelerate launch` exports (read as is)
    accelerates = ("PARALLELISM_CONFIG_", "ACCELERATE_DEEPSPEED_", "ACCELERATE_GRADIENT_CLIPPING", "ACCELERATE_FP8_")
    assert len(names) == len(set(names)) and all(n.startswith(("ANYACCEL_", *accelerates)) for n in names)
    monkeypatch.setenv("ANYACCEL_PG_TIMEOUT", "12.5")  # read when asked, not when imported
    assert envvars.read(envvars.PG_TIMEOUT) == 12.5


def test_launcher_gone_tells_a_live_launcher_from_a_dead_one():
    """One rule for 'has the launcher that started me died' (the worker bootstrap and the
    preemption handler both ask it)."""
    import os
    import subprocess
    import sys

    assert envvars.launcher_gone({}) is False  # no launcher: nothing to outlive
    assert envvars.launcher_gone({"ANYACCEL_AGENT_PID": str(os.getpid())}) is False
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert envvars.launcher_gone({"ANYACCEL_AGENT_PID": str(child.pid)}) is True
    assert envvars.launcher_gone({"ANYACCEL_AGENT_PID": "not-a-pid"}) is False


def test_set_temporarily_restores_set_and_unset_variables(monkeypatch):
    monkeypatch.setenv("ANYACCEL_T_KEPT", "before")
    monkeypatch.delenv("ANYACCEL_T_NEW", raising=False)
    with pytest.raises(RuntimeError):
        with envvars.set_temporarily({"ANYACCEL_T_KEPT": "during", "ANYACCEL_T_NEW": "1"}):
            assert os.environ["ANYACCEL_T_KEPT"] == "during" and os.environ["ANYACCEL_T_NEW"] == "1"
            raise RuntimeError("the block failed")  # restored all the same
    assert os.environ["ANYACCEL_T_KEPT"] == "before"
    assert "ANYACCEL_T_NEW" not in os.environ


def test_network_helpers_name_this_machines_route_and_interface():
    from anyaccel import network

    assert network.source_address("127.0.0.1") == "127.0.0.1"
    assert network.source_address("[::1]") in ("::1", None)  # None where IPv6 is off
    assert network.interface_of("127.0.0.1") is not None
    assert network.interface_of("203.0.113.77") is None  # an address no interface here holds
    assert network.resolves_to_loopback("localhost")
    assert network.resolves_to_loopback("no-such-host.invalid")


def test_gloo_interface_is_the_one_other_machines_reach(monkeypatch):
    import dataclasses

    from anyaccel import network, process_group
    from anyaccel.environment import resolve_environment

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # restored (to unset) after the test, whatever sets it
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setattr(network, "resolves_to_loopback", lambda name: True)  # as on Debian: host name -> 127.0.1.1
    one = resolve_environment({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    assert (one.num_nodes, one.local_rank, one.local_world_size) == (1, 1, 2)  # loopback: one machine
    process_group._choose_gloo_interface(one)
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    address = network.address_for_peers("127.0.0.1")  # machine 0 whose main address resolves to loopback
    if address is None:
        pytest.skip("no network interface besides loopback")
    assert not network.is_loopback(address)
    several = resolve_environment({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "1"})
    assert several.num_nodes == 2  # one process per machine (pod)
    process_group._choose_gloo_interface(dataclasses.replace(several, main_address="127.0.1.1"))
    assert os.environ["GLOO_SOCKET_IFNAME"] == network.interface_of(address)
