"""diffusers' ``train_*.py`` shapes run as under Accelerate 1.15 (issue 37 item 1).

tests/scripts/diffusers_train.py is written for Accelerate, in the shape of diffusers' scripts
(the lines that touch Accelerate are in its docstring). Each test swaps its imports with the
command docs/guides/accelerate.md prints (the real ``sed``) and runs it under anyaccel: one
process, and two DDP processes under ``anyaccel launch`` — trackers started on the main process,
``log`` on every rank, ``save_state`` on the main process only with ``checkpoints_total_limit``
pruning, resume with ``load_state`` on every rank restoring the EMA weights. The one-process run is
compared with Accelerate 1.15 running the script as written. tests/scripts/main_only_sharded.py
is the layout where the main process cannot save alone (FSDP2): one clear error, the job ends.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest

from conftest import SCRIPTS, anyaccel, clean_env
from unit.test_as_accelerate import documented_command

pytest.importorskip("diffusers", reason="the test extra installs diffusers (its UNet2DModel and EMAModel)")

SCRIPT = SCRIPTS / "diffusers_train.py"
ANYACCEL_FILES = {"anyaccel_checkpoint.json", "dataloader.json"}  # what anyaccel writes besides Accelerate's files


def swapped(tmp_path):
    """The script in ``tmp_path/anyaccel/train.py`` after the guide's ``sed`` command."""
    folder = tmp_path / "anyaccel"
    folder.mkdir()
    shutil.copy(SCRIPT, folder / "train.py")
    subprocess.run(["bash", "-c", documented_command()], cwd=folder, check=True, timeout=60)
    text = (folder / "train.py").read_text()
    assert "import anyaccel.as_accelerate as accelerate" in text and "from accelerate" not in text
    return folder


def facts(output: str) -> dict:
    """``{(rank, resumed): facts}`` from the FACTS lines every rank prints per run."""
    found = {}
    for line in output.splitlines():
        if line.startswith("FACTS "):
            item = json.loads(line[len("FACTS "):])
            found[(item["rank"], item["resume"])] = item
    return found


def run_python(folder, timeout=600) -> dict:
    proc = subprocess.run([sys.executable, "train.py", "--output_dir", "out"], cwd=folder, env=clean_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return facts(proc.stdout)


@pytest.mark.slow
def test_one_process_matches_accelerate_checkpoint_for_checkpoint(tmp_path):
    ours = run_python(swapped(tmp_path))
    original = tmp_path / "accelerate"
    original.mkdir()
    shutil.copy(SCRIPT, original / "train.py")
    theirs = run_python(original)  # Accelerate 1.15, the script as written
    first, reference = ours[(0, False)], theirs[(0, False)]
    assert first["hooks"] and first["accelerate_version"] == "1.15.0" == reference["accelerate_version"]
    assert set(first["checkpoint_files"]) - ANYACCEL_FILES == set(reference["checkpoint_files"]) == {
        "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "unet/config.json",
        "unet/diffusion_pytorch_model.safetensors", "unet_ema/config.json", "unet_ema/diffusion_pytorch_model.safetensors"}
    for key in ("checkpoints", "saved", "losses", "model", "ema", "lr", "global_step", "trackers",
                "validation_restored_weights"):
        assert first[key] == reference[key], key  # the same numbers, bit for bit, in one process
    resumed = ours[(0, True)]
    assert resumed["resumed_from"] == "checkpoint-6" and resumed["checkpoints"] == ["checkpoint-6", "checkpoint-8"]
    assert resumed["ema_restored"] and resumed["model_restored"] and resumed["ema_step_restored"]
    assert resumed["global_step"] == 8 and theirs[(0, True)]["ema_restored"]


@pytest.mark.slow
def test_two_processes_save_on_the_main_process_and_resume_on_every_rank(tmp_path):
    folder = swapped(tmp_path)
    proc = anyaccel("launch", "--num_processes", "2", "--cpu", "train.py", "--output_dir", "out", cwd=folder,
                    timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    found = facts(proc.stdout)
    assert set(found) == {(0, False), (1, False), (0, True), (1, True)}
    for resumed in (False, True):
        main, other = found[(0, resumed)], found[(1, resumed)]
        assert main["lr"] == other["lr"] == pytest.approx(0.008)  # --scale_lr: num_processes counted
        assert main["hooks"] and other["hooks"]
        assert main["model"] == other["model"] and main["ema"] == other["ema"]  # DDP: one model; EMA on every rank
        assert main["trackers"] == ["tensorboard"] and other["trackers"] == []  # started on the main process only
        assert other["saved"] == [] and main["validation_restored_weights"]
    assert found[(0, False)]["saved"] == [2, 4, 6] and found[(0, False)]["checkpoints"] == ["checkpoint-4", "checkpoint-6"]
    assert set(found[(0, False)]["checkpoint_files"]) - ANYACCEL_FILES == {
        "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "unet/config.json",
        "unet/diffusion_pytorch_model.safetensors", "unet_ema/config.json", "unet_ema/diffusion_pytorch_model.safetensors"}
    manifest = json.loads((folder / "out" / "checkpoint-8" / "anyaccel_checkpoint.json").read_text())
    assert manifest["saved_by"] == "the main process alone" and manifest["world_size"] == 2
    for rank in (0, 1):  # load_state on every rank restored what the main process saved alone
        resumed = found[(rank, True)]
        assert resumed["resumed_from"] == "checkpoint-6" and resumed["global_step"] == 8
        assert resumed["ema_restored"] and resumed["model_restored"] and resumed["ema_step_restored"]
    events = list((folder / "out" / "logs" / "train_shapes").glob("events.out.tfevents.*"))
    assert events and len({p.name.split(".")[-2] for p in events}) == 1  # written by one process (pid in the name)
    assert "saved by the main process alone" in proc.stderr  # the resume says whose RNG states it holds


@pytest.mark.slow
def test_main_only_checkpoints_under_fsdp2_raise_one_clear_error_and_the_job_ends(tmp_path):
    start = time.monotonic()
    proc = anyaccel("launch", "--num_processes", "2", "--cpu", SCRIPTS / "main_only_sharded.py", tmp_path, timeout=300)
    elapsed = time.monotonic() - start
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 1, out + err
    assert "rank 0 saved with every process" in out and "rank 1 saved with every process" in out
    assert "MAIN-ONLY LOAD REFUSED: load_state(" in out and "NOT REFUSED" not in out
    assert ("OTHER-ONLY SAVE REFUSED: save_state('" + str(tmp_path / "checkpoint-by-1") + "') was called on process 1 "
            "but not on the main process") in out
    headline = next(line for line in err.splitlines() if line.startswith("anyaccel launch: error:"))
    assert "rank 0 of 2 failed" in headline
    assert ("CheckpointError: save_state('" + str(tmp_path / "checkpoint-3") + "') was called by the main process "
            "alone (under `if accelerator.is_main_process:`), but the 'fsdp' strategy keeps the model and optimizer "
            "state sharded over every process") in headline
    assert "move the call out of the `if accelerator.is_main_process:` block" in headline
    assert "process 1: it runs its own code at tests/scripts/main_only_sharded.py:26" in headline
    assert elapsed < 240, elapsed  # loose: ~1 s of finding out, then the launcher stops rank 1
