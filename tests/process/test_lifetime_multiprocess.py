"""A job that finishes must end (issue 29): the groups over a process's life, its forks, its end
under a bound, and no process of the job left behind — real processes through `anyaccel launch`.

The soak (many fresh jobs of the canonical shapes) is tests/soak/test_soak_multiprocess.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import CONSOLE_SCRIPT, SCRIPTS, alive, alive_after, anyaccel, clean_env, launch_checks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    return launch_checks("lifetime_checks.py", tmp_path_factory.mktemp("lifetime"), warm=False)  # lifetime: a real launch


def test_end_training_keeps_the_group_and_a_second_accelerator_trains_on_it(checks):
    for r in checks:
        assert r["group_kept_after_end_training"]
        assert r["second_reuses_the_group"]
        assert r["first_loss"] == r["first_loss"] and r["second_loss"] == r["second_loss"]  # finite, trained
    assert checks[0]["second_loss"] == checks[1]["second_loss"]  # reduced: the same on both ranks


def test_gloo_workers_are_seen_idle_after_the_last_collective(checks):
    import torch

    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    expected = (True,) if version >= (2, 13) else (True, None)  # torch 2.13 names gloo's worker threads
    assert all(r["workers_idle_after_end_training"] in expected for r in checks)


def test_a_group_left_as_accelerate_scripts_do_is_joined_anew(checks):
    """PartialState().destroy_process_group(), then a new Accelerator: a new group on its own store
    prefix (the old keys sent gloo to the old sockets: the join hung), which really works."""
    for r in checks:
        assert r["left"] and r["third_joined_a_new_group"]
        assert r["third_gather"] == [0, 1]
    assert checks[0]["third_loss"] == checks[1]["third_loss"]


def test_forked_children_die_with_their_rank_and_forget_its_doctor(checks):
    for r in checks:
        workers = r["loader_workers"]
        assert len(workers) == 2 and len({w["pid"] for w in workers}) == 2  # this rank's share, one item per worker
        assert all(w["pdeathsig"] == r["sigkill"] and w["doctor_forgotten"] and w["parent_is_rank"] for w in workers)
        assert r["fork_child"] == {"pdeathsig": r["sigkill"], "doctor_forgotten": True}


# --------------------------------------------------------------------------------------------
# No process of the job outlives it
# --------------------------------------------------------------------------------------------


def _family(out: Path) -> list:
    pids = []
    for r in range(2):
        f = json.loads((out / f"family{r}.json").read_text())
        pids += [f["rank"], f["fork"], f["subprocess"], *f["dataloader_workers"]]
    return pids




@pytest.mark.parametrize("how", ["finish", "SIGTERM", "SIGKILL"])
def test_every_process_of_the_job_ends_with_the_launcher(tmp_path, how):
    """Each rank leaves persistent DataLoader workers, a plain fork and a `subprocess` program in
    a session of its own behind; none of them outlives the launch, whether the job finishes, the
    launcher is signalled, or the launcher is SIGKILLed (then the guardian and PR_SET_PDEATHSIG)."""
    mode = "finish" if how == "finish" else "wait"
    cmd = [sys.executable, "-c", CONSOLE_SCRIPT, "launch", "--num_processes", "2", "--cpu",
           str(SCRIPTS / "lifetime_family.py"), mode, str(tmp_path)]
    proc = subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not all((tmp_path / f"family{r}.json").exists() for r in range(2)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the family never started"
            time.sleep(0.2)
        time.sleep(0.5)  # the json is written: let both ranks finish writing theirs
        family = _family(tmp_path)
        assert len(family) == 2 * 5 and not set(family) - set(alive(family)), "the whole family runs"
        if how == "finish":
            (tmp_path / "go").touch()
        else:
            proc.send_signal(getattr(signal, how))
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    if how == "finish":
        assert proc.returncode == 0, err[-3000:]
    survivors = alive_after(family, within=10)
    assert not survivors, [" ".join(psutil.Process(p).cmdline()) for p in alive(survivors)]


# --------------------------------------------------------------------------------------------
# The end is bounded
# --------------------------------------------------------------------------------------------


def test_a_teardown_that_never_ends_is_cut_off_and_reported(tmp_path):
    env = clean_env(ANYACCEL_EXIT_TIMEOUT="3")
    start = time.monotonic()
    proc = anyaccel("launch", "--num_processes", "2", "--cpu", SCRIPTS / "lifetime_exit.py", "0", env=env, timeout=180)
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr
    assert "rank 0 of 2 failed" in err and "TimeoutError" in err, err[-3000:]
    assert "the script returned 3 s ago but the process has not ended" in err
    assert "in atexit handlers or the interpreter's finalisation" in err
    assert "a_teardown_that_never_ends" in err and "--- thread MainThread" in err  # every thread's stack
    assert time.monotonic() - start < 120


def test_a_teardown_stuck_holding_the_gil_is_ended_by_faulthandler(tmp_path):
    """No Python thread can run while the main thread holds the GIL: faulthandler's own thread
    prints the stacks and ends the process 5 s after the bound."""
    code = ("import ctypes, anyaccel.lifetime as lifetime\n"
            "lifetime.end_of_script('worker')\n"
            "ctypes.PyDLL(None).sleep(600)  # blocks in C with the GIL held\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(ANYACCEL_EXIT_TIMEOUT="1"), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    assert "Timeout (0:00:06)!" in proc.stderr and "most recent call first" in proc.stderr, proc.stderr
    assert time.monotonic() - start < 60
    assert os.environ.get("ANYACCEL_EXIT_TIMEOUT") is None  # nothing leaked into this process
