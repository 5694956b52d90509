"""The hang doctor, through `anyaccel launch` with 2 real CPU processes (tests/doctor/doctor_checks.py),
and its argument checks."""

from __future__ import annotations

import subprocess
import time

import pytest

from conftest import ROOT, SCRIPTS, anyaccel

CHECKS = str(SCRIPTS / "doctor_checks.py")


def launch(*args, timeout=150) -> subprocess.CompletedProcess:
    return anyaccel("launch", *args, timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("value", [-1, "300", float("nan"), True])
def test_hang_timeout_must_be_a_number_of_seconds(value):
    from anyaccel import Accelerator

    with pytest.raises(ValueError, match="hang_timeout has the value .*; allowed: a number of seconds >= 0"):
        Accelerator(cpu=True, hang_timeout=value)


def test_an_unknown_preemption_signal_is_refused_everywhere(tmp_path):
    from anyaccel import Accelerator
    from anyaccel.config.schema import Config
    from anyaccel.errors import ConfigError
    from anyaccel.preemption import parse_signals

    assert parse_signals("usr1, SIGTERM") == ("SIGUSR1", "SIGTERM")
    assert parse_signals("none") == ()
    with pytest.raises(ConfigError, match="'SIGFOO' is not a preemption signal"):
        Accelerator(cpu=True, preemption_signals="SIGFOO")
    with pytest.raises(ConfigError, match="preemption_signals"):
        Config.from_dict({"preemption_signals": "SIGKILL"})
    proc = launch("--preemption_signals", "SIGBOGUS", "--cpu", CHECKS, "x", timeout=60)
    assert proc.returncode != 0 and "'SIGBOGUS' is not a preemption signal" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = launch("--hang_timeout", "-5", "--cpu", CHECKS, "x", timeout=60)
    assert proc.returncode != 0 and "allowed: a number of seconds >= 0" in proc.stderr


def test_the_doctor_thread_has_ended_when_the_interpreter_exit_hook_returns():
    """A daemon thread left inside a TCP-store call at finalisation aborts the process
    ("terminate called without an active exception"), so the exit hook stops and joins it."""
    import datetime
    import types

    import torch.distributed as dist

    from anyaccel.doctor import Doctor

    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    env = types.SimpleNamespace(rank=0, world_size=2, main_address="127.0.0.1", main_port=server.port)
    doc = Doctor(env, interval=0.01)
    deadline = time.monotonic() + 10
    while doc._store is None and time.monotonic() < deadline:  # the thread is polling the store
        time.sleep(0.01)
    assert doc._store is not None and doc._thread.is_alive()
    doc._at_exit()
    assert not doc._thread.is_alive()
    assert dist.PrefixStore(doc._namespace, server).check(["left/0"])  # the other ranks were told it left


def test_a_store_hiccup_is_retried_and_a_lost_store_turns_coordinated_preemption_off():
    """One failed round (a busy store missing a timeout) does not end the doctor; a store that
    keeps failing is given up, and a preemption signal then takes its usual effect instead of
    waiting for an agreement through that store."""
    import datetime
    import types

    import torch.distributed as dist

    from anyaccel.doctor import Doctor
    from anyaccel.preemption import Preemption

    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    env = types.SimpleNamespace(rank=0, world_size=2, main_address="127.0.0.1", main_port=server.port)
    doc = Doctor(env, interval=0.01)
    preemption = Preemption(("SIGUSR1",), 0, 2)
    preemption.coordinated = True
    doc.subscribe(0, on_lost=preemption.store_lost)
    rounds, failing = [], {"until": 2}

    def poll(store):
        rounds.append(1)
        if len(rounds) <= failing["until"]:
            raise TimeoutError("store timed out")

    doc.subscribe(0, poll=poll)
    try:
        deadline = time.monotonic() + 10
        while len(rounds) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(rounds) >= 6 and doc._thread.is_alive() and preemption.coordinated  # two failures, then fine
        failing["until"] = 10**9  # from now on every round fails
        while doc._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not doc._thread.is_alive() and not preemption.coordinated
    finally:
        doc._at_exit()


def test_backward_is_marked_for_the_doctor_and_the_previous_op_comes_back():
    """What the doctor sees of backward (DDP's all-reduce happens inside it): the tracker says
    `backward (gradient all-reduce)` while autograd runs, and the op around it afterwards."""
    import torch

    from anyaccel import Accelerator, doctor

    acc = Accelerator(cpu=True, preemption_signals="none")
    seen = []
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: seen.append((doctor.TRACKER.op, doctor.TRACKER.since)))
    doctor.TRACKER.op = "outer"
    try:
        before = time.monotonic()
        acc.backward(y.sum())
        assert seen and seen[0][0] == "backward (gradient all-reduce)" and seen[0][1] >= before
        assert doctor.TRACKER.op == "outer"
        z = torch.ones(1, requires_grad=True) * 1
        z.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):  # no doctor in one process: the error itself
            acc.backward(z.sum())
        assert doctor.TRACKER.op == "outer"
    finally:
        doctor.TRACKER.op = None


def test_the_preemption_boundary_is_counted_at_sync_points_only():
    import torch

    from anyaccel import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(1, 1)
    model, loader = acc.prepare(model, torch.utils.data.DataLoader(torch.ones(8, 1), batch_size=1))
    try:
        for batch in loader:
            with acc.accumulate(model):
                acc.backward(model(batch).sum())
        # before the first batch, then after every second one (never inside an accumulation group)
        assert acc._preemption.boundaries == 5
    finally:
        acc.end_training()


def test_frames_of_every_anyaccel_module_are_left_out_of_the_users_stack():
    """The report names the user's line, not anyaccel's: a frame in any anyaccel module (the
    doctor's own package and the top level alike) is a library frame, the user's file is not."""
    import anyaccel
    from anyaccel import ops
    from anyaccel.doctor import report

    assert report.library_frame(ops.__file__) and report.library_frame(anyaccel.__file__)
    assert report.library_frame(report.__file__)
    assert not report.library_frame(__file__)
    assert report.user_stack()[0]["file"].endswith("test_doctor.py")


def _state(rank, op, seq, backwards, waited=10.0, counted=False):
    return {"rank": rank, "host": "h", "pid": rank, "op": op, "seq": seq, "backwards": backwards, "counted": counted,
            "waited": waited, "stack": [{"file": "train.py", "line": 10 + rank, "func": "main", "code": "x"}]}


def test_a_sure_mismatch_is_judged_by_counts_over_every_pair_never_by_labels_and_time_alone():
    from anyaccel.doctor import BACKWARD_LOCAL, BACKWARD_SYNC
    from anyaccel.doctor.report import sure_mismatch

    gather = _state(0, "gather", 6, 4, counted=True)  # in collective #6 after 4 backward calls
    assert "rank 1 is inside the gradient all-reduce" in sure_mismatch({0: gather, 1: _state(1, BACKWARD_SYNC, 5, 5)}, 2, 3)
    # a backward the collective's rank has run too (it is finishing), or one after collective #6 (it entered it)
    assert sure_mismatch({0: gather, 1: _state(1, BACKWARD_SYNC, 5, 4)}, 2, 3) is None
    assert sure_mismatch({0: gather, 1: _state(1, BACKWARD_SYNC, 6, 5)}, 2, 3) is None
    assert sure_mismatch({0: gather, 1: _state(1, BACKWARD_LOCAL, 5, 5)}, 2, 3) is None  # no_sync: nobody waited for
    # every pair: the first backward rank does not fit, the second does
    states = {0: gather, 1: _state(1, BACKWARD_SYNC, 6, 5), 2: _state(2, BACKWARD_SYNC, 5, 5)}
    assert sure_mismatch(states, 3, 3).startswith("rank 2 is inside the gradient all-reduce")
    states = {0: _state(0, "save_state (finding out which processes call it)", 6, 4), 1: _state(1, BACKWARD_SYNC, 5, 5)}
    assert sure_mismatch(states, 2, 3) is None  # not an anyaccel collective


def test_backward_under_no_sync_is_marked_local():
    """B3: a backward inside accelerator.no_sync() (or DDP's own model.no_sync()) waits for nobody."""
    import torch

    from anyaccel import Accelerator, doctor

    acc = Accelerator(cpu=True, preemption_signals="none")
    module = torch.nn.Linear(2, 1)
    module.require_backward_grad_sync = True  # a DDP wrapper has the flag from construction on
    model = acc.prepare(module)
    seen = []
    x = torch.ones(1, 2, requires_grad=True)

    def backward():
        y = model(x).sum()
        y.register_hook(lambda grad: seen.append(doctor.TRACKER.op))
        acc.backward(y)

    backward()
    with acc.no_sync(model):
        backward()
    model.require_backward_grad_sync = False  # what DDP's model.no_sync() sets
    backward()
    assert seen == [doctor.BACKWARD_SYNC, doctor.BACKWARD_LOCAL, doctor.BACKWARD_LOCAL]


def test_asking_leaves_the_answers_to_other_ranks_requests_to_the_thread():
    """B2: ask() once marked every lower request answered, so another rank's request (a lower
    number, made at the same time) was never answered here: a false "not answering", exit 69."""
    import datetime
    import types

    import torch.distributed as dist

    from anyaccel.doctor import Doctor

    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    env = types.SimpleNamespace(rank=0, world_size=3, main_address="127.0.0.1", main_port=server.port)
    doc = Doctor(env, interval=0.05)
    try:
        store = dist.PrefixStore(doc._namespace, server)
        other = int(store.add("req", 1))  # rank 1 asks ...
        mine = doc.ask()  # ... and this rank asks right after, before its thread's next round
        assert mine == other + 1
        deadline = time.monotonic() + 10
        while not store.check([f"state/{other}/0"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.check([f"state/{other}/0"])  # rank 1's request is answered
    finally:
        doc._at_exit()
