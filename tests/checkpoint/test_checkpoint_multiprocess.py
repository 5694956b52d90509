"""The multi-process tests (real launches, marked slow); the single-process ones are in tests/checkpoint/test_checkpoint.py.

save_state / load_state, exact resume, atomic writes under SIGKILL, save_model, automatic naming."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import SCRIPTS, warm_launch
import rank_results  # tests/scripts
from test_checkpoint import _load_after_kill, _same  # helpers shared with the unit tests


@pytest.mark.slow
def test_sigkill_of_one_rank_during_a_two_process_save(tmp_path, run_torchrun):
    ckpt = tmp_path / "ckpt"
    proc = run_torchrun(SCRIPTS / "train_kill_save.py", tmp_path, ckpt, "write:1", 1, check=False, timeout=240)
    assert proc.returncode != 0 and not (tmp_path / "not_killed").exists(), proc.stdout + proc.stderr
    assert _load_after_kill(tmp_path, ckpt) == "A"


def _run(*args):
    proc = warm_launch(2, *args, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.mark.slow
def test_two_process_resume_is_bitwise_identical(tmp_path):
    ckpt = tmp_path / "ckpt"
    # 60 samples, 2 processes x batch 3: 10 steps per epoch; save after step 14 (mid epoch 1)
    _run(SCRIPTS / "train_resume.py", "full", tmp_path, ckpt, 14)
    assert sorted(f for f in os.listdir(ckpt) if f.startswith("random_states")) == \
        ["random_states_0.pkl", "random_states_1.pkl"]
    _run(SCRIPTS / "train_resume.py", "resume", tmp_path, ckpt, "-")
    assert _same(torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt"))
    export = sorted(os.listdir(tmp_path / "export"))  # save_model from rank 0 only, sharded
    assert "model.safetensors.index.json" in export and len(export) > 2
    assert not (tmp_path / "export_not_main").exists()
    for full, resumed in zip(rank_results.read(tmp_path, "full", 2), rank_results.read(tmp_path, "resume", 2)):
        assert full["steps"] == resumed["steps"] == 30
        assert full["epochs"] == [0, 1, 2] and resumed["epochs"] == [1, 2]
        assert full["lr"] == resumed["lr"]
        assert full["rng"] == resumed["rng"]  # per-process RNG state restored
    assert json.loads((tmp_path / "full_rank0.json").read_text())["rng"] != \
        json.loads((tmp_path / "full_rank1.json").read_text())["rng"]


@pytest.mark.slow
def test_every_rank_resumes_from_the_checkpoint_rank_0_chose_or_every_rank_raises(tmp_path):
    _run(SCRIPTS / "resume_agreement.py", tmp_path, "save")
    saved = json.loads((tmp_path / "save_rank0.json").read_text())["saved"]
    # rank 1's project_dir is empty (a node-local or stale view): it resumes from rank 0's choice, not from scratch
    _run(SCRIPTS / "resume_agreement.py", tmp_path, "resume")
    ranks = rank_results.read(tmp_path, "resume", 2)
    assert ranks[0]["resume"] == ranks[1]["resume"] == [0, 2, saved]
    assert not list((tmp_path / "shared").glob(".anyaccel-shared-*"))  # the shared-directory probe is removed
    assert ranks[0]["weights"] == ranks[1]["weights"]
    for r in ranks:  # each rank reads its own directory (DDP); rank 1's does not exist: both raise, naming it
        assert r["different"].startswith("CheckpointError: load_state() with a directory per process: process 1 "
                                         f"({saved}_elsewhere): FileNotFoundError"), r["different"]
    assert ranks[0]["missing"].startswith("FileNotFoundError: no checkpoint at")
    assert ranks[1]["missing"] == ranks[0]["missing"] + " (found by process 0)"
