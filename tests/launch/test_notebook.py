"""The single-process tests; the multi-process ones (real launches, marked slow) are in tests/launch/test_notebook_launcher_multiprocess.py.

`notebook_launcher` / `debug_launcher`: forked workers that really train as 2 CPU ranks.

A notebook session is played in a fresh Python process (tests/launch/launch_notebook_session.py),
so the pytest process's own state (threads, other tests' objects) cannot leak into the fork.
"""

import os
import sys

import pytest



def test_cuda_error_names_the_cause_and_the_fix(monkeypatch):
    from anyaccel.launch import notebook

    monkeypatch.setattr(notebook, "_live_accelerators", lambda: 0)
    monkeypatch.setattr("anyaccel.devices.cuda_initialized", lambda: True)
    with pytest.raises(notebook.LauncherError) as exc:
        notebook._check_parent(use_cpu=False)
    text = str(exc.value)
    assert "model.cuda()" in text and "restart the kernel" in text
    notebook._check_parent(use_cpu=True)  # CPU-only workers do not care


def test_tpu_goes_through_torch_xla_spawn(monkeypatch):
    """On a TPU the launch is torch-xla's spawn, behind anyaccel.backends.xla.spawn."""
    import types

    import anyaccel.backends  # noqa: F401 - the package is imported before its xla submodule is faked
    from anyaccel.launch import notebook

    calls = []

    class FakeXlaBackend:  # what anyaccel.backends.xla.XlaBackend does with a notebook function
        spawns_processes = True

        def __init__(self, env):
            pass

        def spawn(self, fn, args, nprocs):
            calls.append((fn, args, nprocs, dict(os.environ)))
            return "r0"

    fake = types.SimpleNamespace(XlaBackend=FakeXlaBackend)
    monkeypatch.setitem(sys.modules, "anyaccel.backends.xla", fake)
    monkeypatch.setattr(notebook, "resolve_environment", lambda env: types.SimpleNamespace(device_type="xla"),
                        raising=False)
    monkeypatch.setattr(notebook, "_check_parent", lambda use_cpu: None)

    def fn(x):
        return x

    assert notebook.notebook_launcher(fn, args=(3,), num_processes=8, mixed_precision="bf16") == "r0"
    (called,) = calls
    assert called[:3] == (fn, (3,), 8) and called[3]["ANYACCEL_MIXED_PRECISION"] == "bf16"
    assert "ANYACCEL_MIXED_PRECISION" not in os.environ or os.environ["ANYACCEL_MIXED_PRECISION"] != "bf16"


# --------------------------------------------------------------------------------------------
# The fast path (anyaccel.launch.forked): workers forked by the caller, no torch elastic agent.
# Each test forks two tiny workers from this process (no Accelerator, no process group): cheap.
# --------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fresh_process():
    """The fast path forks this process: no default process group an earlier test file of the
    same pytest(-xdist) worker left (the workers would inherit it), and Ctrl-C as a kernel has it."""
    import signal

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    import psutil

    _BASELINE.clear()  # processes an earlier test file of this worker left (a tracker's helper): not ours
    _BASELINE.update(p.pid for p in psutil.Process().children(recursive=True))
    yield
    signal.signal(signal.SIGINT, previous)


_BASELINE: set = set()


def _children():
    import psutil

    return [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in _BASELINE]


def test_fast_path_gives_the_agents_variables_and_returns_rank_zeros_value():
    from anyaccel.launch import forked, notebook

    def where():
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "ANYACCEL_AGENT_PID", "ANYACCEL_MIXED_PRECISION")
        return {k: os.environ.get(k) for k in keys}

    values = forked.run_forked(2, {"ANYACCEL_MIXED_PRECISION": "bf16"}, notebook._run_in_worker, where, ())
    got = values[0]
    assert (got["RANK"], got["LOCAL_RANK"], got["WORLD_SIZE"], got["LOCAL_WORLD_SIZE"]) == ("0", "0", "2", "2")
    assert got["MASTER_ADDR"] == "127.0.0.1" and int(got["MASTER_PORT"]) > 0
    assert got["TORCHELASTIC_USE_AGENT_STORE"] == "True" and got["TORCHELASTIC_RUN_ID"].startswith("anyaccel-")
    assert got["ANYACCEL_AGENT_PID"] == str(os.getpid()) and got["ANYACCEL_MIXED_PRECISION"] == "bf16"
    assert os.environ.get("ANYACCEL_MIXED_PRECISION") != "bf16" and _children() == []  # the caller's unchanged
    assert forked.rank_env(1, 2, 1234, "r")["RANK"] == "1"


def test_fast_path_reports_the_failed_rank_and_stops_the_others():
    """Rank 1 raises while rank 0 would sleep for a minute: the call raises within seconds with
    rank 1's traceback, and no worker survives it."""
    import signal
    import time

    from anyaccel.launch import forked, notebook
    from anyaccel.launch.elastic import JobFailed

    def failing():
        if os.environ["RANK"] == "1":
            raise ValueError("bad value on rank 1")
        time.sleep(60)

    before, handler = time.time(), signal.getsignal(signal.SIGINT)
    with pytest.raises(JobFailed) as exc:
        forked.run_forked(2, {}, notebook._run_in_worker, failing, ())
    assert time.time() - before < 30, "rank 0 was stopped, not waited for"
    report = exc.value.report
    assert "rank 1 of 2 failed" in report and "traceback of rank 1" in report
    assert "ValueError: bad value on rank 1" in report and "anyaccel/launch" not in report
    (failure,) = exc.value.failures
    assert failure.rank == 1 and repr(failure.exception()) == "ValueError('bad value on rank 1')"
    assert _children() == [] and signal.getsignal(signal.SIGINT) is handler


def test_fast_path_interrupt_stops_every_worker(tmp_path):
    """Ctrl-C in the notebook (SIGINT to the caller) while the workers run: KeyboardInterrupt, no survivors."""
    import signal
    import threading
    import time

    from anyaccel.launch import forked, notebook

    started = tmp_path / "started"

    def sleeper():
        started.write_text("1")
        time.sleep(60)

    def interrupt():
        for _ in range(3000):
            if started.exists():
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.01)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt, match="stopped by SIGINT; every worker was stopped"):
        forked.run_forked(2, {}, notebook._run_in_worker, sleeper, ())
    assert _children() == []
