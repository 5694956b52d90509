"""What an Accelerator starts is owned by its Runtime and released by end_training() or garbage
collection: doctor subscriptions, signal handlers; two accelerators keep their own hang_timeout."""

from __future__ import annotations

import datetime
import gc
import signal
import types
import weakref

import torch



def _prepared(**kwargs):
    from anyaccel import Accelerator

    acc = Accelerator(cpu=True, **kwargs)
    acc.prepare(torch.utils.data.DataLoader(torch.arange(8), batch_size=2))  # installs the preemption handler
    return acc


def test_a_collected_accelerator_leaves_no_signal_handler_and_is_really_collected(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    acc = _prepared(project_dir=str(tmp_path))
    assert signal.getsignal(signal.SIGTERM) == acc._preemption._on_signal
    alive = weakref.ref(acc)
    del acc
    gc.collect()
    assert alive() is None  # neither the signal module nor the doctor keeps it
    assert signal.getsignal(signal.SIGTERM) is before
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_end_training_puts_the_previous_handlers_back_and_is_idempotent(tmp_path):
    mine = lambda signum, frame: None  # noqa: E731 - the user's own handler, there before
    old = signal.signal(signal.SIGUSR1, mine)
    try:
        acc = _prepared(project_dir=str(tmp_path))
        assert signal.getsignal(signal.SIGUSR1) == acc._preemption._on_signal
        acc.end_training()
        acc.end_training()
        assert signal.getsignal(signal.SIGUSR1) is mine and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert acc._runtime.closed
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_many_accelerators_in_a_loop_do_not_accumulate(tmp_path):
    from anyaccel import accelerator

    gc.collect()
    start = len(accelerator._live_instances)
    for _ in range(15):
        acc = _prepared(project_dir=str(tmp_path))
    del acc
    gc.collect()
    assert len(accelerator._live_instances) == start
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _doctor():
    import torch.distributed as dist

    from anyaccel.doctor import Doctor

    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    env = types.SimpleNamespace(rank=0, world_size=2, main_address="127.0.0.1", main_port=server.port)
    return server, Doctor(env, interval=0.01)


def test_two_subscribers_keep_their_own_hang_timeout_and_closing_releases_them():
    server, doc = _doctor()
    try:
        calls = []
        a = doc.subscribe(5, poll=lambda store: calls.append("a"))
        b = doc.subscribe(50, poll=lambda store: calls.append("b"))
        c = doc.subscribe(0)  # reports off for this owner: does not turn them off for the others
        assert (a.hang_timeout, b.hang_timeout, c.hang_timeout) == (5, 50, 0)
        assert doc.hang_timeout == 5  # the most impatient live owner
        a.close()
        a.close()
        assert doc.hang_timeout == 50 and b.hang_timeout == 50 and len(doc.subscriptions) == 2
        b.close()
        c.close()
        assert doc.subscriptions == [] and doc.hang_timeout == 0
        calls.clear()
        import time

        time.sleep(0.2)
        assert calls == []  # a closed subscription's poll never runs again
    finally:
        doc._at_exit()


def test_a_subscriber_arriving_after_the_store_was_lost_falls_back_at_once():
    server, doc = _doctor()
    doc._at_exit()  # the thread has stopped: nobody will poll for a new subscriber
    lost = []
    doc.subscribe(5, on_lost=lambda: lost.append(1))
    assert lost == [1]
