"""What anyaccel relies on in torch elastic's agent (anyaccel/launch/agent.py), checked against the
installed torch. Each failure names the torch member that changed, so a new torch release that
moves one fails here, loudly, instead of as a hang or a lost checkpoint in the launch tests.

Run on every torch the project supports (the main venv and the oldest-supported one)."""

from __future__ import annotations

import dataclasses
import inspect
import signal

import pytest

from anyaccel.launch import agent as adapter

local_elastic_agent = pytest.importorskip("torch.distributed.elastic.agent.server.local_elastic_agent")
from torch.distributed.elastic.agent.server import api as agent_api  # noqa: E402
from torch.distributed.elastic.multiprocessing import api as mp_api  # noqa: E402

pytestmark = pytest.mark.torch_versions  # torch's agent internals: make test-wheel runs these on torch 2.9

LocalElasticAgent = local_elastic_agent.LocalElasticAgent


def _parameters(member: object) -> list:
    return [p for p in inspect.signature(member).parameters if p != "self"]


def _source(member: object) -> str:
    return inspect.getsource(member)  # type: ignore[arg-type]


@pytest.mark.parametrize("name, expected", adapter.CONTRACT, ids=[m for m, _ in adapter.CONTRACT])
def test_the_overridden_agent_members_exist_with_the_parameters_the_subclass_takes(name, expected):
    member = getattr(LocalElasticAgent, name, None)
    assert callable(member), f"torch's LocalElasticAgent.{name} is gone: anyaccel/launch/agent.py overrides it"
    got = _parameters(member)
    assert got[: len(expected)] == list(expected), (
        f"torch's LocalElasticAgent.{name}{tuple(got)} no longer takes {expected} first: "
        f"anyaccel/launch/agent.py's override would be called wrongly")
    ours = _parameters(getattr(adapter.agent_class(), name))
    assert ours[: len(expected)] == list(expected), f"PreemptingAgent.{name} must take {expected}"


def test_a_shutdown_with_a_timeout_comes_with_a_shutdown_timeout_in_the_constructor():
    takes_timeout = "timeout" in _parameters(LocalElasticAgent._shutdown)
    accepts = "shutdown_timeout" in _parameters(LocalElasticAgent.__init__)
    assert takes_timeout == accepts, (
        f"torch's LocalElasticAgent._shutdown {'takes' if takes_timeout else 'has no'} timeout but __init__ "
        f"{'accepts' if accepts else 'has no'} shutdown_timeout: anyaccel/launch/agent.py assumes both or neither")


def test_the_agent_calls_shutdown_with_the_signal_and_a_timeout_when_a_signal_stops_it():
    # SimpleElasticAgent.run: except SignalException as e: self._shutdown(e.sigval, timeout=...)
    source = _source(agent_api.SimpleElasticAgent.run)
    assert "except SignalException" in source and "self._shutdown(e.sigval" in source, (
        "torch's SimpleElasticAgent.run no longer calls self._shutdown(e.sigval, ...) on SignalException: "
        "the preemption grace in anyaccel/launch/agent.py would never apply")


def test_restarts_are_counted_in_remaining_restarts_and_decided_after_monitor_workers():
    source = _source(agent_api.SimpleElasticAgent._invoke_run)
    assert "self._monitor_workers(" in source and "self._remaining_restarts > 0" in source, (
        "torch's SimpleElasticAgent._invoke_run no longer decides restarts from self._remaining_restarts "
        "after self._monitor_workers: a worker that checkpointed (exit 75) could be restarted")
    assert "self._remaining_restarts" in _source(agent_api.SimpleElasticAgent.__init__), (
        "torch's SimpleElasticAgent.__init__ no longer sets self._remaining_restarts")


def test_the_process_context_is_kept_in_pcontext_and_its_workers_exit_codes_are_readable():
    assert "self._pcontext" in _source(LocalElasticAgent.__init__), (
        "torch's LocalElasticAgent no longer keeps its process context in self._pcontext: "
        "anyaccel cannot report the workers' exit statuses after a preemption")
    assert "self.subprocess_handlers" in _source(mp_api.SubprocessContext), (
        "torch's SubprocessContext.subprocess_handlers is gone (read by anyaccel.launch.agent.exit_codes)")
    assert "self._pc" in _source(mp_api.MultiprocessContext), (
        "torch's MultiprocessContext._pc is gone (read by anyaccel.launch.agent.exit_codes)")


def test_the_process_context_is_closed_with_a_death_signal_and_a_timeout():
    # torch 2.9's _shutdown has no timeout: the agent closes the context with the grace itself
    assert _parameters(mp_api.PContext.close)[:2] == ["death_sig", "timeout"], (
        f"torch's PContext.close{tuple(_parameters(mp_api.PContext.close))} no longer takes (death_sig, timeout)")


def test_the_public_constructors_take_what_launch_agent_passes():
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    fields = {f.name for f in dataclasses.fields(agent_api.WorkerSpec)}
    wanted = {"role", "local_world_size", "entrypoint", "args", "rdzv_handler", "max_restarts", "monitor_interval",
              "master_addr", "master_port"}
    assert wanted <= fields, f"torch's WorkerSpec lost the fields {sorted(wanted - fields)}"
    init = _parameters(LocalElasticAgent.__init__)
    assert init[:3] == ["spec", "logs_specs", "start_method"], f"torch's LocalElasticAgent.__init__{tuple(init)}"
    rdzv = _parameters(RendezvousParameters.__init__)
    assert rdzv[:6] == ["backend", "endpoint", "run_id", "min_nodes", "max_nodes", "local_addr"], (
        f"torch's RendezvousParameters.__init__{tuple(rdzv)}")
    assert SignalException("x", sigval=signal.SIGTERM).sigval == signal.SIGTERM, "torch's SignalException.sigval"
    assert _parameters(ChildFailedError.__init__)[:2] == ["name", "failures"], "torch's ChildFailedError.__init__"


def test_a_repeated_preemption_signal_is_ignored_and_others_stop_the_agent():
    from torch.distributed.elastic.multiprocessing import SignalException

    preemption = adapter.Preemption(grace=1.0)
    with pytest.raises(SignalException) as first:
        preemption.handler(signal.SIGTERM, None)
    assert first.value.sigval == signal.SIGTERM and preemption.signal == signal.SIGTERM
    assert preemption.handler(signal.SIGUSR1, None) is None  # already stopping for a preemption
    with pytest.raises(SignalException):
        preemption.handler(signal.SIGINT, None)


def test_nothing_of_torch_is_modified_by_importing_or_building_the_agent():
    before = (LocalElasticAgent._shutdown, LocalElasticAgent._monitor_workers, LocalElasticAgent._start_workers,
              mp_api._terminate_process_handler)
    cls = adapter.agent_class()
    assert issubclass(cls, LocalElasticAgent)
    assert before == (LocalElasticAgent._shutdown, LocalElasticAgent._monitor_workers,
                      LocalElasticAgent._start_workers, mp_api._terminate_process_handler)


def test_restarts_across_machines_get_a_fresh_store_per_round_and_nothing_else_changes(monkeypatch):
    """torch's c10d rendezvous publishes its shared store only in the first round, so a machine
    restarted after it died could never join again (fault (c) of the cluster tests): with restarts
    between machines the launcher opts out of the shared store, and only then, never over the
    user's own value."""
    from anyaccel.launch.elastic import ElasticJob, _rendezvous_env

    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    two = dict(nproc_per_node=1, num_nodes=2, main_address="192.0.2.10", main_port=29500)
    assert _rendezvous_env(ElasticJob(**two, max_restarts=2), "c10d") == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    assert _rendezvous_env(ElasticJob(**two, max_restarts=0), "c10d") == {}  # the store stays in the agent
    assert _rendezvous_env(ElasticJob(**two, max_restarts=2), "static") == {}
    assert _rendezvous_env(ElasticJob(nproc_per_node=2, max_restarts=2), "c10d") == {}  # one machine
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")
    assert _rendezvous_env(ElasticJob(**two, max_restarts=2), "c10d") == {}  # the user's value is kept
