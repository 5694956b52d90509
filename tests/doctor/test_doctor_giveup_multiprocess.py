"""The hang doctor's giving-up rules (anyaccel/doctor/giveup.py), each in a fresh process: a rank
that waits in a collective while a peer never answers, or while the job's store is gone, is ended
with exit 69 and a message naming what cannot be reached, instead of waiting for the process
group's 30-minute timeout."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, clean_env

_WAITER = textwrap.dedent("""
    import datetime, sys, time, types
    import torch.distributed as dist
    from anyaccel import doctor

    port = int(sys.argv[1]) if len(sys.argv) > 1 else None
    server = None
    if port is None:  # this process hosts the store; rank 1 never shows up
        server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10),
                               wait_for_workers=False)
        port = server.port
    env = types.SimpleNamespace(rank=0, world_size=2, main_address="127.0.0.1", main_port=port)
    doc = doctor.Doctor(env, interval=0.05)
    doc.subscribe(0.5)
    while doc._store is None:
        time.sleep(0.01)
    print("CONNECTED", flush=True)
    doctor.TRACKER.enter("reduce")  # the main thread now waits in a collective that cannot complete
    time.sleep(60)
    print("NOT ENDED", flush=True)
""")


def _run(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _WAITER, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=clean_env(**env))


@pytest.mark.slow
def test_a_peer_silent_at_two_reports_in_a_row_ends_the_waiting_rank(tmp_path):
    error_file = tmp_path / "error.json"  # as under a launcher: the failure it shows for this rank
    proc = _run(TORCHELASTIC_ERROR_FILE=str(error_file))
    assert proc.returncode == 69, proc.stdout + proc.stderr
    assert "giving up: rank 1 (host unknown) has not answered" in proc.stderr
    assert "in reduce (collective #1)" in proc.stderr and "NOT ENDED" not in proc.stdout
    recorded = json.loads(error_file.read_text())["message"]["message"]  # not "exited without a Python exception"
    assert recorded.startswith("CollectiveTimeoutError: the hang doctor ended rank 0") and \
        "rank 1 (host unknown) has not answered" in recorded, recorded


@pytest.mark.slow
def test_a_store_that_is_gone_ends_the_waiting_rank_naming_machine_0(tmp_path):
    store = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import datetime, time
        import torch.distributed as dist
        s = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
        print(s.port, flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True, env=clean_env())
    try:
        port = store.stdout.readline().strip()
        error_file = tmp_path / "error.json"  # as under a launcher: the failure it shows for this rank
        waiter = subprocess.Popen([sys.executable, "-c", _WAITER, port], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                  env={**clean_env(), "TORCHELASTIC_ERROR_FILE": str(error_file)})
        assert waiter.stdout.readline().strip() == "CONNECTED"
        store.kill()  # machine 0 is gone while rank 0 waits
        out, err = waiter.communicate(timeout=120)
    finally:
        store.kill()
    assert waiter.returncode == 69, out + err
    assert f"giving up: the job's store on machine 0 (127.0.0.1:{port}) has not answered" in err
    assert "in reduce (collective #1): machine 0 is unreachable or gone" in err
    recorded = json.loads(error_file.read_text())["message"]["message"]  # not "exited without a Python exception"
    assert recorded.startswith("PeerExitedError: the hang doctor ended rank 0") and \
        f"store on machine 0 (127.0.0.1:{port}) has not answered" in recorded, recorded
