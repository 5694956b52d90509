"""Expert parallelism (issue 39, phase 1: the dispatcher, the experts interface, shard_experts, the
global auxiliary loss): one launch of 4 real CPU processes on gloo through ``anyaccel launch``
runs every job of tests/strategies/nd/expert/expert_checks.py, each against one process on the same global
batch (computed by every rank itself).

* ``qwen``: tiny Qwen3-MoE (8 experts, top-2), ep2 x 2 replicas — the loss group (4 processes) is
  twice the ep group, which is what makes the auxiliary loss's group matter: reduced over the ep
  group only it differs from one process (asserted);
* ``checkpoint``: the gathered full state dict, DCP ep -> one plain process, plain -> ep;
* ``mixtral``: tiny Mixtral (4 experts, eager experts), ep4;
* ``own``: a model of ours, router + ``ExpertList`` (ep4) and ``FusedExperts`` (ep2), DCP of the list;
* ``dispatch``: empty splits (every token to rank 0's experts) and random routing, different token
  counts per rank; bytes moved equal to the theory for the routing seen.

Phase 2, in the same launch (tests/strategies/nd/expert/expert_nd_checks.py): ``ParallelismConfig(ep_size=2)``
through the ``nd`` strategy — Qwen3-MoE dp_shard4 x ep2, Mixtral HSDP (2 x 2) with ep2, Qwen3-MoE
with its own TP plan at dp_shard2 x tp2 x ep2 — 10 AdamW steps with clipping each; save_state ep ->
FSDP -> ep, save_model -> transformers' from_pretrained; gradient accumulation (2 micro-batches) with
right-padded micro-batches of different real lengths per process (dp_shard4 x ep2); pp2 x dp_shard2 x
ep2 through pipeline_step; sp2 x dp_shard2 x ep2 (Ulysses) with right padding and the auxiliary loss.

Tolerances. Both sides compute in fp32; ep adds the same numbers in another order (experts on
row blocks, the gradient sums over ranks). Observed on 2 processes (2026-11-28): losses and aux
losses to 1e-7 relative, first gradients 2e-8, weights after 3 AdamW steps 2e-6. Asserted: losses
and aux rel 1e-5, gradients 1e-5, weights 1e-4 (the issue asks losses 2e-3, gradients 1e-4);
routing counts per layer and expert exactly.
"""


import pytest

from conftest import SCRIPTS, warm_launch
import rank_results  # tests/scripts

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

NPROC, STEPS = 4, 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("expert")
    proc = warm_launch(NPROC, SCRIPTS / "expert_checks.py", out, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    def ranks(job):
        return rank_results.read(out, job, NPROC)

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


# ---- phase 2: ParallelismConfig(ep_size=...) through the nd strategy (tests/strategies/nd/expert/expert_nd_checks.py) ----
ND_STEPS, CLIP = 10, 0.5


def _nd_trains_like_one_process(ranks, ep, efsdp, ep_ranks):
    """10 AdamW steps with clipping: losses (the loss group's mean), aux losses and gradient norms
    as one process on the global batch; routing counts per layer and expert equal every step;
    gathered weights within 1e-4 (observed 2026-11-29: losses 1e-7 relative, weights 7e-7 for
    ep x FSDP, 3e-6 HSDP, 1e-5 ep x tp)."""
    for r in ranks:
        assert len(r["losses"]) == ND_STEPS
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
        assert r["aux"] == pytest.approx(r["ref_aux"], rel=1e-5)  # the load-balancing loss of the global batch
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-4)
        assert all(r["counts_equal"])
        assert (r["ep"], r["efsdp"]) == (ep, efsdp)
        assert r["expert_numel_local"] * ep * efsdp == r["expert_numel"]  # 1/ep of the experts, then FSDP's share
    assert [r["ep_rank"] for r in ranks] == ep_ranks  # accelerator.expert_parallel_rank: the block of experts held
    assert max(ranks[0]["ref_norms"]) > CLIP  # clipping was active
    assert ranks[0]["keys_equal"] and ranks[0]["weights_max_diff"] < 1e-4 and ranks[0]["moved"] > 5e-3


def test_nd_qwen3_moe_ep2_x_dp_shard4(run):
    _nd_trains_like_one_process(run("nd_ep"), ep=2, efsdp=2, ep_ranks=[0, 1, 0, 1])


def test_nd_mixtral_hsdp_with_ep(run):
    _nd_trains_like_one_process(run("nd_hsdp_ep"), ep=2, efsdp=1, ep_ranks=[0, 1, 0, 1])


def test_nd_qwen3_moe_ep2_x_tp2(run):
    _nd_trains_like_one_process(run("nd_ep_tp"), ep=2, efsdp=1, ep_ranks=[0, 0, 1, 1])


def test_nd_gradient_accumulation_with_uneven_padding(run):
    """dp_shard 4 x ep 2, gradient_accumulation_steps=2, 5 optimizer steps: micro-batches right-padded
    to different real lengths on every process; the loss (accelerator.causal_lm_loss + the global
    auxiliary term) of every micro-batch, the gradient norm of every accumulated step and the final
    weights as one process accumulating the same global micro-batches (transformers' loss with the
    attention mask / 2), with the tolerances above."""
    ranks = run("nd_accum_mask")
    for r in ranks:
        assert r["synced"] == [False, True] * 5 and len(r["norms"]) == 5
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
        assert r["aux"] == pytest.approx(r["ref_aux"], rel=1e-5)  # padding left out of the global router statistics
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-4)
        assert all(r["counts_equal"])
        # the padding matters: a mean per process is not the global batch's loss
        assert any(abs(a - b) > 1e-3 * abs(b) for a, b in zip(r["per_rank_mean_losses"], r["ref_losses"]))
    assert len({tuple(r["tokens"]) for r in ranks}) > 1  # the processes counted different numbers of tokens
    assert max(ranks[0]["ref_norms"]) > CLIP
    assert ranks[0]["keys_equal"] and ranks[0]["weights_max_diff"] < 1e-4 and ranks[0]["moved"] > 5e-3


def _composed_trains_like_one_process(ranks):
    for r in ranks:
        assert len(r["losses"]) == ND_STEPS
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-4)
    assert max(ranks[0]["ref_norms"]) > CLIP
    assert ranks[0]["keys_equal"] and ranks[0]["weights_max_diff"] < 1e-4 and ranks[0]["moved"] > 5e-3


def test_nd_pipeline_x_experts(run):
    """pp 2 x dp_shard 2 x ep 2, a 4-layer Qwen3-MoE through pipeline_step (observed 2026-11-29:
    losses 1e-7 relative, norms 2e-7, weights 8e-6)."""
    ranks = run("nd_pp_ep")
    _composed_trains_like_one_process(ranks)
    assert [(r["pp_rank"], r["ep_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_nd_sequence_x_experts_with_the_auxiliary_loss(run):
    """sp 2 x dp_shard 2 x ep 2 (the ep group is the two slices of one sequence), right-padded rows,
    the model's labels= loss with its auxiliary term: losses, auxiliary losses (padding left out of
    the router statistics), norms and weights as one process; a mask with a hole across the slice
    border is refused on every rank (each slice alone looks right-padded). Observed 2026-11-29:
    losses and aux 1e-7 relative, weights 3e-7."""
    ranks = run("nd_sp_ep")
    _composed_trains_like_one_process(ranks)
    assert [(r["sp_rank"], r["ep_rank"]) for r in ranks] == [(0, 0), (1, 1), (0, 0), (1, 1)]
    for r in ranks:
        assert len(r["aux"]) == ND_STEPS and r["aux"] == pytest.approx(r["ref_aux"], rel=1e-5)
        assert "padding before real tokens" in r["hole_refused"], r.get("hole_refused")
        shift, expected = r["coef_shift"]  # the term added with the coefficient of the call, not of prepare
        assert shift == pytest.approx(expected, rel=1e-4) and abs(expected) > 1e-3
        assert "return_dict=True" in r["tuple_refused"], r.get("tuple_refused")


def test_nd_checkpoints_move_between_ep_and_plain_and_save_model_loads_in_transformers(run):
    r = run("nd_ckpt")[0]
    assert r["ep_to_plain_max_diff"] == 0.0 and r["optimizer_steps_plain"] == ND_STEPS  # save_state ep -> fsdp
    assert r["plain_to_ep_max_diff"] == 0.0  # fsdp -> ep (over zeroed weights)
    assert r["from_pretrained_keys_equal"] and r["from_pretrained_max_diff"] == 0.0  # save_model -> from_pretrained
