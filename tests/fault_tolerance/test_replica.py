"""One replica group's step protocol (anyaccel/fault_tolerance/replica.py) in one process: an
in-process Lighthouse and a job of one group (the multi-group behaviour, kills and heals, is
tests/fault_tolerance/test_fault_tolerance_multiprocess.py). Also the torchft members anyaccel relies on."""

from __future__ import annotations

import datetime
import importlib
import inspect
import os
import socket

import pytest
import torch

pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")

from anyaccel import Accelerator  # noqa: E402
from anyaccel.errors import FaultToleranceError  # noqa: E402
from anyaccel.fault_tolerance.lighthouse import Lighthouse  # noqa: E402
from anyaccel.fault_tolerance.lineage import advance  # noqa: E402
from anyaccel.fault_tolerance.replica import Replica  # noqa: E402
from anyaccel.fault_tolerance.settings import FaultToleranceSettings  # noqa: E402
from anyaccel.fault_tolerance.transport import CONTRACT  # noqa: E402
from anyaccel.fault_tolerance.vote import group_vote  # noqa: E402


@pytest.mark.parametrize("target, member", CONTRACT)
def test_the_torchft_members_anyaccel_relies_on_exist(target, member):
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if member.startswith("_"):  # attributes set in __init__
        assert member in inspect.getsource(cls.__init__) or member in inspect.getsource(cls), (target, member)
    else:
        assert callable(getattr(cls, member))
    if member == "recv_checkpoint":
        assert list(inspect.signature(cls.recv_checkpoint).parameters)[1:] == ["src_rank", "metadata", "step", "timeout"]


def test_pipeline_stages_and_engines_inside_a_group_are_refused_naming_what_works(monkeypatch):
    from types import SimpleNamespace

    from anyaccel.runtime import _replica
    from anyaccel.strategies.capabilities import EngineTraining
    from anyaccel.strategies.mesh import ProcessMesh

    monkeypatch.setenv("ANYACCEL_REPLICA_GROUP", "0")
    monkeypatch.setenv("ANYACCEL_REPLICA_GROUPS", "2")
    options = SimpleNamespace(fault_tolerance="h:1", fault_tolerance_min_replicas=1)
    staged = SimpleNamespace(name="nd", process_mesh=ProcessMesh({"pp": 2}, 0))
    with pytest.raises(FaultToleranceError, match=r"pipeline stages \(pp_size > 1\).*one process, DDP, FSDP2, tensor, sequence or expert parallelism"):
        _replica(options, None, staged)

    class Engine(EngineTraining):
        name, process_mesh = "deepspeed", ProcessMesh.flat(1, 0)

    with pytest.raises(FaultToleranceError, match="the deepspeed strategy .its engine runs backward"):
        _replica(options, None, Engine())
    assert staged.process_mesh.replica_groups == (0, 1)  # refused before the mesh was told anything


def test_what_a_process_holds_of_a_plain_tensor_is_the_tensor_itself():
    from anyaccel.fault_tolerance.shards import like_parameter, local_part, local_tree

    t = torch.ones(3)
    assert local_part(t) is t and local_tree({"a": [t, 1]})["a"][0] is t
    assert like_parameter(torch.nn.Parameter(torch.zeros(3)), t) is t  # not a DTensor parameter: as received


def test_an_unreachable_lighthouse_is_an_error_naming_it():
    settings = FaultToleranceSettings(lighthouse="127.0.0.1:9", group=0, groups=1, timeout_s=2, quorum_timeout_s=2)
    replica = Replica(settings, rank=0, world_size=1, store=None)
    with pytest.raises(FaultToleranceError, match=r"could not join the torchft Lighthouse at http://127\.0\.0\.1:9"):
        replica.begin_step()
    replica.close()


def test_one_group_forms_its_quorum_averages_commits_and_counts_its_steps():
    lighthouse = Lighthouse(min_replicas=1)
    try:
        settings = FaultToleranceSettings(lighthouse=lighthouse.address, group=0, groups=1, timeout_s=10)
        replica = Replica(settings, rank=0, world_size=1, store=None)
        acc = Accelerator(cpu=True)
        model = acc.prepare(torch.nn.Linear(4, 2))
        replica.attach(acc._training_state)
        assert replica.join() is None and replica.participants == 1  # nobody to heal from
        assert replica._synchronous  # resume()'s quorum (and a group's first) is waited for at once
        replica.watch(list(model.parameters()))
        replica.arm()  # the quorum is formed: buckets start during backward
        model(torch.ones(3, 4)).sum().backward()
        before = [p.grad.clone() for p in model.parameters()]
        replica.average_gradients(list(model.parameters()))
        assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))  # one group: its own
        assert replica.commit() and replica.commit()  # asked once per step, kept for every optimizer
        assert replica.step == 1 and replica.state_dict()["step"] == 1
        # the lineage hashes the quorum's member ids, torchft's, each with a uuid of its group's process
        quorum_id, members = replica._members.last
        assert quorum_id == replica._manager._quorum_id and len(members) == 1, replica._members.last
        assert members[0].startswith("anyaccel_group_0:") and len(members[0]) > len("anyaccel_group_0:") + 30
        assert replica._lineage == advance(0, quorum_id, 1, members) != advance(0, quorum_id, 1)
        with pytest.raises(FaultToleranceError, match="without accelerator.backward"):
            replica.begin_step()  # the next step: no average, no commit
            # after a committed step the quorum is asynchronous: sent, its answer not awaited yet
            assert not replica._synchronous and not replica._settled
            replica.commit()
        replica.average_gradients(list(model.parameters()))  # not armed: quorum (formed) and average now
        assert replica.commit() and replica.step == 2 and replica.uncommitted == 0
        replica.close()
        replica.close()  # idempotent
    finally:
        lighthouse.close()


def _in_order(source, steps, what, ours):
    """Assert that each of ``steps`` occurs in ``source`` after the one before it."""
    at = 0
    for step in steps:
        found = source.find(step, at)
        assert found >= 0, f"{what} changed near {step!r}: check {ours}"
        at = found + len(step)


def test_the_one_process_vote_follows_torchfts_should_commit_step_by_step():
    """anyaccel/fault_tolerance/vote.py does what torchft's should_commit does, minus the round trip
    to the group's server: the same statements, in the same order, in the installed torchft."""
    from torchft.manager import Manager

    source = inspect.getsource(Manager.should_commit)
    steps = ["_recovery_event.synchronize()", "synchronize()", "self._pg.errored()", "self._apply_pending_state_dict()",
             "self.num_participants() >= self._min_replica_size", "self._errored is None",
             "self._client.should_commit(", "disallow_checkpoint()", "self._step += 1",
             "self._batches_committed += self.num_participants()", "self._commit_failures = 0",
             "self._commit_failures += 1", "self._max_retries"]
    _in_order(source, steps, "torchft's should_commit", "anyaccel/fault_tolerance/vote.py")


def test_the_synchronous_heal_follows_torchfts_own_synchronous_start_quorum():
    """Replica._settle applies a heal of a synchronous quorum as torchft's start_quorum does without
    use_async_quorum (wait, then _apply_pending_state_dict and _healing = False), on the flags that
    start_quorum resets on the main thread and _async_quorum sets on the quorum thread: checked in
    the installed torchft as the vote's steps are (ftreview: only the members' names were checked)."""
    from torchft.manager import Manager

    start = inspect.getsource(Manager.start_quorum)
    steps = ["self._quorum_future.result()", "self._errored = None", "self._healing = False",
             "self._executor.submit(", "if not self._use_async_quorum:", "self.wait_quorum()", "if self._healing:",
             "self._apply_pending_state_dict()", "self._healing = False"]
    _in_order(start, steps, "torchft's start_quorum", "Replica._settle")
    assert "self._healing = True" in inspect.getsource(Manager._async_quorum)
    # Replica._await_quorum replaces wait_quorum by its body with a bound: check that it is the whole body
    wait = inspect.getsource(Manager.wait_quorum)
    assert "self._quorum_future.result()" in wait and wait.count("self.") == 2, wait  # (and the assert's)


def test_a_rank_waits_for_rank_0s_store_port_as_long_as_a_quorum_and_names_it_when_it_never_comes():
    """A one-machine launch's group store is on 127.0.0.1: rank 0 serves torchft's store and tells
    its port through it. The other ranks waited for it only timeout_s (TORCHFT_TIMEOUT_SEC, 5 s in
    the two-host test) and then failed with torch's bare store timeout (ftreview)."""
    import threading
    import time

    from torch._C._distributed_c10d import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    settings = FaultToleranceSettings(lighthouse="127.0.0.1:9", group=0, groups=2, timeout_s=1, quorum_timeout_s=4)
    late = threading.Timer(2.0, lambda: server.set("anyaccel/fault_tolerance/store/0", "4242"))
    late.start()  # rank 0 comes later than timeout_s, within quorum_timeout_s
    try:
        assert Replica(settings, rank=1, world_size=2, store=("127.0.0.1", server.port))._store()[1] == 4242
    finally:
        late.join()
    server.delete_key("anyaccel/fault_tolerance/store/0")
    settings = FaultToleranceSettings(lighthouse="127.0.0.1:9", group=0, groups=2, timeout_s=1, quorum_timeout_s=1)
    start = time.monotonic()
    with pytest.raises(FaultToleranceError, match=r"rank 1: the port of torchft's store .* within 1 s .*rank 0 did not "
                                                  r"reach its first quorum.*TORCHFT_QUORUM_TIMEOUT_SEC"):
        Replica(settings, rank=1, world_size=2, store=("127.0.0.1", server.port))._store()
    assert time.monotonic() - start < 10


class _FailingVote:
    """A torchft Manager, with the members the vote (anyaccel/fault_tolerance/vote.py) reads, whose
    vote fails: waiting for a peer's transfer raises ``error``; or, with ``failures`` steps in a
    row failed already, the step cannot commit (too few groups) once more."""

    def __init__(self, error=None, failures=0):
        from types import SimpleNamespace

        self._error, self._commit_failures = error, failures
        self._recovery_event, self._healing, self._errored, self._max_retries = None, False, None, 20
        self._min_replica_size = 1 if error is not None else 3
        self._step = self._batches_committed = 0
        self._pg = SimpleNamespace(errored=lambda: None)
        self._checkpoint_transport = SimpleNamespace(disallow_checkpoint=self._disallow)

    def _disallow(self):
        if self._error is not None:
            raise self._error

    def num_participants(self):
        return 2

    def errored(self):
        return None

    def current_step(self):
        return 6


@pytest.mark.parametrize("error", [RuntimeError("status: Unavailable, message: \"error trying to connect\""),
                                   TimeoutError("status: DeadlineExceeded")])
def test_a_failed_commit_vote_is_not_reported_as_too_many_uncommitted_steps(error):
    """A vote that raises RuntimeError or TimeoutError: the first was reported as '20 steps in a row
    did not commit', the second passed bare (ftreview)."""
    settings = FaultToleranceSettings(lighthouse="127.0.0.1:9", group=1, groups=2)
    replica = Replica(settings, rank=0, world_size=1, store=None)
    replica._manager, replica._averaged = _FailingVote(error), True
    with pytest.raises(FaultToleranceError, match=rf"group 1, rank 0: the commit vote of step 7 failed "
                                                  rf"\({type(error).__name__}: status") as raised:
        replica.commit()
    assert "in a row" not in str(raised.value)
    replica._manager = _FailingVote(failures=20)  # the 21st step in a row that cannot commit
    replica._averaged = True
    with pytest.raises(FaultToleranceError, match="20 steps in a row did not commit"):
        replica.commit()


class _StuckQuorum:
    """A torchft Manager whose quorum thread never answers (a Lighthouse or peer that stopped mid-quorum)."""

    def __init__(self):
        import concurrent.futures

        self._quorum_future = concurrent.futures.Future()  # never completed

    def current_step(self):
        return 4


def test_a_quorum_that_never_answers_ends_within_its_overall_bound_naming_the_timeouts_and_the_fix():
    """Each wait of torchft's quorum thread has a timeout, but Manager.wait_quorum waited for their sum
    without a bound (ftreview): now quorum_timeout_s + 3 x timeout_s at most."""
    import time

    settings = FaultToleranceSettings(lighthouse="127.0.0.1:9", group=1, groups=2, timeout_s=0.1, quorum_timeout_s=0.2)
    assert settings.quorum_wait_s == pytest.approx(0.5)
    replica = Replica(settings, rank=0, world_size=1, store=None)
    replica._manager, replica._pending = _StuckQuorum(), True
    start = time.monotonic()
    with pytest.raises(FaultToleranceError, match=r"group 1, rank 0: the quorum of step 5 did not complete within 0\.5 s "
                                                  r"\(quorum_timeout_s=0\.2 .* 3 x timeout_s=0\.1 .*launcher starts the "
                                                  r"group again .*TORCHFT_TIMEOUT_SEC.*TORCHFT_QUORUM_TIMEOUT_SEC"):
        replica._settle()
    assert time.monotonic() - start < 5


def test_no_quorum_names_the_step_in_progress_as_every_other_line_does():
    """The steps a user reads are numbered from 1 (committed steps + 1: "the quorum of step 5", "step 5
    not committed", "step 5 runs with ..."); a failed quorum said "no quorum for step 4", the step
    before the one that failed."""
    settings = FaultToleranceSettings(lighthouse="127.0.0.1:9", group=1, groups=2, timeout_s=0.1, quorum_timeout_s=0.2)
    replica = Replica(settings, rank=0, world_size=1, store=None)
    failed = _StuckQuorum()  # 4 steps committed
    failed._quorum_future.set_exception(TimeoutError("no quorum from the Lighthouse"))
    replica._manager, replica._pending = failed, True
    with pytest.raises(FaultToleranceError, match=r"replica group 1: no quorum for step 5 within 0\.2 s"):
        replica._settle()


def test_too_few_groups_for_a_quorum_read_as_no_quorum_not_as_a_stuck_quorum_thread():
    """torchft's Rust client raises TimeoutError when the Lighthouse gives no quorum within
    quorum_timeout_s (fewer groups alive than min_replicas); the overall bound's wait took it for its
    own timeout and said the quorum thread was stuck, after 1 s of a 7 s bound (ft5review)."""
    import time

    lighthouse = Lighthouse(min_replicas=2)
    settings = FaultToleranceSettings(lighthouse=lighthouse.address, group=0, groups=2, min_replicas=2, timeout_s=2,
                                      quorum_timeout_s=1)
    replica = Replica(settings, rank=0, world_size=1, store=None)
    start = time.monotonic()
    try:
        with pytest.raises(FaultToleranceError, match=r"no quorum for step 1 within 1 s .*TimeoutError.*fewer than "
                                                      r"fault_tolerance_min_replicas=2 groups are alive"):
            replica.begin_step()
        assert time.monotonic() - start < settings.quorum_wait_s
    finally:
        replica.close()
        lighthouse.close()


def test_close_stops_the_store_this_process_served_for_torchft():
    from torch._C._distributed_c10d import TCPStore

    settings = FaultToleranceSettings(lighthouse="127.0.0.1:9", group=0, groups=1)
    replica = Replica(settings, rank=0, world_size=1, store=None)
    host, port = replica._store()
    TCPStore(host, port, is_master=False, wait_for_workers=False).set("k", "v")  # served
    replica.close()
    with pytest.raises(OSError):  # refused: nothing listens there now
        socket.create_connection((host, port), timeout=5).close()


def _rank_of_a_restarted_group(rank, attempt, port, store_port, answers):
    """One rank of a group whose ranks' launchers counted restarts differently (a spawned process;
    os._exit after its answer is flushed)."""
    import torch.distributed as dist

    from anyaccel.environment import Environment
    from anyaccel.environment.detectors import LaunchFacts
    from anyaccel.runtime import _agreed_restart_attempt

    code = 1
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=30))
        settings = FaultToleranceSettings(lighthouse="127.0.0.1:9", group=0, groups=2, timeout_s=5, quorum_timeout_s=5)
        replica = Replica(settings, rank=rank, world_size=2, store=("127.0.0.1", store_port), attempt=attempt)
        # what start_runtime does once the group's process group is formed: one attempt for every rank
        # (the doctor's keys and this one), here for a group of two machines whose agents may restart
        env = Environment(world_size=2, rank=rank, node_rank=rank, num_nodes=2,
                          launch=LaunchFacts(restart_attempt=attempt, max_restarts=3))
        replica.attempt = _agreed_restart_attempt(env, "cpu", "gloo").launch.restart_attempt
        found = replica._store()
        dist.barrier()  # rank 0 serves the store until rank 1 has read its port
        replica.close()
        # the commit vote of a group of several processes (vote.py): one all-reduce over the group's ranks
        votes = (group_vote(True, 5.0), group_vote(rank == 0, 5.0), group_vote(True, 5.0))
        answers.put((rank, (found, votes)))
        code = 0
    except BaseException as exc:  # said to the test, which fails naming it
        answers.put((rank, repr(exc)))
    finally:
        answers.close()
        answers.join_thread()  # (the queue's feeder thread: os._exit would drop what it holds)
        os._exit(code)


@pytest.mark.slow
def test_the_ranks_of_a_group_whose_launchers_counted_restarts_differently_agree_on_the_store_key_and_vote():
    """A group spanning machines: one machine's agent was started again (restart count 0), the other
    counted on (2). The port of rank 0's store was published under each rank's own count, so rank 1
    waited under a key rank 0 never wrote, or read the dead port an earlier attempt left there
    (ftreview). The ranks now agree on the highest count: the runtime's one agreement, which names the
    doctor's keys too (one all-reduce over the group's processes)."""
    import multiprocessing

    from torch._C._distributed_c10d import TCPStore

    group_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    group_store.set("anyaccel/fault_tolerance/store/0", "9")  # left by the group's first attempt: a dead port
    # spawn, not fork: forked from an xdist worker that ran other tests (torchft's threads, stores'
    # threads), a child hung on a lock copied while held (CI, 2026-11-29: nothing answered in 60 s)
    ctx = multiprocessing.get_context("spawn")
    answers = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [ctx.Process(target=_rank_of_a_restarted_group, args=(rank, attempt, port, group_store.port, answers))
             for rank, attempt in ((0, 0), (1, 2))]  # rank 0's agent is the new one
    for p in ranks:
        p.start()
    try:
        got = dict(answers.get(timeout=120) for _ in ranks)  # (spawned: each imports torch, torchft and this module first)
    finally:
        for p in ranks:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert got[0] == got[1] and isinstance(got[0], tuple), got
    found, votes = got[0]
    assert found[1] != 9 and int(group_store.get("anyaccel/fault_tolerance/store/2")) == found[1]
    assert votes == (True, False, True)  # one rank's no is the group's no
    assert [p.exitcode for p in ranks] == [0, 0]


class _WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(4, 2), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


@pytest.mark.parametrize("find_unused", [True, False])
def test_a_backward_that_raises_votes_its_step_down_and_the_next_step_commits_as_ddp_treats_unused_parameters(
        find_unused, capsys):
    """Through Accelerator.backward with a real torchft Manager (one group): a backward that raised
    left its step pending (never voted: the next step reused its quorum, and the other groups' bucket
    order was off by the buckets it never sent); now the step is sent, voted down (the optimizer step
    skips) and the next one commits. With DDP's find_unused_parameters (read from the job's
    DistributedDataParallelKwargs), an unused parameter keeps no gradient, so AdamW's weight decay
    leaves it alone (it got zeros, and decayed); without (DDP's default, where DDP itself stops), it
    gets zeros and this rank names it, once."""
    from anyaccel import DistributedDataParallelKwargs
    from anyaccel.runtime import _find_unused_parameters

    lighthouse = Lighthouse(min_replicas=1)
    try:
        settings = FaultToleranceSettings(lighthouse=lighthouse.address, group=0, groups=1, timeout_s=10)
        acc = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=find_unused)])
        replica = Replica(settings, rank=0, world_size=1, store=None,
                          find_unused_parameters=_find_unused_parameters(acc.options))
        acc._replica = replica
        replica.attach(acc._training_state)
        torch.manual_seed(0)
        model = _WithUnused()
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5))
        replica.join()
        untouched = model.unused.weight.detach().clone()

        def boom(_grad):
            raise ValueError("boom in backward")

        def raising(_module, _inputs, out):
            out.register_hook(boom)

        hook = model.used.register_forward_hook(raising)
        with pytest.raises(ValueError, match="boom in backward"):
            acc.backward(model(torch.ones(3, 4)).sum())
        hook.remove()
        assert replica.uncommitted == 1 and replica.step == 0 and replica.commit() is False
        opt.step()
        assert opt.step_was_skipped
        opt.zero_grad()
        capsys.readouterr()
        for step in (1, 2):
            acc.backward(model(torch.ones(3, 4)).sum())
            assert model.used.weight.grad is not None
            if find_unused:
                assert model.unused.weight.grad is None
            else:
                assert torch.equal(model.unused.weight.grad, torch.zeros_like(model.unused.weight))
            opt.step()
            opt.zero_grad()
            assert not opt.step_was_skipped and replica.step == step and replica.uncommitted == 1
        said = capsys.readouterr().err
        if find_unused:
            assert torch.equal(model.unused.weight, untouched) and "no gradient" not in said
        else:
            assert not torch.equal(model.unused.weight, untouched)  # decayed, as the message says
            assert said.count("got no gradient") == 1 and "(unused.weight, unused.bias)" in said, said
            assert "find_unused_parameters=True" in said
        replica.close()
    finally:
        lighthouse.close()


class _Recorder:
    """A replica group that records what the Accelerator asks of it."""

    def __init__(self):
        self.calls = []

    def watch(self, parameters, models=None):
        self.calls.append("watch")

    def arm(self):
        self.calls.append("arm")

    def average_gradients(self, parameters, failed=None):
        self.calls.append("average")

    def commit(self):
        self.calls.append("commit")
        return True


def test_only_the_sync_step_of_an_accumulation_group_is_averaged():
    """gradient_accumulation_steps=2: the micro-step's backward is local (not armed, nothing sent),
    the sync step's is averaged once; what the average does with the accumulated gradients is
    tests/fault_tolerance/test_averaging.py::test_accumulated_gradients_are_averaged_once_at_the_sync_step_as_ddp."""
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    recorder = _Recorder()
    acc._replica = recorder
    model = torch.nn.Linear(4, 2)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    recorder.calls.clear()
    for _ in range(4):
        with acc.accumulate(model):
            acc.backward(model(torch.ones(3, 4)).sum())
            opt.step()
            opt.zero_grad()
    assert recorder.calls == ["arm", "average", "commit"] * 2


def test_a_backward_inside_accelerator_no_sync_is_not_averaged_as_ddps():
    """accelerator.no_sync(model) micro-steps (gradient_accumulation_steps=1, Accelerate's manual
    accumulation): DDP all-reduces only the backward outside the block. The replica groups averaged
    the one inside too (the right sum by linearity, at twice the traffic)."""
    acc = Accelerator(cpu=True)
    recorder = _Recorder()
    acc._replica = recorder
    model = torch.nn.Linear(4, 2)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    recorder.calls.clear()
    with acc.no_sync(model):
        acc.backward(model(torch.ones(3, 4)).sum())
    acc.backward(model(torch.ones(3, 4)).sum())
    opt.step()
    assert recorder.calls == ["arm", "average", "commit"]


def test_the_bucket_average_follows_torchfts_allreduce_step_by_step():
    """anyaccel/fault_tolerance/reduce.py does what torchft's Manager.allreduce does with ReduceOp.AVG,
    minus its per-call futures: the same statements, in the same order, in the installed torchft."""
    from torchft.manager import Manager

    source = inspect.getsource(Manager.allreduce)
    steps = ["if self.errored():", "self.wait_quorum()", "self.num_participants()", "if not self.is_participating():",
             "tensor.zero_()", "pg_reduce_op = ReduceOp.SUM", "self._pg.allreduce([tensor], opts)",
             "tensor /= num_participants", "self.report_error(e)"]
    _in_order(source, steps, "torchft's allreduce", "anyaccel/fault_tolerance/reduce.py")


class _Work:
    def __init__(self, error=None):
        self.error = error

    def wait(self):
        if self.error is not None:
            raise self.error
        return True


class _Manager:
    """torchft's Manager as reduce.py reads it: a gradient group that adds another group's tensor."""

    def __init__(self, other, participating=True, error=None, wait_error=None):
        self.other, self.participating, self._errored, self.wait_error = other, participating, error, wait_error
        self.sent = []
        self._pg = self

    def errored(self):
        return self._errored

    def num_participants(self):
        return 2

    def is_participating(self):
        return self.participating

    def report_error(self, exc):
        self._errored = exc

    def allreduce(self, tensors, opts):
        assert opts.reduceOp == torch.distributed.ReduceOp.SUM
        self.sent.append(tensors[0].clone())
        tensors[0].add_(self.other)
        return _Work(self.wait_error)


def test_the_bucket_average_sums_divides_zeros_a_healing_group_and_records_errors():
    from anyaccel.fault_tolerance.reduce import start_average

    mine, other = torch.randn(7), torch.randn(7)
    expected = mine + other
    expected /= 2  # what torchft's callback computes: bitwise
    tensor = mine.clone()
    assert start_average(_Manager(other), tensor).wait() and torch.equal(tensor, expected)
    healing = _Manager(other, participating=False)  # sits the step out: its gradients count as zeros
    tensor = mine.clone()
    assert start_average(healing, tensor).wait() and torch.equal(healing.sent[0], torch.zeros(7))
    failed = _Manager(other, error=RuntimeError("earlier"))  # the step has an error: nothing is sent
    assert start_average(failed, mine.clone()).wait() and failed.sent == []
    lost = _Manager(other, wait_error=RuntimeError("Connection reset by peer"))  # recorded, not raised
    assert not start_average(lost, mine.clone()).wait() and "reset" in str(lost.errored())


class _StandInManager(_Manager):
    """:class:`_Manager` (the other group all zeros) as far as a step asks it besides the average:
    a quorum future (``done``: answered) that ``num_participants`` waits for, as torchft's does."""

    def __init__(self, done: bool):
        import concurrent.futures

        super().__init__(other=0.0)
        self._quorum_future = concurrent.futures.Future()
        if done:
            self._quorum_future.set_result(None)
        self._healing = False

    def current_step(self):
        return 4

    def num_participants(self):  # torchft: wait_quorum(), the future's result() without a bound
        self._quorum_future.result()
        return 2


def _stand_in_replica(manager, rank=0, world_size=1):
    settings = FaultToleranceSettings(lighthouse="127.0.0.1:9", group=1, groups=2, timeout_s=0.1, quorum_timeout_s=0.2)
    replica = Replica(settings, rank=rank, world_size=world_size, store=None)
    replica._manager, replica._pending = manager, True
    return replica


def test_a_backward_ended_by_a_stuck_quorum_is_not_followed_by_an_unbounded_wait():
    """The step's first bucket waits for the quorum with the overall bound; past it the backward
    raises. abandon() then started the remaining buckets, whose average asked torchft for the
    number of groups, a wait on the stuck quorum without any bound: the process hung for good
    (the reviewer's repro). Now a step whose quorum failed sends nothing, and is marked failed."""
    import threading

    manager = _StandInManager(done=False)
    replica = _stand_in_replica(manager)
    model = torch.nn.Linear(4, 2)
    params = list(model.parameters())
    replica.watch(params)
    replica.arm()
    caught = []

    def step():
        try:
            model(torch.ones(3, 4)).sum().backward()
        except Exception as exc:
            caught.append(exc)
            replica.abandon(params, exc)

    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "abandon() waited for the stuck quorum"
    assert caught and "did not complete within" in str(caught[0])
    assert manager.sent == [] and manager.errored() is caught[0]
    assert replica._pending is False and replica.commit() is False


def _armed_step(rank, world_size):
    """A stand-in replica (rank ``rank`` of a group of ``world_size``) in a gradient-sync step whose
    quorum answered, watching a model of 2 buckets (DDP's rule): ``(manager, replica, model, params)``."""
    manager = _StandInManager(done=True)
    replica = _stand_in_replica(manager, rank=rank, world_size=world_size)
    replica._settled = True
    replica._quorum_ok = True
    model = torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.Linear(600, 600))  # 2 buckets (DDP's rule)
    params = list(model.parameters())
    replica.watch(params)
    replica.arm()
    return manager, replica, model, params


def test_a_failure_while_sending_the_rest_of_a_raising_step_ends_the_process_loudly_and_sends_no_bucket_twice(capsys):
    """The likeliest backward failure is out of memory, and sending the rest of the step allocates
    (zeros for the parameters without a gradient). Before: that second failure was printed on rank
    0 only and swallowed, the step stayed pending (the next step reused its quorum) and this group
    had issued fewer all-reduces than the others. Now: every rank says so, the step is failed, and
    FaultToleranceError is raised from both; a bucket whose start failed is not sent twice. (A group of
    one process: one of several sends nothing, below.)"""
    manager, replica, model, params = _armed_step(rank=0, world_size=1)
    assert replica._average.bucket_count == 2

    def boom(_param):
        raise RuntimeError("out of memory (the first)")

    params[1].register_post_accumulate_grad_hook(boom)  # the first layer's bias: after the last layer's bucket left
    real = torch.zeros_like
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "zeros_like", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("out of memory again")))
        try:
            model(torch.ones(2, 600)).sum().backward()
        except RuntimeError as exc:
            with pytest.raises(FaultToleranceError, match="no longer line up") as failed:
                replica.abandon(params, exc)
    assert torch.zeros_like is real
    assert "out of memory again" in str(failed.value.__cause__)
    assert "replica group 1, rank 0" in capsys.readouterr().err  # said with the rank
    assert [t.numel() for t in manager.sent] == [600 * 600 + 600]  # the last layer's bucket, once; the second never left
    assert replica._pending is False and replica._decision is False and manager.errored() is not None


def test_a_raising_backward_in_a_group_of_several_processes_ends_the_process_sending_nothing_more(capsys):
    """The strategy inside a group of several processes (FSDP2, DDP, tensor parallelism) cannot go on
    after an exception in its backward: the rest of the step is not sent, the step fails, and the
    process ends (the error raised again at the next step if a script catches it). The launched case:
    test_fault_tolerance_multiprocess.py::test_a_backward_that_raises_in_a_group_of_two_fsdp2_processes_..."""
    manager, replica, model, params = _armed_step(rank=1, world_size=2)

    def boom(_param):
        raise RuntimeError("out of memory")

    params[1].register_post_accumulate_grad_hook(boom)  # after the last layer's bucket left
    try:
        model(torch.ones(2, 600)).sum().backward()
    except RuntimeError as exc:
        with pytest.raises(FaultToleranceError, match=r"replica group 1, rank 1: its backward raised \(RuntimeError: out "
                                                      r"of memory\): the strategy inside a group of 2 processes cannot "
                                                      r"go on") as ended:
            replica.abandon(params, exc)
    assert "out of memory" in str(ended.value.__cause__)
    assert [t.numel() for t in manager.sent] == [600 * 600 + 600]  # the bucket that had left; nothing after
    assert replica._pending is False and replica._decision is False and manager.errored() is not None
    assert "replica group 1, rank 1: its backward raised" in capsys.readouterr().err
    with pytest.raises(FaultToleranceError, match="cannot go on"):
        replica.begin_step()  # a script that caught it and went on
