"""N-D parallelism: the rest of the training loop on 4 real CPU processes on gloo (issue 22,
items 4 and 5), through ``anyaccel launch`` and tests/strategies/nd/nd_more_checks.py (one 4-process job for the
three 4-process layouts), each compared with the same training in one process (rank 0 runs it):

* ``loop``: TP2 x DP2 with gradient accumulation (2 micro-batches), an LR scheduler, torch.compile
  (Dynamo's "eager" backend: frames are counted, no C++ compiler needed) and ``reduce``;
* ``tp4``: tensor parallel over all 4 processes, with the parameter and optimizer bytes per rank;
* ``bf16``: TP2 x DP2 under ``mixed_precision="bf16"`` (CPU autocast, FSDP2 computing in bf16);
* and, on 2 processes (tests/strategies/nd/nd_preempt.py), the ``--parallelism_config_tp_size`` flag
  reaching a plain ``Accelerator()``, with a preemption checkpoint under TP.

Tolerances. fp32 (``loop``, ``tp4``): the 4-process run adds the same fp32 numbers in another
order (matmuls cut along TP, gradients reduce-scattered and averaged); observed 4e-8 in weights and
2e-7 relative in losses after 4 SGD-momentum steps. Asserted: weights 1e-5, losses rel 1e-5 — far
above rounding, far below what a wrong shard, a TP rank fed another batch, a scheduler stepped
twice as often (lr 0.8^4 instead of 0.8^2 per step) or a micro-batch left out does (>= 1e-2).
bf16: both sides round to bf16 (8-bit mantissa, 2^-9 = 2e-3 relative per operation) but in
different places (TP cuts the matmuls, FSDP2 casts the shards, one process autocasts whole
layers); observed 2e-3 relative in losses and 7e-4 in weights. Asserted: losses rel 1e-2, weights
5e-3; the first TP layer must compute in bf16.
"""

import math
import os
import sys

import pytest

from conftest import SCRIPTS, TESTS, warm_launch
import rank_results  # tests/scripts

pytestmark = pytest.mark.slow

STEPS, BATCH, WIDTH = 4, 4, 32


LAYOUTS = ("tp4", "bf16", "loop")  # one 4-process job runs them in this order (Dynamo's compile last)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The three 4-process layouts in one launch (tests/strategies/nd/nd_more_checks.py: each its own
    ``Accelerator`` ... ``end_training()``): what every rank wrote, per layout."""
    out = tmp_path_factory.mktemp("nd_more")
    proc = warm_launch(4, SCRIPTS / "nd_more_checks.py", out, *LAYOUTS, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {layout: rank_results.read(out, layout, 4) for layout in LAYOUTS}


def _trains_like_one_process(ranks, weights, losses):
    r0 = ranks[0]
    for r in ranks:  # every rank logs the same gathered losses
        assert r["losses"] == pytest.approx(r0["ref_losses"], rel=losses)
    assert r0["same_keys"] and r0["max_weight_diff"] < weights


def test_accumulation_scheduler_compile_and_reduce_under_tp2_dp2(job):
    ranks = job["loop"]
    _trains_like_one_process(ranks, weights=1e-5, losses=1e-5)  # 2 micro-batches per step, lr from the scheduler
    for r in ranks:
        assert (r["mesh_dims"], r["mesh_shape"], r["dp"]) == (["dp_shard", "tp"], [2, 2], 2)
        # reduce: 4 samples per dp rank, each data-parallel sample once (not once per TP rank: 16)
        assert r["reduced"] == [[BATCH * 2, 0.5, 3.0]] * (STEPS * 2)
        # the scheduler steps once per data-parallel process per optimizer step (2, not 4 processes)
        assert r["scheduler_steps"] == STEPS * 2 and r["lr"] == pytest.approx(ranks[0]["ref_lr"])
        assert r["frames"] >= 1 and r["graphs"] >= 1, r  # Dynamo compiled the TP x FSDP model
        assert not [w for w in r["warnings"] if "eager" in w or "compile" in w], r["warnings"]


def test_tp4_trains_like_one_process_with_a_quarter_of_the_tp_layers_per_rank(job):
    ranks = job["tp4"]
    _trains_like_one_process(ranks, weights=1e-5, losses=1e-5)
    full = ranks[0]["full_shapes"]
    cut = {k for k in full if ".fc1." in k or k.endswith("fc2.weight")}  # colwise fc1, rowwise fc2 (bias replicated)
    expected = {k: [s[0] // 4] + s[1:] if k.endswith("fc1.weight") or k.endswith("fc1.bias")
                else [s[0], s[1] // 4] if k in cut else s for k, s in full.items()}
    numel = sum(math.prod(s) for s in expected.values())
    for r in ranks:
        assert (r["mesh_shape"], r["dp"], r["scheduler_steps"]) == ([1, 4], 1, STEPS)
        assert r["param_shapes"] == expected
        assert r["param_bytes"] == 4 * numel  # fp32; 9,860 of the model's 34,820 bytes
        assert r["optimizer_bytes"] == r["param_bytes"]  # SGD momentum: one buffer per local shard
        assert r["reduced"] == [[BATCH, 0.0, 3.0]] * STEPS
    assert [r["tp_rank"] for r in ranks] == [0, 1, 2, 3]


def test_bf16_mixed_precision_under_tp2_dp2(job):
    ranks = job["bf16"]
    _trains_like_one_process(ranks, weights=5e-3, losses=1e-2)
    for r in ranks:
        assert r["dtypes"] == ["torch.bfloat16"]  # the TP layer computed in bf16


def test_launch_flags_reach_a_plain_accelerator_and_preemption_checkpoints_under_tp(tmp_path):
    """2 processes: `anyaccel launch --parallelism_config_tp_size 2` makes a plain `Accelerator()`
    tensor-parallel (the model's own `_tp_plan`), and SIGTERM to the launcher still makes every
    rank save a checkpoint and exit 75."""
    import signal

    sys.path.insert(0, str(TESTS / "process"))  # the preemption tests' helpers
    from test_preemption_multiprocess import launch_cmd, signal_when

    cmd = launch_cmd("--num_processes", 2, "--cpu", "--parallelism_config_tp_size", 2, SCRIPTS / "nd_preempt.py",
                     tmp_path / "p", tmp_path / "m")
    code, out = signal_when(cmd, tmp_path / "m", signal.SIGTERM, timeout=300)
    assert code == 75, out
    for rank in (0, 1):  # the sizes came from the flags: nd, TP rank = process, fc0 cut in two (16 -> 8 rows)
        assert f"rank {rank}: strategy nd, tp rank {rank}, local fc0 (8, 8)" in out
    assert "every worker saved a checkpoint and stopped (exit 75)" in out
    assert os.listdir(tmp_path / "p" / "checkpoints") == ["checkpoint_0"]
