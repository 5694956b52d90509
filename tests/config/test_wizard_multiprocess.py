"""The multi-process tests (real launches, marked slow); the single-process ones are in tests/config/test_wizard.py.

Drive the real ``anyaccel config`` questions in a pseudo-terminal (pexpect)."""

from __future__ import annotations

import json
import os
import sys

import pytest


from test_wizard import CLEAR_LINE, DOWN, ENTER, REPO, answer, finish, spawn  # helpers shared with the unit tests


@pytest.mark.slow
def test_written_file_drives_a_two_process_launch(tmp_path):
    """The wizard's answers (2 CPU processes, bf16) are what `anyaccel launch` and a plain
    `Accelerator()` in each worker then use, with no flags on the command line."""
    import subprocess

    target = tmp_path / "cfg.yaml"
    child = spawn(tmp_path, target)
    answer(child, "Where will the training run", ENTER)
    answer(child, "Which device", ENTER)  # CPU, the detected one
    answer(child, "How many processes", CLEAR_LINE, "2", ENTER)
    answer(child, "Mixed precision", DOWN, ENTER)  # bf16
    answer(child, "How should each process hold the model", ENTER)
    answer(child, "Compile the model", ENTER)
    answer(child, "Save it", ENTER)
    assert finish(child) == 0

    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ANYACCEL_", "SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env.update(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "anyaccel.cli", "launch", "--config_file", str(target),
         str(REPO / "tests" / "launch" / "launch_train.py"), "--out", str(out), "--epochs", "1"],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    assert all(r["mixed_precision"] == "bf16" and r["device"] == "cpu" for r in ranks)
    assert not set(ranks[0]["seen"]) & set(ranks[1]["seen"])
    assert sorted(ranks[0]["gathered"]) == list(range(37))
