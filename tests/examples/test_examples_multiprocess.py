"""Every example runs end to end with 2 real processes, started the way a user would start it.

``anyaccel launch --num_processes 2 --cpu`` or torchrun (``python -m torch.distributed.run``, what
ColossalAI and raw-DDP users start jobs with) for the launcher-started examples, the script itself
for the notebook flow (it calls ``notebook_launcher``), and two plain ``python`` processes with
SLURM's variables for the SLURM example (what ``srun`` does). Each run is a few steps on the
bundled digits; the assertions are on what a user reads in the output and finds on disk.
"""

import importlib.util
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from conftest import clean_env, torchrun
from project.test_example_docstrings import EXAMPLES  # helpers shared with the unit tests


def accuracy_lines(text, pattern):
    return [float(m) for m in re.findall(pattern, text)]


def anyaccel_launch(script, *args, home, timeout=180):
    """``anyaccel launch --num_processes 2 --cpu SCRIPT ARGS`` (what the README's `make demo` runs), with
    an empty ANYACCEL_HOME so no configuration file of this machine's user applies."""
    cmd = [sys.executable, "-m", "anyaccel.cli", "launch", "--num_processes", "2", "--cpu", str(script), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean_env(ANYACCEL_HOME=str(home)))
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}"
    return proc


# --------------------------------------------------------------------------------------------
# torchrun-started examples
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_pipeline_parallel_cuts_a_sequential_into_two_stages_and_learns(tmp_path):
    out = anyaccel_launch(EXAMPLES / "pipeline_parallel.py", "--epochs", 4, "--output_dir", tmp_path / "run",
                          home=tmp_path, timeout=300).stdout
    assert "process 0 holds stage(s) [0] of 2: layers 0, 2, 4 (41,344 parameters)" in out
    assert "process 1 holds stage(s) [1] of 2: layers 6, 8 (17,802 parameters)" in out
    final = accuracy_lines(out, r"test accuracy ([0-9.]+)")
    assert len(final) == 4 and final[-1] >= 0.85, out
    assert out.count("(360 images)") == 4  # every test image counted once per epoch (outputs reach every rank)
    spec = importlib.util.spec_from_file_location("pipeline_parallel", EXAMPLES / "pipeline_parallel.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    from safetensors.torch import load_file

    plain = example.build_model()  # never pipelined: every stage's weights under their names, in one file
    plain.load_state_dict(load_file(str(tmp_path / "run" / "model" / "model.safetensors")), strict=True)
    x, y = example.digits_datasets()[1].tensors
    assert (plain(x).argmax(1) == y).float().mean() >= 0.85


@pytest.mark.slow
def test_fsdp_transformer_shards_and_learns(tmp_path):
    out = anyaccel_launch(EXAMPLES / "fsdp_transformer.py", "--out", tmp_path / "run", home=tmp_path, timeout=300).stdout
    assert "this process holds 51,400 of 102,800 parameters (50%)" in out
    final = accuracy_lines(out, r"token accuracy ([0-9.]+)")
    assert len(final) == 5 and final[-1] >= 0.9, out
    assert out.count("(512 sequences)") == 5  # every sequence of the test set counted once per epoch
    spec = importlib.util.spec_from_file_location("fsdp_transformer", EXAMPLES / "fsdp_transformer.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    from safetensors.torch import load_file

    plain = example.ReverseTransformer(16, 64, 2, 12)  # a plain module, no anyaccel involved
    plain.load_state_dict(load_file(str(tmp_path / "run" / "model" / "model.safetensors")))
    tokens = torch.randint(0, 16, (4, 12))
    assert (plain(tokens).argmax(-1) == tokens.flip(1)).float().mean() >= 0.9


@pytest.mark.slow
def test_train_digits_reaches_90_percent(tmp_path):
    out = anyaccel_launch(EXAMPLES / "train_digits.py", home=tmp_path).stdout
    assert "2 process(es) on cpu" in out
    final = accuracy_lines(out, r"final test accuracy ([0-9.]+)")
    assert len(final) == 1 and final[0] >= 0.90, out
    assert out.count("(360 samples)") == 8  # every epoch: the whole test split, each sample once


@pytest.mark.slow
def test_resnet_cifar_engine_with_colossalai_config(tmp_path):
    cfg = tmp_path / "config.py"
    cfg.write_text("BATCH_SIZE = 16\nNUM_EPOCHS = 2\nLEARNING_RATE = 0.05\nfp16 = dict(mode='torch')\n")
    out = torchrun(EXAMPLES / "resnet_cifar_engine.py", "--config", cfg, "--max_steps", "3", "--limit", "96")
    text = out.stdout + out.stderr
    assert "[rank 0] 2 process(es), device cpu, mixed precision fp16" in text
    assert "[rank 1]" not in text  # the logger is main-process-only by default
    if importlib.util.find_spec("torchvision") is None:
        assert "torchvision cannot be imported" in text and "falling back from resnet18 to SmallCNN" in text
    epochs = re.findall(r"Epoch (\d) - train loss: .*acc: ([0-9.]+) \((\d+) samples\), lr: ([0-9.e-]+)", text)
    assert [(e, n) for e, _, n, _ in epochs] == [("0", "96"), ("1", "96")], text
    assert float(epochs[0][3]) == pytest.approx(0.025) and float(epochs[1][3]) == 0.0  # cosine, stepped per epoch


@pytest.mark.slow
def test_lightning_style_logs_synced_metrics(tmp_path):
    import csv

    out = anyaccel_launch(EXAMPLES / "lightning_style_imagenet.py", "--epochs", "2", "--max_steps", "4",
                          "--output_dir", tmp_path, home=tmp_path).stdout
    accs = accuracy_lines(out, r"val acc1 ([0-9.]+)")
    assert len(accs) == 2 and "(360 samples)" in out, out
    with open(tmp_path / "lightning_style" / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    steps = [r for r in rows if r["train_loss"]]
    assert [int(r["step"]) for r in steps] == list(range(8))
    assert all(0.0 <= float(r["train_acc1"]) <= 1.0 for r in steps)
    epochs = [r for r in rows if r["val_acc1_epoch"]]
    assert [round(float(r["val_acc1_epoch"]), 4) for r in epochs] == accs


@pytest.mark.slow
def test_gradient_accumulation_steps_optimizer_and_scheduler_once_per_real_step(tmp_path):
    # 360 samples / (2 processes x 8) = 23 micro-batches per process (the last one padded);
    # with 4 accumulation steps: 5 full groups + the last batch, which always steps → 6 steps
    out = anyaccel_launch(EXAMPLES / "gradient_accumulation.py", "--limit", "360", "--epochs", "2",
                          "--gradient_accumulation_steps", "4", home=tmp_path).stdout
    assert "effective batch 64" in out
    assert out.count("6 optimizer steps for 23 micro-batches") == 2, out
    assert "scheduler stepped 12 times for 12 planned optimizer steps" in out


@pytest.mark.slow
def test_resume_mid_epoch_matches_an_uninterrupted_run(tmp_path):
    common = ["--limit", "320", "--epochs", "2", "--checkpointing_steps", "4"]  # 10 batches per epoch

    def run(out_dir, *extra):
        return torchrun(EXAMPLES / "resume_from_checkpoint.py", *common, "--output_dir", out_dir, *extra).stdout

    first = run(tmp_path / "a", "--stop_after_step", "9")
    assert "stopping after step 9" in first and "checkpoint_1" in first
    resumed = run(tmp_path / "a")  # the same command again (without the simulated interruption)
    assert "checkpoint_1: epoch 0, step 8" in resumed, resumed
    reference = run(tmp_path / "b")

    def checksum(text):
        found = re.findall(r"finished at step (\d+); weights checksum ([-0-9.]+)", text)
        assert found, text
        return found[0]

    assert checksum(resumed) == checksum(reference)
    assert checksum(reference)[0] == "20"
    # total_limit=2 keeps only the newest two checkpoints
    assert sorted(os.listdir(tmp_path / "a" / "checkpoints")) == ["checkpoint_3", "checkpoint_4"]


# --------------------------------------------------------------------------------------------
# the notebook flow: the script calls notebook_launcher itself
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fashion_cnn_notebook_launcher(tmp_path):
    if importlib.util.find_spec("anyaccel.launch.notebook") is None:
        pytest.skip("anyaccel.launch.notebook (notebook_launcher) is not available yet")
    weights = tmp_path / "fashion_cnn.pt"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "fashion_cnn_notebook.py"), "--epochs", "1",
                           "--max_steps", "3", "--output", str(weights)],
                          capture_output=True, text=True, timeout=240, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.count("training on 2 process(es)") == 1, out
    assert re.search(r"epoch 0: loss [0-9.]+, test accuracy [0-9.]+ \(360 samples\)", out), out
    assert "reloaded" in out and weights.exists()
    state = torch.load(weights, weights_only=True)
    assert not any(k.startswith("module.") for k in state)  # unwrap_model removed the DDP prefix


# --------------------------------------------------------------------------------------------
# SLURM: two plain processes with the variables srun sets
# --------------------------------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ddp_slurm_resnet_under_srun_variables(tmp_path):
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = clean_env(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                        SLURM_NTASKS="2", SLURM_NNODES="1", SLURM_NODEID="0", SLURM_NODELIST="localhost",
                        SLURM_TASKS_PER_NODE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [sys.executable, str(EXAMPLES / "ddp_slurm_resnet.py"), "--epochs", "2", "--max_steps", "3",
               "--output_dir", str(tmp_path / "ckpt")]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=180)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rc, out, err in results:
        assert rc == 0, out + err
    main_out, other_out = results[0][1], results[1][1]
    assert "launched by slurm: 2 process(es) on 1 node(s)" in main_out
    # rank 1 prints nothing of its own (torch 2.9's gloo prints "[Gloo] Rank 1 is connected ..." itself)
    assert [line for line in other_out.splitlines() if line.strip() and not line.startswith("[Gloo]")] == []
    timings = re.findall(r"epoch (\d): loss [0-9.]+, val accuracy [0-9.]+, train time [0-9.]+ s, "
                         r"([0-9.]+) images/s \((\d+) images on 2 processes\)", main_out)
    assert [(e, n) for e, _, n in timings] == [("0", "192"), ("1", "192")], main_out  # 3 steps x 32 x 2
    assert "total time" in main_out
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["epoch_0.pt", "epoch_1.pt"]
    ckpt = torch.load(tmp_path / "ckpt" / "epoch_1.pt", weights_only=True)
    assert ckpt["epoch"] == 1 and not any(k.startswith("module.") for k in ckpt["model"])


@pytest.mark.slow
def test_expert_parallel_splits_the_experts_of_a_qwen3_moe_over_two_processes(tmp_path):
    pytest.importorskip("transformers")
    out = anyaccel_launch(EXAMPLES / "expert_parallel.py", "--steps", 6, home=tmp_path, timeout=300).stdout
    assert "process 0: experts 0..3 of each MoE layer (ep 2" in out and "process 1: experts 4..7" in out, out
    losses = accuracy_lines(out, r"loss ([0-9.]+),")
    assert len(losses) == 2 and losses[-1] < losses[0], out
