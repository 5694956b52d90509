"""FSDP2 on CPU with gloo: 2 real processes through `anyaccel launch`, checked against DDP, and the
checkpoints they write moved to 1 process and to DDP.

Tolerances: FSDP2 reduce-scatters fp32 gradients where DDP all-reduces them; the sums are the same
numbers added in a different order, so weights agree to float32 rounding (observed 4.5e-8 after 6
AdamW steps; asserted 1e-6). Gradient accumulation (2 x 8) vs one batch of 16 divides and sums in a
different order too (observed 7.5e-7; asserted 1e-5).
"""

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import SCRIPTS, anyaccel, clean_env, launch_checks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    return out, launch_checks("fsdp_checks.py", out, timeout=400)


def test_fsdp_matches_ddp_loss_weights_and_clipping_norm(run):
    _, (r0, r1) = run
    assert r0["strategies"] == ["fsdp", "ddp"] and r0["sharded_types"] == ["DTensor"]
    assert r0["same_keys"] and r0["max_weight_diff"] < 1e-6
    for r in (r0, r1):
        assert r["loss_fsdp"] == pytest.approx(r["loss_ddp"], rel=1e-5, abs=1e-6)
        # the clipping norm is the global norm over the sharded gradients, the same on both ranks
        assert r["norm_fsdp"] == pytest.approx(r["norm_ddp"], rel=1e-5)
    assert r0["norm_fsdp"] == r1["norm_fsdp"]


def test_each_rank_holds_half_of_parameters_gradients_and_adam_state(run):
    _, (r0, r1) = run
    full = r0["bytes"]["full_params"]
    for r in (r0, r1):
        b = r["bytes"]
        assert b["ddp_params"] == full  # DDP: every rank holds everything
        for kind, whole in (("params", full), ("grads", full), ("adam", 2 * full)):
            assert 0.45 * whole <= b[kind] <= 0.55 * whole, (kind, b[kind], whole)


def test_accumulation_equals_one_big_batch_under_fsdp(run):
    _, (r0, _) = run
    assert r0["accumulation_max_diff"] < 1e-5


def test_mid_epoch_resume_is_bitwise_and_checkpoints_are_sharded(run):
    _, (r0, _) = run
    assert r0["resume_bitwise"] is True and r0["resume_point"] == [1, 11]  # 6 batches per epoch, 5 done
    assert r0["ckpt_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its shard


def test_checkpoints_move_between_ddp_and_fsdp(run):
    _, (r0, r1) = run
    assert r0["ddp_to_fsdp_equal"] is True and r0["fsdp_to_ddp_equal"] is True
    for r in (r0, r1):
        after_ddp, after_fsdp = r["ddp_to_fsdp_losses"]
        assert after_ddp == pytest.approx(after_fsdp, rel=1e-5)  # the optimizer state moved too
        assert r["fsdp_to_ddp_optimizer_steps"] == [11]  # Adam's step count came with it
    assert r0["fsdp_to_ddp_continued_max_diff"] < 1e-6


def test_mixed_precision_and_activation_checkpointing(run):
    _, (r0, _) = run
    for precision, dtype in (("bf16", "torch.bfloat16"), ("fp16", "torch.float16")):
        res = r0["mixed_precision"][precision]
        assert res["compute"] == [dtype] and res["master"] == ["torch.float32"]  # shards stay fp32
        assert res["forwards_per_step"] == 2  # each wrapped block's forward runs again in backward
        assert all(loss == loss and loss < 100 for loss in res["losses"])  # finite, trains
    assert r0["mixed_precision"]["bf16"]["losses"][0] == pytest.approx(r0["loss_fsdp"][0], rel=0.02)
    assert r0["mixed_precision"]["fp16"]["skipped_steps"]  # the gradient scaler works on DTensor gradients


def test_a_checkpoint_before_the_first_step_does_not_change_the_run(run):
    _, (r0, _) = run
    assert r0["early_save_unchanged"] is True


def test_bad_input_is_a_clear_error(run):
    _, (r0, _) = run
    assert "names ['Decoder'], which the model does not contain" in r0["errors"]["class_name"]
    assert "Block, Linear" in r0["errors"]["class_name"]
    assert "already wrapped by fully_shard" in r0["errors"]["already_wrapped"]


_ONE_PROCESS = textwrap.dedent("""
    import json, os, sys, warnings
    sys.path.insert(0, {scripts!r})
    sys.path.append(%r)  # tests/scripts: tiny_models, which the model part of fsdp_checks.py imports
    import torch
    from anyaccel import Accelerator
    import fsdp_checks_model as fm
    out, strategy = sys.argv[1], sys.argv[2]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = Accelerator(strategy=strategy, cpu=True)
    model, opt, loader, sched = fm.build(acc)
    acc.resume(os.path.join(out, "fsdp_ckpt"))  # written by 2 processes (resume: the loader's position too)
    expected = torch.load(os.path.join(out, "fsdp_at_checkpoint.pt"))
    got = acc.get_state_dict(model)
    print(json.dumps({{"equal": all(torch.equal(got[k], expected[k]) for k in expected),
                      "position": loader.state_dict()["position"], "strategy": acc.strategy.name,
                      "warnings": [str(w.message) for w in caught]}}))
""") % str(SCRIPTS)


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_a_checkpoint_of_two_processes_loads_in_one(run, strategy, tmp_path):
    out, _ = run
    model_module = tmp_path / "fsdp_checks_model.py"
    source = (SCRIPTS / "fsdp_checks.py").read_text()
    model_module.write_text(source[: source.index("r = None")])  # the model and helpers, without the run
    code = _ONE_PROCESS.format(scripts=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code, str(out), strategy], capture_output=True, text=True,
                          timeout=120, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["equal"] is True and res["strategy"] == strategy
    assert res["position"] == 10  # 5 batches of 8 x 2 processes = 10 batches of 8 in one process
    if strategy == "fsdp":  # FSDP on one process says what happens
        assert any("one process: there is nothing to shard" in w for w in res["warnings"])


def test_save_model_loads_into_a_plain_module_without_anyaccel(run, tmp_path):
    out, _ = run
    code = textwrap.dedent("""
        import sys
        class NoAnyaccel:  # the reader must not need anyaccel
            def find_spec(self, name, path=None, target=None):
                if name == "anyaccel" or name.startswith("anyaccel."):
                    raise ImportError("anyaccel is not installed here")
        sys.meta_path.insert(0, NoAnyaccel())
        import torch
        from safetensors.torch import load_file
        weights = load_file(sys.argv[1] + "/exported/model.safetensors")
        expected = torch.load(sys.argv[1] + "/exported_expected.pt")
        print(sorted(weights) == sorted(expected) and all(torch.equal(weights[k], expected[k]) for k in expected))
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=60,
                          env=clean_env())
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr[-2000:]


def test_launch_flags_reach_a_plain_accelerator(tmp_path):
    """`anyaccel launch --fsdp_*` (Accelerate's flag names) selects FSDP2 in every worker's plain
    `Accelerator()`; the config file's fsdp_config does the same."""
    proc = anyaccel("launch", "--num_processes", "2", "--cpu", "--fsdp_transformer_layer_cls_to_wrap", "Linear",
                    "--fsdp_activation_checkpointing", "true", "--dynamo_backend", "eager",
                    SCRIPTS / "report_strategy.py", tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(2):
        report = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert report == {"strategy": "fsdp", "world": 2, "wrap": ["Linear"], "ac": True, "dynamo": "eager",
                          "sharded": ["DTensor"]}


def test_set_state_dict_type_and_rank0_only_full_loading_as_accelerate(run):
    """accelerator.state.fsdp_plugin exists under strategy="fsdp" (as in Accelerate);
    set_state_dict_type("FULL_STATE_DICT") makes the next save_state write full files; loading them
    under FSDP2 reads each file on rank 0 only and gives every rank its shards of the same weights
    and optimizer state; a checkpoint of another model raises on both ranks (nobody waits); a
    directory per process is refused under FSDP (each rank holds only a part)."""
    _, (r0, r1) = run
    assert r0["state_dict_type_before"] == "SHARDED_STATE_DICT"
    assert "model.safetensors" in r0["switched_files"] and "optimizer.bin" in r0["switched_files"]
    assert "sharded" not in r0["switched_files"]
    assert r0["rank0_reads"] == {"model": 1, "optimizer": 1} and r1["rank0_reads"] == {"model": 0, "optimizer": 0}
    assert r0["rank0_load_equal"] is True
    assert r0["rank0_optimizer_steps"] == r1["rank0_optimizer_steps"] == [3]
    assert r0["rank0_mismatch"].startswith("CheckpointError: checkpoint") and "different model" in r0["rank0_mismatch"]
    assert r1["rank0_mismatch"] == r0["rank0_mismatch"] + " (found by process 0)"
    for r in (r0, r1):
        # refused on both ranks, naming the strategy whose checkpoint every process shares (the wording
        # depends on which check sees it first: the directory agreement, or the main-only-save detection)
        assert r["own_dirs"].startswith("CheckpointError: ") and "own_dir" in r["own_dirs"], r["own_dirs"]
        assert "'fsdp' strategy" in r["own_dirs"] and "every process" in r["own_dirs"], r["own_dirs"]


def test_a_checkpoint_that_cannot_load_under_fsdp_raises_on_every_rank_none_waits(run):
    """Rank 0 alone reads a full checkpoint under FSDP2; what it cannot load raises on both ranks:
    one optimizer over two prepared models (saved under DDP: FSDP2 loads an optimizer into one
    model) — found by every rank itself —, and a saved optimizer with other parameter groups —
    found by rank 0 and sent to rank 1. Before, rank 0 raised alone and rank 1 waited for ever."""
    _, (r0, r1) = run
    assert r0["two_models_one_optimizer"].startswith("CheckpointError: ") and \
        "this optimizer's parameters are spread over several prepared models" in r0["two_models_one_optimizer"]
    assert r1["two_models_one_optimizer"] == r0["two_models_one_optimizer"]
    assert r0["optimizer_groups_differ"].startswith("CheckpointError: the saved optimizer state has parameter groups "
                                                    "of [8] parameters, this optimizer [2, 6]")
    assert r1["optimizer_groups_differ"] == r0["optimizer_groups_differ"] + " (found by process 0)"
