"""The multi-process tests (real launches, marked slow); the single-process ones are in tests/strategies/nd/test_nd.py.

N-D parallelism (the ``nd`` strategy, ``ParallelismConfig``).

Unit tests (no processes): sizes and plans are checked before anything is built. Slow tests: 4
real CPU processes on gloo through ``anyaccel launch`` (tests/strategies/nd/nd_checks.py), TP2 x DP2
and HSDP 2 x 2 in one job, and a transformers tiny Llama with its own TP plan on 2 processes, each compared
with the same training in one process (rank 0 runs it).

Tolerance: the 4-process run adds the same fp32 numbers in another order (matmuls cut along TP,
gradients reduce-scattered and averaged over the data-parallel ranks, norms summed per layout);
the observed difference after 6 SGD-momentum steps with clipping is 3e-8 in weights and ~2e-7
relative in losses and norms. Asserted: weights 1e-5, losses/norms rel 1e-5 — 30x above rounding,
while one wrong shard, a TP rank fed another batch, or a norm counted twice changes them at 1e-2
(lr 0.05 x gradients of order 1).
"""

import json

import pytest

from conftest import SCRIPTS, warm_launch
import rank_results  # tests/scripts



@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """TP2 x DP2 and HSDP 2 x 2 in one 4-process launch (tests/strategies/nd/nd_checks.py runs each
    layout with its own ``Accelerator`` ... ``end_training()``): what every rank wrote, per layout."""
    out = tmp_path_factory.mktemp("nd")
    proc = warm_launch(4, SCRIPTS / "nd_checks.py", out, "tp2dp2", "hsdp", timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {layout: rank_results.read(out, layout, 4) for layout in ("tp2dp2", "hsdp")}


@pytest.mark.slow
@pytest.mark.parametrize("layout, dims, gathered, local_fraction", [
    ("tp2dp2", ["dp_shard", "tp"], 8, 0.25),     # 4 ranks hold a quarter each; 2 data-parallel ranks x 4
    ("hsdp", ["dp_replicate", "dp_shard"], 16, 0.5),  # sharded over 2, replicated twice; 4 dp ranks x 4
])
def test_four_processes_train_like_one(four, layout, dims, gathered, local_fraction):
    ranks = four[layout]
    r0 = ranks[0]
    assert (r0["strategy"], r0["distributed_type"], r0["mesh_dims"], r0["mesh_shape"]) == ("nd", "FSDP", dims, [2, 2])
    # loaders shard by data-parallel rank: 6 steps of 4 samples per dp rank (global rank would give fewer)
    # and gather_for_metrics counts each sample once
    for r in ranks:
        assert r["batches"] == 6 and r["gathered"] == [gathered] * 6
        assert r["losses"] == pytest.approx(r0["ref_losses"], rel=1e-5)
        assert r["norms"] == pytest.approx(r0["ref_norms"], rel=1e-5)  # the true global norm, clipping active
        assert r["local_param_numel"] <= local_fraction * r["full_param_numel"] * 1.1
    assert r0["same_keys"] and r0["max_weight_diff"] < 1e-5
    coords = [tuple(r["ranks"].values()) for r in ranks]
    if layout == "tp2dp2":  # tp innermost: ranks 0,1 are one TP group
        assert [c[1:3] for c in coords] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    else:  # replicate outermost
        assert [c[0:2] for c in coords] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def _launch(script, out, *args, nproc):
    """`anyaccel launch --num_processes N --cpu SCRIPT OUT ARGS` (SCRIPT found by name; must succeed); what
    each rank wrote to OUT/rank{r}.json, in rank order."""
    proc = warm_launch(nproc, SCRIPTS / script, out, *args, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.slow
def test_transformers_llama_trains_with_its_own_tp_plan(tmp_path):
    pytest.importorskip("transformers")
    r0, r1 = _launch("nd_llama.py", tmp_path, nproc=2)
    assert (r0["tp_rank"], r1["tp_rank"]) == (0, 1)
    assert r0["dtensors"] == 16  # embed_tokens, 7 projections x 2 layers, lm_head: the model's plan applied
    for r in (r0, r1):
        assert r["losses"] == pytest.approx(r0["ref_losses"], rel=1e-5)
        assert r["norms"] == pytest.approx(r0["ref_norms"], rel=1e-5)
    assert r0["same_keys"] and r0["max_weight_diff"] < 1e-5
