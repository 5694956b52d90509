"""The doctor names a peer whose connection dropped without it leaving the job (a SIGKILLed
process, a dead machine) from the address in gloo's error and the address every rank publishes.
Real TCP store; the peers' entries are written as their doctors write them. The two-host version
runs in tests/cluster/test_faults.py (fault c)."""

from __future__ import annotations

import datetime
import json
import time
import types

import pytest

GLOO = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [{}]:21178: Connection reset by peer. "
        "This is typically caused by a remote worker hanging or bugs in the application.")


@pytest.fixture
def doctor():
    import torch.distributed as dist

    from anyaccel import doctor as module

    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    env = types.SimpleNamespace(rank=0, world_size=3, main_address="127.0.0.1", main_port=server.port)
    doc = module.Doctor(env, interval=0.01)
    store = dist.PrefixStore(doc._namespace, server)
    store.set("host/1", json.dumps({"host": "node-b", "pid": 41, "addr": "192.0.2.11"}))
    store.set("host/2", json.dumps({"host": "node-c", "pid": 42, "addr": "192.0.2.12"}))
    deadline = time.monotonic() + 10
    while doc.store() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    saved, module._DOCTOR["value"] = module._DOCTOR["value"], doc
    yield doc
    module._DOCTOR["value"] = saved
    doc._at_exit()


def test_a_reset_connection_names_the_rank_host_and_pid_at_that_address(doctor):
    from anyaccel.doctor import explain
    from anyaccel.errors import PeerExitedError

    err = explain(RuntimeError(GLOO.format("192.0.2.12")), "all_reduce")
    assert isinstance(err, PeerExitedError)
    assert "rank 2 (pid 42) on node-c (192.0.2.12) dropped its connection without leaving the job" in str(err)
    assert "rank 1" not in str(err)


def test_an_unknown_address_or_another_error_is_left_as_it_was(doctor):
    from anyaccel.doctor import explain

    for exc in (RuntimeError(GLOO.format("192.0.2.99")), RuntimeError(GLOO.format(doctor.address)),
                RuntimeError("[gloo] Timed out waiting 1800000ms for recv operation [192.0.2.12]:1")):
        assert explain(exc, "all_reduce") is exc


def test_an_anyaccel_error_raised_in_backward_is_not_rewritten_as_a_peer_that_left(doctor):
    """A replica group whose history is not kept raises FaultToleranceError from backward on every
    rank; a rank whose peer had already exited got "rank N left the job" instead of the reason
    (ftreview). anyaccel's own errors are raised as they are; a gloo error is still explained."""
    from anyaccel.doctor import raise_explained
    from anyaccel.errors import FaultToleranceError, PeerExitedError

    doctor.peers_that_left = lambda: [{"rank": 1, "code": 1, "how": "exited", "seq": 7}]
    raise_explained(FaultToleranceError("replica group 1: the replica groups of this quorum hold 2 ..."), "backward")
    with pytest.raises(PeerExitedError, match="rank 1 left the job with exit code 1"):
        raise_explained(RuntimeError(GLOO.format("192.0.2.11")), "backward")
    # one that wraps a gloo error (a group's backward that raised, then could not send its step): kept, with
    # what the doctor knows of its cause added
    try:
        raise FaultToleranceError("replica group 0, rank 0: its backward raised ...") from RuntimeError(GLOO.format("x"))
    except FaultToleranceError as wrapped:
        raise_explained(wrapped, "backward")
        assert str(wrapped).startswith("replica group 0, rank 0: its backward raised ... (rank 1 left the job")
