"""Sequence parallelism, Ulysses style (issue 31, the sp half): one launch of 4 real CPU processes
on gloo through ``anyaccel launch`` runs several jobs (tests/strategies/nd/sequence/sequence_checks.py), each
compared with the same training in one process on the same global batches; the checkpoint saved
under sp2 x dp_shard2 is loaded by FSDP2 over the 4 processes (no sp) and by one plain process.

* ``sp2dp2``: a transformers Llama with tied embeddings and grouped-query attention (SDPA), labels
  with ignored tokens in different numbers per data-parallel rank, right-padded rows, clipping;
* ``sp2tp2``: an untied Llama with eager attention whose key/value heads (2, 1 per TP rank) are
  fewer than the sp ranks;
* ``own``: a model of ours whose attention goes through ``SequenceParallelAttention``, with
  ``accelerator.causal_lm_loss`` (ignored prompt tokens) and gradient accumulation over 2
  micro-batches; the same under plain DDP over the 4 processes;
* what is refused, with its message; a frozen model (not wrapped) prepared twice; a frozen MoE
  model's auxiliary loss without ep.

Tolerances. Both sides compute in fp32; the 4-process run adds the same numbers in another
order (attention per head slice, gradients reduce-scattered over dp_shard x sp, loss sums over
the global batch). Observed after 10 AdamW steps (own: 10 micro-batches, 5 steps): losses 1e-7
relative, weights 2e-7 (sp2dp2), 6e-7 (sp2tp2), 2e-7 (own). Asserted: losses rel 1e-5 and
weights 1e-5 (the issue asks for 2e-3 and 1e-4). The weights move by 1e-2 to 2e-2 over the run.
Breaking each piece on purpose in sp2dp2 (2026-11-26): labels not shifted across the slice
border moved the weights by 1.8e-2, a loss averaged per rank instead of per token by 1.4e-2,
gradients not scaled for the sp ranks by 6e-4 (AdamW hides most of a uniform scale; the clipping
norms, asserted too, are then 4x off).
"""

import subprocess
import sys

import pytest

from conftest import SCRIPTS, clean_env, warm_launch
import rank_results  # tests/scripts

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

WEIGHTS, LOSSES, STEPS = 1e-5, 1e-5, 10


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sequence")
    proc = warm_launch(4, SCRIPTS / "sequence_checks.py", out, "four", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    one = subprocess.run([sys.executable, SCRIPTS / "sequence_checks.py", out, "one"], capture_output=True, text=True,
                         timeout=300, env=clean_env())
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-5000:]

    def ranks(job, n=4):
        return rank_results.read(out, job, n)

    return ranks


def _trains_like_one_process(ranks):
    r0 = ranks[0]
    assert r0["same_keys"] and r0["max_weight_diff"] < WEIGHTS, (r0["worst"], r0["max_weight_diff"])
    assert r0["max_weight_change"] > 5e-3  # the weights moved (1e-2 to 2e-2): the comparison means something
    for r in ranks:  # every rank returns the one-process loss of the whole global batch
        assert len(r["losses"]) == STEPS
        assert r["losses"] == pytest.approx(r0["ref_losses"], rel=LOSSES)


def test_sp2_dp_shard2_llama_with_tied_embeddings_gqa_padding_and_clipping(run):
    ranks = run("sp2dp2")
    _trains_like_one_process(ranks)
    for r in ranks:
        assert r["norms"] == pytest.approx(ranks[0]["ref_norms"], rel=LOSSES)  # clipping saw the true global norm
        assert r["tied"] and r["mesh"] == ["dp_shard", "sp"] and r["attention"] == "anyaccel_ulysses"
        assert r["shapes"] == [[2, 8]]  # half of each 16-token sequence, 2 sequences per data-parallel rank
    assert [r["sp_rank"] for r in ranks] == [0, 1, 0, 1]  # sp inside dp_shard: ranks 0 and 1 share a batch


def test_sp2_tp2_llama_with_eager_attention_and_fewer_kv_heads_than_sp_ranks(run):
    ranks = run("sp2tp2")
    _trains_like_one_process(ranks)
    assert [(r["sp_rank"], r["tp_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["mesh"] == ["dp_shard", "sp", "tp"] and not r["tied"] for r in ranks)


def test_own_attention_through_the_hook_with_the_accelerators_causal_lm_loss_and_accumulation(run):
    ranks = run("own")
    _trains_like_one_process(ranks)
    assert all(r["bound"] == 2 and r["local_length"] == 8 for r in ranks)  # both blocks' attention, half the tokens


def test_the_loss_helper_weights_tokens_under_plain_ddp_too(run):
    ranks = run("ddp")  # 4 data-parallel ranks with different numbers of ignored tokens
    _trains_like_one_process(ranks)
    assert all(r["bound"] == 0 and r["local_length"] == 16 for r in ranks)  # no sp: whole sequences, hook unbound


def test_a_checkpoint_saved_under_sp_loads_in_one_process_and_in_fsdp_over_four(run):
    for ranks in (run("one", 1), run("fsdp4")):
        assert ranks[0]["same_keys"] and ranks[0]["max_diff"] == 0.0  # DCP keyed by name: resharded, bit for bit
        assert all(r["optimizer_steps"] == [STEPS] for r in ranks)


def test_what_is_refused_says_why_and_what_to_do(run):
    for r in run("errors"):
        assert "3 query heads are not divisible by sp_size=2" in r["heads"]
        assert "config.num_attention_heads=3, num_key_value_heads=3" in r["heads"]
        assert "anyaccel.SequenceParallelAttention" in r["no_attention"]
        assert "left padding" in r["left_padding"] and "padding_side='right'" in r["left_padding"]


def test_a_frozen_model_prepared_twice_still_runs_sequence_parallel(run):
    for r in run("frozen"):  # the loader cuts its batches too: without sp its attention would see half
        assert r["losses"] == pytest.approx(r["expected"], rel=1e-5)


def test_an_moe_models_auxiliary_loss_under_sp_without_ep_is_one_processs(run):
    """sp 2 x dp_shard 2, Qwen3-MoE returning router logits: the labels= loss (cross entropy + the
    auxiliary term) and aux_loss of the global batch as one process (the term was divided by the
    token count before: 4.1774 against 4.2145 in a 2-process reproduction); a coefficient changed
    after prepare used; return_dict=False refused, naming the fix."""
    for r in run("moe"):
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5) and r["aux"] == pytest.approx(r["ref_aux"], rel=1e-5)
        assert r["coef_loss"] == pytest.approx(r["ref_coef_loss"], rel=1e-5)
        assert "return_dict=True" in r["tuple"], r["tuple"]

