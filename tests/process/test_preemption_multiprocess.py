"""The multi-process tests (real launches, marked slow); the single-process ones are in tests/process/test_preemption.py.

Checkpoint on preemption and automatic resume, with real signals and real launches
(tests/process/train_preempt.py: 2 CPU processes, 3 epochs of 8 steps, dropout, a shuffled
loader, Adam and StepLR — everything that must come back for a bitwise-equal end)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import CONSOLE_SCRIPT, ROOT, SCRIPTS, clean_env
from test_preemption import run  # helpers shared with the unit tests

TRAIN = str(SCRIPTS / "train_preempt.py")


def launch_cmd(*args):
    return [sys.executable, "-c", CONSOLE_SCRIPT, "launch", *map(str, args)]


def signal_when(cmd, marker, sig, timeout=180):
    """Start ``cmd``, send ``sig`` to it once ``marker`` exists, return (returncode, output)."""
    proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=clean_env())
    deadline = time.monotonic() + timeout
    while not os.path.exists(marker):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the run never reached the marker step"
        time.sleep(0.05)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def same_weights(a, b) -> bool:
    wa, wb = torch.load(a), torch.load(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    proc = run(launch_cmd("--num_processes", 2, "--cpu", TRAIN, "--project", d / "p", "--out", d / "w.pt"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return d / "w.pt"


@pytest.mark.torch_versions
@pytest.mark.slow
def test_sigterm_to_the_launcher_checkpoints_exits_75_without_restart_and_resumes_bitwise(tmp_path, uninterrupted):
    cmd = launch_cmd("--num_processes", 2, "--cpu", "--max_restarts", 1, TRAIN, "--project", tmp_path / "p",
                     "--out", tmp_path / "w.pt", "--sleep", 0.3, "--marker", tmp_path / "m")
    code, out = signal_when(cmd, tmp_path / "m", signal.SIGTERM)
    assert code == 75, out
    assert "every worker saved a checkpoint and stopped (exit 75)" in out
    assert out.count("resumed at epoch 0 step 0") == 2  # one attempt: no restart for a preemption
    assert not (tmp_path / "w.pt").exists()
    saved = sorted(os.listdir(tmp_path / "p" / "checkpoints"))
    assert saved == ["checkpoint_0"]

    again = run(cmd[:-4])  # the same command, without the marker
    assert again.returncode == 0, again.stdout + again.stderr
    assert "from " + str(tmp_path / "p" / "checkpoints" / "checkpoint_0") in again.stdout
    assert same_weights(uninterrupted, tmp_path / "w.pt")


@pytest.mark.slow  # not torch_versions: the restart (agent.py) and the bitwise resume run on torch 2.9 in the tests above
def test_a_sigkilled_worker_with_max_restarts_resumes_from_the_newest_checkpoint_bitwise(tmp_path, uninterrupted):
    proc = run(launch_cmd("--num_processes", 2, "--cpu", "--max_restarts", 1, TRAIN, "--project", tmp_path / "p",
                          "--out", tmp_path / "w.pt", "--save_every", 4, "--kill_rank", 1, "--kill_step", 6))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("resumed at epoch 0 step 4 from") == 2, proc.stdout
    assert same_weights(uninterrupted, tmp_path / "w.pt")


@pytest.mark.slow
def test_one_process_without_a_launcher_checkpoints_on_sigusr1_and_resumes(tmp_path):
    base = [sys.executable, TRAIN, "--project", str(tmp_path / "p"), "--out", str(tmp_path / "w.pt")]
    full = run([sys.executable, TRAIN, "--project", tmp_path / "full", "--out", tmp_path / "full.pt"])
    assert full.returncode == 0, full.stdout + full.stderr
    code, out = signal_when(base + ["--sleep", "0.2", "--marker", str(tmp_path / "m")], tmp_path / "m", signal.SIGUSR1)
    assert code == 75, out
    assert "SIGUSR1: every rank saved" in out
    again = run(base)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed at epoch 0 step 0" not in again.stdout
    assert same_weights(tmp_path / "full.pt", tmp_path / "w.pt")
