"""Checkpoint on preemption and automatic resume, with real signals and real launches
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

from conftest import ROOT, clean_env


def run(cmd, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=clean_env())


def test_resume_from_a_checkpoint_of_another_model_names_the_key_and_loads_nothing(tmp_path):
    from anyaccel import Accelerator, ProjectConfiguration
    from anyaccel.errors import CheckpointError

    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    acc = Accelerator(cpu=True, project_config=config, preemption_signals="none")
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)))
    acc.save_state()
    assert acc.resume().checkpoint.endswith("checkpoint_0")

    other = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path)),
                        preemption_signals="none")
    wide = other.prepare(torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 1)))
    before = {k: v.clone() for k, v in wide.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"different model: model 0: '0.weight' has shape \(8, 4\) in the "
                                              r"checkpoint and \(16, 4\) in the model.*nothing was loaded"):
        other.resume()
    assert all(torch.equal(before[k], v) for k, v in wide.state_dict().items())
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_0"]  # nothing written
    del model


def test_resume_without_a_checkpoint_starts_at_zero(tmp_path):
    from anyaccel import Accelerator

    acc = Accelerator(cpu=True, project_dir=str(tmp_path), preemption_signals="none")
    assert tuple(acc.resume()) == (0, 0, None)


def test_a_signal_outside_the_training_loop_is_not_held_forever(tmp_path):
    """A preemption signal while no training loop runs (here: a loader prepared and never
    iterated) waits for a batch boundary only ``agree_timeout`` seconds, then takes its usual
    effect — a stuck or finished script still dies on SIGTERM."""
    script = tmp_path / "idle.py"
    script.write_text(
        "import os, signal, time, torch\n"
        "from anyaccel import Accelerator\n"
        f"acc = Accelerator(cpu=True, project_dir={str(tmp_path)!r})\n"
        "acc.prepare(torch.utils.data.DataLoader(torch.arange(8), batch_size=2))\n"
        "acc._preemption.agree_timeout = 1.0\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(30)\n"
        "print('still alive')\n")
    t0 = time.monotonic()
    proc = run([sys.executable, script], timeout=60)
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr
    assert time.monotonic() - t0 < 20 and "still alive" not in proc.stdout
    assert "no training batch within 1 s of SIGTERM" in proc.stderr


def test_an_accelerator_with_its_training_loader_still_pickles(tmp_path):
    """The preemption hooks are bound methods and plain functions (Accelerate's tests pickle an
    Accelerator after prepare), and a copy does not drag along the signal handler of an earlier
    Accelerator of the process (whose bf16 model once made the pickle fail in a full test run)."""
    import pickle
    import signal

    from anyaccel import Accelerator

    earlier = Accelerator(cpu=True, mixed_precision="bf16", project_dir=str(tmp_path))
    earlier.prepare(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.utils.data.DataLoader(torch.arange(8)))
    acc = Accelerator(cpu=True, project_dir=str(tmp_path))
    acc.prepare(torch.utils.data.DataLoader(torch.arange(8), batch_size=2))
    try:
        assert signal.getsignal(signal.SIGTERM) == acc._preemption._on_signal  # the newest one handles it
        copy = pickle.loads(pickle.dumps(acc))
        assert copy.num_processes == 1 and copy._preemption._previous == {}
    finally:
        acc._preemption.uninstall()
        earlier._preemption.uninstall()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # what was there before both is back


def test_a_signal_not_yet_agreed_on_takes_its_usual_effect_when_the_store_is_lost(tmp_path):
    # the store's host went away (preempted first) after this rank got SIGUSR1 but before the ranks agreed
    code = (
        "import os, signal, time\n"
        "from anyaccel.preemption import Preemption\n"
        "p = Preemption(('SIGUSR1',), 0, 2)\n"
        "p.coordinated = True\n"
        "p.in_loop = lambda: True\n"
        "p.install()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "time.sleep(0.2)\n"
        "assert p._local == 'SIGUSR1'\n"
        "p.store_lost()\n"
        "time.sleep(5)\n"
        "print('still alive')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=clean_env(),
                          cwd=tmp_path)
    assert proc.returncode == -signal.SIGUSR1, proc.stdout + proc.stderr
    assert "still alive" not in proc.stdout


def test_the_requeue_uses_the_environment_resolved_at_start(tmp_path, monkeypatch):
    """The SLURM job to requeue is the one the Accelerator's environment saw when it started, not
    whatever os.environ says when the signal comes (here: the script has since dropped it)."""
    import warnings

    from anyaccel import Accelerator

    log = tmp_path / "scontrol.log"
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n[ \"$1\" = show ] && echo 'JobId=4242 Requeue=1'\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("ANYACCEL_DISABLE_SLURM", "1")  # one process of its own, named by SLURM
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = Accelerator(cpu=True, preemption_signals="none")
    acc.prepare(torch.nn.Linear(2, 2))
    monkeypatch.delenv("SLURM_JOB_ID")
    with pytest.raises(SystemExit) as stopped:
        acc._stop_for_preemption("test signal")
    assert stopped.value.code == 75
    assert log.read_text().splitlines() == ["show job 4242", "requeue 4242"]
    acc.end_training()
