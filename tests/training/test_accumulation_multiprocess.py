"""The multi-process tests (real launches, marked slow); the single-process ones are in tests/training/test_accumulation.py.

Gradient accumulation: sync pattern, optimizer/scheduler stepping, loss scaling, equality with
one large batch (in one process here, in two real processes in the slow test)."""

from __future__ import annotations

import json

import pytest

from conftest import SCRIPTS, warm_launch


@pytest.mark.slow
def test_two_processes_accumulation_equals_large_batch_and_skips_all_reduce(tmp_path):
    proc = warm_launch(2, SCRIPTS / "train_accumulation.py", tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["world"] == 2
    assert r["max_abs_diff"] < 1e-5
    epoch = [False] * 4 + [True] + [False] * 4 + [True] + [False, True]  # 12 micro-batches: 5, 5, 2
    assert [s for s, _, _ in r["accum_log"]] == epoch * 2
    for sync, all_reduced, stepped in r["accum_log"]:
        assert all_reduced == sync and stepped == sync  # no all-reduce and no step on micro-steps
    assert all(a and b and c for a, b, c in r["large_log"]) and len(r["large_log"]) == 6
    assert r["accum_sched_steps"] == r["large_sched_steps"] == 12  # 2 processes x 6 optimizer steps (Accelerate)
    assert r["accum_lr"] == r["large_lr"]
