"""DeepSpeed ZeRO 1/2/3 on CPU with gloo: 2 real processes through `anyaccel launch`, one launch for
every check (tests/strategies/deepspeed/deepspeed_checks.py), each asserted here.

Tolerances: against one process on the same global batches, DeepSpeed averages the two ranks'
gradients (a reduce in another order than one mean over the global batch) and clips with its own
formula (divides by ``(norm + 1e-6) / max_norm`` where torch multiplies by its inverse): float32
rounding, observed 3.3e-7 after 4 AdamW steps with clipping; asserted 1e-5. The clipping norms agree
to 1e-6 relative. Resume and the moves between DeepSpeed and FSDP2 are bitwise.
"""

import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import CONSOLE_SCRIPT, ROOT, SCRIPTS, anyaccel, clean_env

# one 2-process launch for every check: about 2 minutes on a quiet 2-core machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500), pytest.mark.skipif(__import__("importlib").util.find_spec("deepspeed") is None,
                                                   reason="needs deepspeed (pip install anyaccel[deepspeed])")]


def _launch(out, *checks, timeout=900):
    """`anyaccel launch --num_processes 2 --cpu deepspeed_checks.py OUT CHECKS...`; what each rank wrote.
    A fixed mmap threshold gives every large tensor its own mapping, returned when freed, so the
    resident-memory high-water marks measure the tensors alive at the peak, not glibc's cache."""
    env = clean_env(MALLOC_MMAP_THRESHOLD_="131072")
    proc = anyaccel("launch", "--num_processes", 2, "--cpu", SCRIPTS / "deepspeed_checks.py", out, *checks,
                    timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed")
    # first a job that a preemption signal to its launcher stops (exit 75, a checkpoint written);
    # the main launch resumes from it among its checks
    code, output = _signal_at_marker(out, "preempt", signal.SIGUSR1)
    assert code == 75 and "every rank saved" in output, output[-5000:]
    return out, _launch(out)


def _signal_at_marker(out, check, sig, timeout=600):
    """Launch ``check``; send ``sig`` to the launcher once the script wrote OUT/preempt_marker."""
    cmd = [sys.executable, "-c", CONSOLE_SCRIPT, "launch", "--num_processes", "2", "--cpu",
           str(SCRIPTS / "deepspeed_checks.py"), str(out), check]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env())
    deadline = time.monotonic() + timeout
    while not (out / "preempt_marker").exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the job never reached the marker step"
        time.sleep(0.05)
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=timeout)
    return proc.returncode, output


def _ok(result, name):
    assert "error" not in result.get(name, {}), result[name].get("error")
    return result[name]


@pytest.mark.parametrize("stage", ["1", "2", "3"])
def test_zero_stages_on_two_processes_match_one_process(run, stage):
    _, (r0, r1) = run
    e0, e1 = _ok(r0, "equivalence")[stage], _ok(r1, "equivalence")[stage]
    assert e0["types"] == ["DeepSpeedEngine", "EngineOptimizer", "DEEPSPEED"]
    assert e0["keys"] and e0["max_diff"] < 1e-5
    assert e0["norms"] == e1["norms"] and e0["norms"] == pytest.approx(e0["ref_norms"], rel=1e-6)
    assert e0["norms"][0] > 0.5  # max_norm=0.5 really clipped
    assert e0["lr"] == pytest.approx(1e-2 * 0.5 ** 4)  # the torch scheduler stepped with the engine's steps
    # gathered to rank 0 under ZeRO-3 (every rank calls it); below, each rank has the whole model
    assert e1["state_dict_elsewhere"] == (0 if stage == "3" else 12)
    half = {"1": 1.0, "2": 1.0, "3": 0.5}[stage]  # ZeRO-3 partitions the parameters themselves
    assert e0["local_param_fraction"] == pytest.approx(half, abs=0.01)


def test_accumulation_steps_match_one_big_batch(run):
    _, (r0, _) = run
    res = _ok(r0, "accumulation")
    assert res["max_diff"] < 1e-6 and res["engine_gas"] == 2 and res["optimizer_steps"] == 4


@pytest.mark.parametrize("stage", ["1", "2", "3"])
def test_mid_epoch_resume_is_bitwise_in_deepspeeds_format(run, stage):
    _, (r0, _) = run
    res = _ok(r0, "resume")[stage]
    assert res["resume_point"] == [0, 3] and res["bitwise"] is True, res
    assert {"anyaccel_deepspeed.json", "latest", "state", "zero_to_fp32.py"} <= set(res["files"])


def test_bf16_computes_in_bf16_and_saves_fp32_masters(run):
    _, (r0, _) = run
    res = _ok(r0, "precision")
    for stage in ("2", "3"):
        assert res[stage]["compute"] == ["torch.bfloat16"] and res[stage]["saved"] == ["torch.float32"]
        assert res[stage]["bf16"] is True and res[stage]["scaler"] is True  # no torch GradScaler
        assert res[stage]["losses"][0] == pytest.approx(res["fp32_losses"][0], rel=0.02)
        assert all(loss == loss for loss in res[stage]["losses"])


def test_optimizer_and_scheduler_from_the_config_with_auto_values(run):
    _, (r0, _) = run
    res = _ok(r0, "config_objects")
    assert res["optimizer"] == "AdamW" and res["optimizer_params"] == {"lr": 0.02, "weight_decay": 0.1}
    assert res["filled"] == {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                             "train_batch_size": 16, "gradient_clipping": 0.0}
    assert res["scheduler_params"]["warmup_num_steps"] == 4 and res["scheduler_params"]["warmup_max_lr"] == 0.02
    # WarmupLR, stepped by the engine once per optimizer step: 0.02 * step / 4 for steps 0..3
    assert res["lrs"] == pytest.approx([0.0, 0.005, 0.01, 0.015])
    assert res["steps"] == [4, 4] and res["loaded_equal"] is True and res["loaded_lr"] == pytest.approx(0.015)


@pytest.mark.parametrize("move", ["zero3_to_fsdp", "fsdp_to_zero3"])
def test_one_checkpoint_moves_between_zero3_and_fsdp2(run, move):
    _, (r0, r1) = run
    res = _ok(r0, "cross_engine")[move]
    assert res["weights_bitwise"] is True
    assert res["optimizer_problem"] is None and res["optimizer_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    assert res["position"] == 3 and res["lr"][0] == res["lr"][1]
    assert res["after_step_max_diff"] < 1e-6  # and training continues the same way
    assert _ok(r1, "cross_engine")[move]["position"] == 3
    if move == "zero3_to_fsdp":  # rank 0 alone converts DeepSpeed's files; rank 1 reads none of them
        assert (res["conversions"], _ok(r1, "cross_engine")[move]["conversions"]) == (1, 0)


def test_zero3_save_model_reloads_with_from_pretrained(run):
    _, (r0, r1) = run
    res = _ok(r0, "transformers")
    assert res["files"] == ["config.json", "model.safetensors"]  # one full file from the ZeRO-3 partitions
    assert res["tied_in_state"] and res["tied_after_load"]  # tied embeddings stored once, tied again on load
    assert res["reloaded_bitwise"] is True  # from_pretrained gives get_state_dict's weights exactly
    assert _ok(r1, "transformers")["keys_here"] == 0


def test_zero3_init_builds_a_transformers_model_partitioned(run):
    _, ranks = run
    for r in ranks:
        res = _ok(r, "zero3_init")
        assert res["partitioned"] and res["loss"] == res["loss"]
        assert res["local_param_mib"] == pytest.approx(res["model_mib"] / 2, rel=0.02)
        # no full copy per process: the peak while building stays well below the model's size
        assert res["peak_mib_zero3_init"] < 0.75 * res["model_mib"] < res["peak_mib_plain"], res


def test_preemption_saves_deepspeeds_checkpoint_and_resumes_bitwise(run):
    _, ranks = run
    points = [_ok(r, "preempt_resume")["resumed_at"] for r in ranks]
    assert points[0] == points[1] and points[0][0] == 0 and points[0][1] >= 2  # one step on every rank, after the marker
    assert ranks[0]["preempt_resume"]["checkpoint"] == "checkpoint_0"
    assert ranks[0]["preempt_resume"]["bitwise"] is True


@pytest.mark.jit_ops
def test_optimizer_offload_to_cpu_trains_like_torch_adamw_and_resumes(tmp_path):
    """ZeRO-2 with offload_optimizer_device="cpu" (DeepSpeed's CPU Adam, JIT-compiled with gcc on
    first use: make test-slow only). CPU Adam and torch's AdamW compute the same update with
    different float32 operation orders: weights agree to 1e-5 after 4 steps."""
    r0, r1 = _launch(tmp_path, "offload", timeout=1800)
    res = _ok(r0, "offload")
    assert res["optimizers"] == ["AdamW", "DeepSpeedCPUAdam"]
    assert res["max_diff_vs_torch_adamw"] < 1e-5 and res["resume_bitwise"] is True
    assert "error" not in r1.get("offload", {})


_PLAIN_SCRIPT = """
import json, sys
import torch
from anyaccel import Accelerator


def main():
    acc = Accelerator()  # no plugin: the launcher's --use_deepspeed --zero_stage ... decide
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, opt, loader = acc.prepare(model, opt, loader)
    losses = []
    for epoch in range(2):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(acc.gather(loss.detach()).mean().item())
    report = {"world": acc.num_processes, "strategy": acc.strategy.name, "engine": type(model).__name__,
              "engine_stage": model.zero_optimization_stage(), "plugin_stage": acc.deepspeed_plugin.zero_stage,
              "clipping": model.gradient_clipping(), "first": losses[0], "last": losses[-1]}
    with open(f"{sys.argv[1]}/rank{acc.process_index}.json", "w") as fh:
        json.dump(report, fh)
    acc.end_training()


if __name__ == "__main__":
    main()
"""


def test_accelerates_launch_flags_train_a_plain_accelerator_under_deepspeed(tmp_path):
    """`anyaccel launch --use_deepspeed --zero_stage 2 --gradient_clipping 0.5` and `Accelerator()`
    in the script, as with `accelerate launch`: the script trains in a DeepSpeed engine at ZeRO
    stage 2 with the clipping asked for. One short launch (about 30 s on a quiet 2-core machine)."""
    script = tmp_path / "train.py"
    script.write_text(_PLAIN_SCRIPT)
    proc = anyaccel("launch", "--num_processes", 2, "--cpu", "--use_deepspeed", "--zero_stage", 2,
                    "--gradient_clipping", 0.5, script, tmp_path, cwd=tmp_path, env=clean_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (report["world"], report["strategy"], report["engine"], report["engine_stage"], report["plugin_stage"],
                report["clipping"]) == (2, "deepspeed", "DeepSpeedEngine", 2, 2, 0.5), report
        assert report["last"] < report["first"], report
