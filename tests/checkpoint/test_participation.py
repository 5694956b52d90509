"""Who calls save_state/load_state (anyaccel/checkpoint/participation.py): the rules, and both sides
of the protocol over a real TCP store in one process (the other side in a thread; the hang doctor's
answers written by the test). The protocol with real processes is in
tests/compat/test_diffusers_shapes_multiprocess.py (tests/compat/participation_checks.py: uneven loaders,
a late rank of three, saves between accumulation micro-steps; two DDP processes saving on the main
process only; FSDP2's error)."""

from __future__ import annotations

import datetime
import json
import threading
import time
import types

import pytest
import torch.distributed as dist

from anyaccel.checkpoint import participation
from anyaccel.checkpoint.participation import _blocked, _Call, _decide, _follow, _problem, _Seen
from anyaccel.doctor import BACKWARD_LOCAL, BACKWARD_SYNC
from anyaccel.doctor.tracker import FORWARD_BUFFERS, FORWARD_SYNC
from anyaccel.errors import CheckpointError

SYNC = {"op": BACKWARD_SYNC, "counted": False}
COUNTS = {"syncs": 10, "forwards": 0}  # the waiting process's own counts


def test_a_process_is_not_calling_only_when_blocked_where_the_asker_never_joins_it():
    seq = 5  # the asker's count of collectives; COUNTS: its synchronising backward calls
    assert _blocked({"op": "gather", "counted": True, "seq": 6}, seq, COUNTS, None, None)  # one it never entered
    assert not _blocked({"op": "gather", "counted": True, "seq": 5}, seq, COUNTS, None, None)  # finishing one it did
    assert _blocked(dict(SYNC, syncs=11), seq, COUNTS, None, None)  # a sync backward the asker never ran
    assert not _blocked(dict(SYNC, syncs=10), seq, COUNTS, dict(SYNC, syncs=10), None)  # finishing the asker's last
    first = {"op": None, "syncs": 8}  # (fewer: DDP's join shadowed two of them for it)
    assert _blocked(dict(SYNC, syncs=9), seq, COUNTS, first, None)  # entered after the asker started waiting
    assert not _blocked(dict(SYNC, syncs=9), seq, COUNTS, dict(SYNC, syncs=9), None)  # one answer: maybe finishing
    assert _blocked(dict(SYNC, syncs=9), seq, COUNTS, dict(SYNC, syncs=9), dict(SYNC, syncs=9))  # still, a second on
    assert _blocked({"op": FORWARD_SYNC, "forwards": 3}, seq, COUNTS, {"forwards": 2}, None)  # FSDP2's all-gather
    # a DDP forward at the asker's count, over any number of answers: its broadcast is done (the asker's same
    # forward), the rest is the model's compute (a long evaluation forward): it still comes (ld37review)
    ddp = {"op": FORWARD_BUFFERS, "forwards": COUNTS["forwards"]}
    assert not _blocked(ddp, seq, COUNTS, ddp, dict(ddp))
    assert _blocked(dict(ddp, forwards=1), seq, COUNTS, None, None)  # one the asker never entered
    assert _blocked({"missing": True, "left": {"code": 0}}, seq, COUNTS, None, None)
    assert not _blocked({"missing": True, "left": None}, seq, COUNTS, None, None)  # not answering yet: ask again


def test_counts_of_batches_and_local_backwards_never_make_a_process_further_on():
    """B1: uneven loaders (even_batches=False), skipped accumulation syncs and an evaluation on one
    process make these counts differ at a point every process reaches."""
    seq, first = 5, {"op": None, "backwards": 3, "batches": 3, "syncs": 10}
    for state in ({"op": None, "seq": 5, "backwards": 40, "batches": 900, "syncs": 10},  # far ahead in batches
                  {"op": BACKWARD_LOCAL, "seq": 5, "backwards": 41, "syncs": 10},  # an accumulation micro-step
                  {"op": "save_state (waiting for process 0's answer)", "counted": False, "seq": 5, "backwards": 40}):
        assert not _blocked(state, seq, COUNTS, first, state), state


def test_seen_keeps_the_first_and_the_last_two_distinct_answers():
    seen = _Seen()
    seen.add({"op": None, "syncs": 1}, 1)
    seen.add({"op": BACKWARD_SYNC, "syncs": 2}, 2)
    seen.add({"op": BACKWARD_SYNC, "syncs": 2}, 2)  # the same request read again: not a second answer
    assert seen.first["syncs"] == 1 and seen.before["syncs"] == 1 and seen.last["_key"] == 2
    assert seen.blocked(5, COUNTS)  # grew after the asker started waiting


def test_what_stops_a_call_names_the_call_and_the_fix():
    away = {1: {"op": "backward (gradient all-reduce)", "stack": [{"file": "train.py", "line": 9, "code": "acc.backward(l)"}]}}
    call = _Call("save_state", "out/checkpoint-2", 0, 0, 0)
    sharded = _problem(call, {}, away, "fsdp")
    assert sharded.startswith("save_state('out/checkpoint-2') was called by the main process alone")
    assert "the 'fsdp' strategy keeps the model and optimizer state sharded" in sharded
    assert "move the call out of the `if accelerator.is_main_process:` block" in sharded
    assert "process 1: it is in backward (gradient all-reduce) at train.py:9 (`acc.backward(l)`)" in sharded
    assert _problem(call, {}, away, None) is None  # DDP: the main process saves alone
    assert _problem(call, {1: {"what": "save_state"}}, {}, "fsdp") is None  # everyone: collective
    mixed = _problem(_Call("save_state", None, 0, 0, 0), {1: {"what": "save_state"}},
                     {2: {"missing": True, "left": {"code": 1, "how": "x"}}}, None)
    assert mixed.startswith("save_state() was called by processes 0, 1 but not by the others (process 2: it left")
    other = _problem(_Call("save_state", "d", 0, 0, 0), {1: {"what": "load_state", "directory": "d"}}, {}, None)
    assert "process 1: load_state('d')" in other and "every process must make the same call" in other


def test_load_state_on_the_main_process_alone_loads_there_under_ddp_but_not_sharded_and_resume_is_refused():
    """As Accelerate under DDP: the main process loads alone (it warns, once: loaded_alone). A
    sharded state cannot be read by one process; resume() returns where every process's loop starts."""
    away = {1: dict(SYNC, stack=[{"file": "train.py", "line": 9, "code": "acc.backward(l)"}])}
    assert _problem(_Call("load_state", "ckpt", 0, 0, 0), {}, away, None) is None  # DDP: alone
    sharded = _problem(_Call("load_state", "ckpt", 0, 0, 0), {}, away, "fsdp")
    assert sharded.startswith("load_state('ckpt') was called by the main process alone")
    assert "every process must write and read its part. Call it on every process" in sharded
    resume = _problem(_Call("resume", None, 0, 0, 0), {}, away, None)
    assert resume.startswith("resume() was called by the main process alone") and "Call it on every process" in resume
    assert "process 1: it is in backward (gradient all-reduce) at train.py:9" in resume


def test_a_load_on_the_main_process_alone_warns_once_per_process_with_the_fix(monkeypatch):
    monkeypatch.setattr(participation, "_WARNED", {})
    with pytest.warns(UserWarning) as caught:
        participation.loaded_alone("out/checkpoint-4")
        participation.loaded_alone("out/checkpoint-6")
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith("load_state('out/checkpoint-4') was called by the main process alone")
    assert "The other processes keep their weights: DDP broadcasts parameters only when it wraps the model" in message
    assert "Call load_state on every process" in message


def test_one_process_and_no_store_take_the_usual_path():
    assert participation.alone("save_state", "d", 0, 1, None) is False
    ddp = types.SimpleNamespace(checkpoint_format="full", collective_state_dict=False)
    fsdp = types.SimpleNamespace(checkpoint_format="sharded", collective_state_dict=True)
    full_fsdp = types.SimpleNamespace(checkpoint_format="full", collective_state_dict=True)
    assert participation.full_state_on_main(ddp)
    assert not participation.full_state_on_main(fsdp) and not participation.full_state_on_main(full_fsdp)


# ---- both sides over a real store ---------------------------------------------------------------------
class Doctor:
    """What participation asks of the process's hang doctor, answering with ``states`` (rank ->
    state, or a callable of the request number) and publishing ``main`` (the main process's
    state, for a watcher)."""

    def __init__(self, store, states=None, main=None, alive=True):
        self._store, self.states, self.main, self.alive = store, states or {}, main, alive
        self.asked = 0
        self.watchers = 0

    def store(self):
        return self._store

    def ask(self):
        self.asked += 1
        return self.asked

    def answers(self, generation):
        states = self.states(generation) if callable(self.states) else self.states
        return {r: dict(s, rank=r) for r, s in states.items()}

    def watch_main(self, on):
        self.watchers += 1 if on else -1

    def main_state(self):
        return self.main() if callable(self.main) else self.main


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
    yield dist.PrefixStore("test/", server)


def follow_in_thread(doctor, store, call, rank=1):
    outcome = {}

    def run():
        try:
            _follow(doctor, store, call, rank)
            outcome["ok"] = True
        except CheckpointError as exc:
            outcome["error"] = str(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_late_process_is_waited_for_and_the_call_is_collective(store):
    """One rank of three arrives after the main process has asked twice where it is (it was
    evaluating, or simply slow): the main process waits, whatever its counts say."""
    call = _Call("save_state", "ckpt", 7, 10, 0)
    busy = {1: {"op": None, "seq": 7, "backwards": 99, "batches": 500, "syncs": 10},
            2: {"op": BACKWARD_LOCAL, "seq": 7, "backwards": 11, "syncs": 10}}
    doctor = Doctor(store, busy, main={"op": "save_state (finding out which processes call it)", "round": 1})
    first, _ = follow_in_thread(doctor, store, _Call("save_state", "ckpt", 7, 99, 0), rank=2)
    followers = []
    late = threading.Timer(1.5, lambda: followers.append(
        follow_in_thread(doctor, store, _Call("save_state", "ckpt", 7, 11, 0), rank=1)[0]))
    late.start()
    assert _decide(doctor, store, call, 3, None) is False  # everyone calls: the collective protocol
    assert doctor.asked >= 2
    first.join(5)
    late.join(5)
    for thread in followers:  # (the late one withdraws its key when its wait ends: wait for that, not for luck)
        thread.join(5)
    assert not store.check(["ckpt/arrived/1"]) and not store.check(["ckpt/arrived/2"])  # keys are reused, not kept
    assert not store.check(["ckpt/decision/1"]) and not store.check(["ckpt/decision/2"])


def test_the_main_process_saves_alone_once_the_others_are_blocked_in_their_next_sync_backward(store):
    call = _Call("save_state", "ckpt", 7, 10, 0)
    doctor = Doctor(store, lambda g: {1: {"op": BACKWARD_LOCAL, "seq": 7, "syncs": 10} if g < 2 else
                                          dict(SYNC, seq=7, syncs=10)})  # (10: uneven, join shadowed one)
    assert _decide(doctor, store, call, 2, None) is True
    doctor.states = {1: {"op": "gather", "counted": True, "seq": 8, "backwards": 10}}
    assert _decide(doctor, store, call, 2, None) is True  # a collective it entered alone


def test_a_process_waiting_ignores_the_main_processs_batches_and_raises_only_when_it_is_blocked_ahead(store):
    call = _Call("save_state", "ckpt", 7, 10, 0)
    doctor = Doctor(store, main={"op": None, "seq": 7, "backwards": 90, "syncs": 10, "batches": 10_000, "round": 1})
    thread, outcome = follow_in_thread(doctor, store, call)
    time.sleep(0.5)
    assert thread.is_alive() and doctor.watchers == 1  # the main process evaluates on its own: wait
    doctor.main = dict(SYNC, seq=7, syncs=11, round=2)  # it went on into the next sync backward
    thread.join(5)
    assert "was called on process 1 but not on the main process (it is in backward (gradient all-reduce))" in \
        outcome["error"]
    assert not store.check(["ckpt/arrived/1"]) and doctor.watchers == 0  # withdrawn: a later call cannot see it


def test_an_answer_is_for_one_call_and_a_refused_caller_cannot_be_taken_later(store):
    """N1: the arrival names the call (point, directory); the answer echoes the caller's nonce."""
    call = _Call("save_state", "ckpt-2", 7, 10, 0)
    store.set("ckpt/decision/1", json.dumps({"nonce": "another call", "error": "stale"}))
    doctor = Doctor(store, {1: {"op": None, "seq": 7}}, main={"op": None, "round": 1})
    thread, outcome = follow_in_thread(doctor, store, call)
    assert _decide(doctor, store, call, 2, None) is False
    thread.join(5)
    assert outcome == {"ok": True}
    # under a sharded strategy a different directory at the same point is another call: both raise
    thread, outcome = follow_in_thread(doctor, store, _Call("save_state", "ckpt-3", 7, 10, 0))
    with pytest.raises(CheckpointError, match=r"process 1: save_state\('ckpt-3'\).*the same directory"):
        _decide(doctor, store, call, 2, "fsdp")
    thread.join(5)
    assert "(raised on process 1 too)" in outcome["error"]


def test_a_stopped_hang_doctor_or_a_failing_store_is_an_error_never_a_wait(store):
    """R1: the main process's doctor thread has ended: the ones that arrived get the error too."""
    doctor = Doctor(store, {}, main={"op": None, "round": 1}, alive=False)
    thread, outcome = follow_in_thread(doctor, store, _Call("save_state", "c", 7, 10, 0), rank=1)
    while not store.check(["ckpt/arrived/1"]):
        time.sleep(0.01)
    with pytest.raises(CheckpointError, match=r"its hang doctor has stopped .* processes \[2\] call it too"):
        _decide(doctor, store, _Call("save_state", "c", 7, 10, 0), 3, None)
    thread.join(5)
    assert "its hang doctor has stopped" in outcome["error"]

    class Broken:
        def __getattr__(self, name):
            raise RuntimeError("Connection reset by peer")

    import anyaccel.doctor as doctor_module

    real = doctor_module._DOCTOR["value"]
    doctor_module._DOCTOR["value"] = types.SimpleNamespace(store=lambda: Broken())
    try:
        with pytest.raises(CheckpointError, match=r"save_state\('c'\) on process 0: the job's store failed .*Connection "
                                                  r"reset by peer"):
            participation.alone("save_state", "c", 0, 2, None)
    finally:
        doctor_module._DOCTOR["value"] = real


def test_a_waiting_process_whose_main_process_doctor_is_silent_raises(store, monkeypatch):
    monkeypatch.setattr(participation, "_MAIN_SILENT", 0.3)
    doctor = Doctor(store, main=None)
    with pytest.raises(CheckpointError, match="the main process's hang doctor has not published where it is"):
        _follow(doctor, store, _Call("load_state", "c", 1, 0, 0), 1)
    assert not store.check(["ckpt/arrived/1"])


class CountingStore:
    """A real store that counts the reads made through it (``check``/``get``)."""

    def __init__(self, store):
        self._store, self.reads = store, 0

    def check(self, keys):
        self.reads += 1
        return self._store.check(keys)

    def get(self, key):
        self.reads += 1
        return self._store.get(key)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_waiting_process_reads_the_store_at_growing_intervals_up_to_one_a_second(store, monkeypatch):
    """N waiting processes must not flood the main process's store: over 10 s of waiting (a
    virtual clock: the count is exact) a process checks for its answer and reads the main
    process's state 18 times each (at 0, 0.005, 0.015, ... 0.635, 1.275 s, then every second until
    the main process is seen blocked ahead at 10.275 s: the first reads come within milliseconds, for
    a save by every process), where polling every 50 ms made it over 200."""
    clock = {"now": 0.0}
    monkeypatch.setattr(participation, "time", types.SimpleNamespace(
        monotonic=lambda: clock["now"], monotonic_ns=lambda: int(clock["now"] * 1e9),
        sleep=lambda s: clock.update(now=clock["now"] + s)))
    reads_of_main = []

    def main_state():  # the main process goes on into its next sync backward after 10 s: the waiter raises
        reads_of_main.append(clock["now"])
        published = int(clock["now"])  # its doctor publishes a new round every second
        return dict(SYNC, seq=1, syncs=1, round=published) if clock["now"] >= 10 else {"op": None, "round": published}

    counting = CountingStore(store)
    with pytest.raises(CheckpointError, match="but not on the main process"):
        _follow(Doctor(counting, main=main_state), counting, _Call("load_state", "c", 1, 0, 0), 1)
    assert [round(t, 3) for t in reads_of_main[:10]] == [0, 0.005, 0.015, 0.035, 0.075, 0.155, 0.315, 0.635, 1.275, 2.275]
    assert len(reads_of_main) == 18 and counting.reads == 18  # one check of the answer per read of the main's state


def test_a_collective_inside_a_call_the_main_process_runs_alone_raises_instead_of_waiting():
    """A save/load pre-hook calling gather or wait_for_everyone while the main process saves or
    loads alone: the others went on, so it would wait for ever."""
    from anyaccel import doctor
    from anyaccel.doctor import TRACKER

    seq = TRACKER.seq
    with participation.by_itself(True, "load_state", "out/checkpoint-4"):
        with pytest.raises(CheckpointError, match=r"^gather \(a collective\) was called during load_state\("
                                                  r"'out/checkpoint-4'\), which the main process runs alone"):
            with doctor.waiting("gather"):
                pass
        with doctor.waiting("backward (gradient all-reduce)", count=False):  # not an anyaccel collective
            pass
    assert TRACKER.alone is None and TRACKER.seq == seq
    with participation.by_itself(False, "load_state", None), doctor.waiting("gather"):  # every process: as usual
        assert TRACKER.op == "gather"
    assert TRACKER.seq == seq + 1


def test_a_ddp_forward_that_broadcasts_buffers_is_marked_for_the_doctor_and_counted():
    """The others of a main-only save_state/load_state wait in their next training forward when
    the model has buffers (DDP broadcasts them from rank 0 first): the doctor must see it, or the
    main process waits for ever. Only the forwards DDP makes collective are marked (a group of one
    process here: DDP decides the same way)."""
    import torch
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    from anyaccel.doctor import TRACKER
    from anyaccel.doctor.tracker import FORWARD_BUFFERS, mark_forward_sync
    from anyaccel.strategies.ddp import mark_buffer_broadcasts

    class Model(torch.nn.Module):
        def __init__(self, buffer):
            super().__init__()
            self.linear, self.seen = torch.nn.Linear(2, 1), []
            if buffer:
                self.register_buffer("scale", torch.ones(1))

        def forward(self, x):
            self.seen.append(TRACKER.op)
            return self.linear(x) * getattr(self, "scale", 1.0)

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for buffer in (True, False):
            inner = Model(buffer)
            model = DistributedDataParallel(inner)
            mark_buffer_broadcasts(model)
            at_start = []  # what the doctor sees at the wrapper's start (its broadcast comes next)
            model.register_forward_pre_hook(lambda module, args: at_start.append(TRACKER.op))
            before = TRACKER.forwards
            model(torch.ones(3, 2)).sum().backward()  # a training forward (the first broadcasts)
            with torch.no_grad():
                model(torch.ones(3, 2))  # after a training forward: broadcasts too
            model(torch.ones(3, 2)).sum().backward()  # after a no_grad forward: DDP does not broadcast
            marked = [op == FORWARD_BUFFERS for op in at_start]
            assert marked == ([True, True, False] if buffer else [False, False, False]), (buffer, at_start)
            assert TRACKER.forwards - before == sum(marked) and TRACKER.op is None
            # the model's own compute is no wait (a long evaluation forward is not a blocked process)
            assert inner.seen == [None, None, None] and not inner._forward_pre_hooks, inner.seen
            # without buffers only Join makes a forward wait: no hook until a Join takes the model in
            assert len(model._forward_pre_hooks) == (2 if buffer else 1), model._forward_pre_hooks
            with Join([model]):
                model(torch.ones(3, 2)).sum().backward()  # Join's notice: every forward waits
            assert at_start[-1] == FORWARD_BUFFERS and TRACKER.op is None, at_start
            assert TRACKER.forwards - before == sum(marked) + 1
        inner = Model(True)  # broadcast_buffers=False: DDP never broadcasts, nothing is marked
        model = DistributedDataParallel(inner, broadcast_buffers=False)
        mark_buffer_broadcasts(model)
        model.register_forward_pre_hook(lambda module, args: inner.seen.append(TRACKER.op))
        model(torch.ones(3, 2)).sum().backward()
        with torch.no_grad():
            model(torch.ones(3, 2))
        assert inner.seen == [None, None, None, None], inner.seen
        # compiled, whole graph: Dynamo never traces the hooks' clock (a compiled forward is not marked)
        inner = Model(False)
        mark_forward_sync(inner)
        before = TRACKER.forwards
        torch.compile(inner, backend="eager", fullgraph=True)(torch.ones(3, 2))
        assert TRACKER.forwards == before and TRACKER.op is None
    finally:
        if made and dist.is_initialized():
            dist.destroy_process_group()
