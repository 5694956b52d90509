"""Expert parallelism (issue 39, phase 1: the dispatcher, the experts interface, shard_experts, the
global auxiliary loss): one launch of 4 real CPU processes on gloo through ``anyaccel launch``
runs every job of tests/scripts/expert_checks.py, each against one process on the same global
batch (computed by every rank itself).

* ``qwen``: tiny Qwen3-MoE (8 experts, top-2), ep2 x 2 replicas — the loss group (4 processes) is
  twice the ep group, which is what makes the auxiliary loss's group matter: reduced over the ep
  group only it differs from one process (asserted);
* ``checkpoint``: the gathered full state dict, DCP ep -> one plain process, plain -> ep;
* ``mixtral``: tiny Mixtral (4 experts, eager experts), ep4;
* ``own``: a model of ours, router + ``ExpertList`` (ep4) and ``FusedExperts`` (ep2), DCP of the list;
* ``dispatch``: empty splits (every token to rank 0's experts) and random routing, different token
  counts per rank; bytes moved equal to the theory for the routing seen.

Tolerances. Both sides compute in fp32; ep adds the same numbers in another order (experts on
row blocks, the gradient sums over ranks). Observed on 2 processes (2026-11-28): losses and aux
losses to 1e-7 relative, first gradients 2e-8, weights after 3 AdamW steps 2e-6. Asserted: losses
and aux rel 1e-5, gradients 1e-5, weights 1e-4 (the issue asks losses 2e-3, gradients 1e-4);
routing counts per layer and expert exactly.
"""

import json

import pytest

from conftest import SCRIPTS, anyaccel

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

NPROC, STEPS = 4, 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("expert")
    proc = anyaccel("launch", "--num_processes", NPROC, "--cpu", SCRIPTS / "expert_checks.py", out, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    def ranks(job):
        return [json.loads((out / f"{job}_rank{r}.json").read_text()) for r in range(NPROC)]

    return ranks


def _trains_like_one_process(ranks):
    for r in ranks:
        assert len(r["losses"]) == STEPS
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
        assert r["grads"]["max_diff"] < 1e-5 and r["grads"]["scale"] > 1e-2, r["grads"]
        assert r["weights"]["max_diff"] < 1e-4, r["weights"]


def _moe_model(ranks, experts_per_rank, num_experts):
    _trains_like_one_process(ranks)
    for r in ranks:
        assert r["sharded"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        assert r["aux"] == pytest.approx(r["ref_aux"], rel=1e-5)  # the auxiliary loss of the global batch
        assert r["counts"] == r["ref_counts"]  # every step, layer and expert: the routing of one process
        assert r["moved"] > 5e-3  # the weights moved: the comparison means something
        # each rank holds 1/ep of the expert weights (num_experts / ep_size whole experts per layer)
        assert r["expert_params"] * r["ep_size"] == r["expert_params_total"]
        assert r["ep_size"] * experts_per_rank == num_experts


def test_qwen3_moe_ep2_with_replicas_trains_like_one_process(run):
    ranks = run("qwen")
    _moe_model(ranks, experts_per_rank=4, num_experts=8)
    # reduced over the ep group alone, the auxiliary loss is not the global batch's
    assert all(abs(r["aux_over_ep_group_only"] - r["aux"][0]) > 1e-4 for r in ranks)


def test_mixtral_ep4_trains_like_one_process(run):
    _moe_model(run("mixtral"), experts_per_rank=1, num_experts=4)


def test_checkpoints_move_between_ep_and_one_process(run):
    for r in run("checkpoint"):
        assert r["full_keys_equal"] and r["full_shapes_equal"]  # gathered: the unsharded model's names and shapes
        assert r["full_max_diff"] < 1e-4  # = the trained weights (the reference trained in lockstep)
        assert r["plain_to_ep"]["max_diff"] == 0.0  # a plain checkpoint cut to each rank's experts, bitwise
    assert run("checkpoint")[0]["ep_to_plain_max_diff_to_gathered"] == 0.0  # ep checkpoint -> one process, bitwise


def test_own_model_with_expert_list_and_fused_experts(run):
    ranks = run("own")
    _trains_like_one_process(ranks)
    assert [r["list_experts_held"] for r in ranks] == [["0"], ["1"], ["2"], ["3"]]
    assert ranks[0]["list_ckpt_keys_equal"] and ranks[0]["list_ckpt_max_diff"] < 1e-4


def test_dispatch_with_empty_splits_and_bytes_moved(run):
    for rank, r in enumerate(run("dispatch")):
        for case, c in r.items():
            assert c["out_diff"] < 1e-5 and c["grad_diff"] < 1e-5, (case, c)
            assert c["bytes_sent"] == c["theory"], (case, c)  # what crossed the wire is what the routing implies
        # every token to experts 0 and 1 (rank 0): rank 0 receives all 2 * (3 + 4 + 5 + 6) pairs, the others none
        assert r["to expert 0 and 1"]["rows_received"] == (36 if rank == 0 else 0)
