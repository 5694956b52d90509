"""`anyaccel launch` end to end: real worker processes (gloo on CPU) started by torch's elastic agent.

Training really happens in 2 ranks, two jobs share a machine, two launches form one 2-machine
group equal to one process with the combined batch, and a failing, killed or interrupted job
stops every process within seconds and reports the failing rank's traceback once.
"""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import SCRIPTS, alive_after, clean_env

pytestmark = pytest.mark.slow

TRAIN = str(SCRIPTS / "launch_train.py")
FAIL = str(SCRIPTS / "launch_fail.py")
TIMEOUT = 180


def launch(*args, env=None, timeout=TIMEOUT, **popen):
    cmd = [sys.executable, "-m", "anyaccel.cli", "launch", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or clean_env(), **popen)


def start(*args, env=None):
    cmd = [sys.executable, "-m", "anyaccel.cli", "launch", *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or clean_env(),
                            start_new_session=True)  # fmt: skip


def ranks(out, n=2):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def pids(out):
    return {p.name: int(p.read_text()) for p in out.glob("pid*")}


def assert_gone(pid_values, within=10.0):
    left = alive_after(list(pid_values), within)
    assert not left, f"processes left behind: {left}"


def wait_for_files(out, names, proc, timeout=TIMEOUT):
    deadline = time.time() + timeout
    while not all((out / n).exists() for n in names):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "workers did not start"
        time.sleep(0.1)


def test_two_cpu_ranks_train_on_disjoint_shards_while_a_second_job_shares_the_machine(tmp_path):
    """Two launches at once, neither given a port (no collision); the second runs a module (-m)."""
    env = clean_env(PYTHONPATH=f"{os.path.dirname(TRAIN)}{os.pathsep}{clean_env()['PYTHONPATH']}")  # launch_train.py's folder
    other = start("--cpu", "--num_processes", "2", "-m", "launch_train", "--out", tmp_path / "b", "--epochs", "1", env=env)
    proc = launch("--cpu", "--num_processes", "2", "--mixed_precision", "bf16", TRAIN, "--out", tmp_path / "a",
                  "--batch", "8", "--lr=3", "--", "-x", "--num_processes", "9")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    r0, r1 = ranks(tmp_path / "a")
    assert [r0["rank"], r1["rank"]] == [0, 1] and r0["world"] == r1["world"] == 2
    assert r0["distributed_type"] == "MULTI_CPU" and r0["source"] == "torchrun"
    assert not set(r0["seen"]) & set(r1["seen"]), "each rank trains on its own share"
    assert sorted(r0["seen"] + r1["seen"]) == list(range(64))
    for r in (r0, r1):
        assert sorted(r["gathered"]) == list(range(37)), "gather_for_metrics counts every sample exactly once"
        assert r["argv"] == ["--out", str(tmp_path / "a"), "--batch", "8", "--lr=3", "--", "-x", "--num_processes", "9"]
        assert r["mixed_precision"] == "bf16" and r["env"]["ANYACCEL_USE_CPU"] == "1" and r["omp"] == "1"
    assert r0["weights"] == r1["weights"], "DDP keeps the replicas identical"
    assert "Traceback" not in proc.stderr

    _, err = other.communicate(timeout=TIMEOUT)
    assert other.returncode == 0, err
    b0, b1 = ranks(tmp_path / "b")
    assert b0["world"] == 2 and sorted(b0["seen"] + b1["seen"]) == list(range(64))


def test_two_machines_form_one_group_equal_to_one_process_with_the_combined_batch(tmp_path, free_port):
    port = free_port()
    common = ["--cpu", "--num_machines", "2", "--num_processes", "2", "--main_process_ip", "127.0.0.1",
              "--main_process_port", port]  # fmt: skip
    machines = [start(*common, "--machine_rank", r, TRAIN, "--out", tmp_path / "two", "--batch", "8") for r in (0, 1)]
    single = subprocess.run([sys.executable, TRAIN, "--out", tmp_path / "one", "--batch", "16"],
                            capture_output=True, text=True, timeout=TIMEOUT, env=clean_env())  # fmt: skip
    assert single.returncode == 0, single.stderr
    for proc in machines:
        out, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, err
    r0, r1 = ranks(tmp_path / "two")
    (one,) = ranks(tmp_path / "one", 1)
    assert (r0["node_rank"], r1["node_rank"], r0["world"], one["world"]) == (0, 1, 2, 1)
    assert not set(r0["seen"]) & set(r1["seen"])
    for key, value in one["weights"].items():
        assert r0["weights"][key] == pytest.approx(value, abs=1e-5), key
    assert r1["weights"] == r0["weights"]


@pytest.mark.torch_versions  # the only run on torch 2.9 of what elastic.py hands torch's c10d rendezvous (is_host, local_addr)
@pytest.mark.slow
def test_two_machines_on_the_c10d_rendezvous_meet_at_the_main_address(tmp_path, free_port):
    """--rdzv_backend c10d with --main_process_ip a real interface address: machine 0 hosts the
    store (torch's host-name guess made neither machine host it where the name resolves to
    127.0.0.1), the workers' MASTER_ADDR is an address, not this host's name, and gloo binds the
    interface that routes to the main address where the host name resolves to loopback."""
    import socket

    from anyaccel import network

    address = network.source_address("10.254.254.254")  # this machine's address on its default route
    if not address or address.startswith("127."):
        pytest.skip("no network interface besides loopback")
    common = ["--cpu", "--num_machines", "2", "--num_processes", "2", "--main_process_ip", address,
              "--main_process_port", free_port(), "--rdzv_backend", "c10d"]  # fmt: skip
    machines = [start(*common, "--machine_rank", r, TRAIN, "--out", tmp_path, "--batch", "8") for r in (0, 1)]
    for proc in machines:
        out, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, err
    r0, r1 = ranks(tmp_path)
    assert r0["world"] == r1["world"] == 2 and sorted((r0["node_rank"], r1["node_rank"])) == [0, 1]
    assert r0["master_addr"] == r1["master_addr"] == address
    if network.resolves_to_loopback(socket.gethostname()):  # gloo would tell its peers 127.0.x.x
        assert r0["gloo_socket_ifname"] == r1["gloo_socket_ifname"] == network.interface_of(address)
    assert r1["weights"] == r0["weights"]


@pytest.mark.torch_versions
def test_a_raising_rank_stops_the_job_and_is_reported_once(tmp_path):
    t0 = time.time()
    proc = launch("--cpu", "--num_processes", "2", FAIL, "raise", tmp_path)
    failed_at = float((tmp_path / "failed_at").read_text())
    assert proc.returncode == 1
    # the waiting rank would sleep 120 s: stopped long before (the bound is loose for a loaded machine)
    assert time.time() - failed_at < 60, "the waiting rank was stopped, not waited out"
    err = proc.stderr
    assert "rank 1 of 2 failed" in err and "RuntimeError: deliberate failure on rank 1" in err
    assert err.count("Traceback (most recent call last)") == 1, err
    assert err.count('in fail_here') == 1
    # rank 0's own error says why: the doctor names the rank that left (or, if rank 1's exit was not
    # published yet when rank 0's collective broke, the report says rank 1 most likely failed first)
    assert "rank 0 also failed" in err
    assert "PeerExitedError: rank 1 left the job with exit code 1" in err or "because rank 1 failed first" in err
    assert "anyaccel/launch" not in err and "torch/distributed/elastic" not in err, "no launcher traceback"
    assert_gone(pids(tmp_path).values(), within=1)
    assert time.time() - t0 < TIMEOUT


@pytest.mark.torch_versions
def test_a_killed_rank_stops_the_others_within_seconds(tmp_path):
    proc = launch("--cpu", "--num_processes", "2", FAIL, "kill", tmp_path)
    stopped = time.time()
    assert proc.returncode == 1
    assert stopped - float((tmp_path / "failed_at").read_text()) < 60  # the others would run 120 s: stopped
    assert "rank 1 of 2 failed" in proc.stderr and "killed by SIGKILL" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert_gone(pids(tmp_path).values(), within=1)


@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.torch_versions),
                                 signal.SIGKILL])  # SIGTERM: torch's agent stops; SIGKILL is anyaccel's own
# (SIGTERM on torch 2.9 too: the only check that torch's TCPStore serves on loopback only from master_listen_fd)
def test_a_signal_to_the_launcher_stops_every_worker(tmp_path, sig):
    """SIGINT/SIGTERM: the agent stops the workers and exits 128+N. SIGKILL cannot be handled:
    the workers asked Linux to SIGKILL them when the launcher dies (no orphans)."""
    proc = start("--cpu", "--num_processes", "2", FAIL, "hang", tmp_path)
    wait_for_files(tmp_path, ["pid0-0", "pid1-0"], proc)
    workers = list(pids(tmp_path).values())
    if sig == signal.SIGTERM:  # while it runs: the rendezvous store listens on loopback only
        family = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)} | {proc.pid}
        listening = [c.laddr for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.pid in family]
        assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
    sent = time.time()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert time.time() - sent < 10
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        assert_gone(workers, within=5)
        return
    assert proc.returncode == 128 + sig, err
    assert f"stopped by {sig.name}" in err and "Traceback" not in err
    assert_gone(workers + [proc.pid], within=2)


@pytest.mark.torch_versions
def test_max_restarts_restarts_the_whole_group(tmp_path):
    proc = launch("--cpu", "--num_processes", "2", "--max_restarts", "1", FAIL, "restart", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "attempt 1 rank 0 all_reduce ok" in proc.stdout and "attempt 1 rank 1 all_reduce ok" in proc.stdout
    assert "rank 1 failed on attempt 1; the launcher restarts the job" in proc.stderr
    assert "; starting the workers again (restart 1 of 1)" in proc.stderr
    assert set(pids(tmp_path)) == {"pid0-0", "pid1-0", "pid0-1", "pid1-1"}


