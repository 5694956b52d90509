"""diffusers' ``train_*.py`` shapes run as under Accelerate 1.15 (issue 37 item 1).

tests/compat/diffusers_train.py is written for Accelerate, in the shape of diffusers' scripts
(the lines that touch Accelerate are in its docstring). Each test swaps its imports with the
command docs/guides/accelerate.md prints (the real ``sed``) and runs it under anyaccel: one
process, and two DDP processes under ``anyaccel launch`` — trackers started on the main process,
``log`` on every rank, ``save_state`` on the main process only with ``checkpoints_total_limit``
pruning, resume with ``load_state`` on every rank restoring the EMA weights. Each job resumes
twice, as diffusers does (``--resume_from_checkpoint latest``, ``first_epoch``/``resume_step``,
``continue`` over the batches done): in the middle of an epoch, then at an epoch boundary; every
rank trains on exactly the uninterrupted run's batches, and in one process the final weights and
EMA weights are bitwise those of an uninterrupted run in the same job. The
one-process run is compared with Accelerate 1.15 running the script as written.
tests/compat/main_only_sharded.py is the layout where the main process cannot save alone
(FSDP2): one clear error, the job ends.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import SCRIPTS, anyaccel, clean_env, warm_launch
from test_as_accelerate import documented_command

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
    """``{(rank, run): facts}`` from the FACTS lines every rank prints per run (diffusers_train.RUNS)."""
    found = {}
    for line in output.splitlines():
        if line.startswith("FACTS "):
            item = json.loads(line[len("FACTS "):])
            found[(item["rank"], item["run"])] = item
    return found


def assert_resumed_bitwise(found, rank, steps_per_epoch, bitwise=True):
    """The chain interrupted (4 steps) -> resumed mid-epoch (to 6) -> resumed at the boundary (to 8)
    trains on exactly the uninterrupted run's batches, in its order (each resume skips the batches
    done once), and with ``bitwise`` ends bitwise where the uninterrupted 8 steps end. Under DDP a
    checkpoint saved on the main process alone holds rank 0's RNG state only, and the other ranks
    keep theirs on load, as under Accelerate: their noise after a resume is not the uninterrupted
    run's, so the weights are not compared bitwise there."""
    chain = [found[(rank, run)] for run in ("interrupted", "mid_epoch", "boundary")]
    whole = found[(rank, "uninterrupted")]
    mid, boundary = chain[1], chain[2]
    accumulation = 2
    assert (mid["resumed_from"], mid["first_epoch"], mid["resume_step"]) == (
        "checkpoint-4", 4 // steps_per_epoch, 4 % steps_per_epoch * accumulation)  # in the middle of an epoch
    assert mid["resume_step"] > 0 and mid["global_step"] == 6
    assert (boundary["resumed_from"], boundary["first_epoch"], boundary["resume_step"]) == (
        "checkpoint-6", 6 // steps_per_epoch, 0)  # at an epoch boundary
    for resumed in (mid, boundary):
        assert resumed["ema_restored"] and resumed["model_restored"] and resumed["ema_step_restored"]
    assert sum((run["batches"] for run in chain), []) == whole["batches"]  # every batch once, in order
    assert boundary["optimizer_steps"] == whole["optimizer_steps"] == [8]
    if bitwise:
        assert sum((run["losses"] for run in chain), []) == whole["losses"]  # the same noise too
        assert (boundary["weights"], boundary["ema_weights"]) == (whole["weights"], whole["ema_weights"])


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
    first, reference = ours[(0, "interrupted")], theirs[(0, "interrupted")]
    assert first["hooks"] and first["accelerate_version"] == "1.15.0" == reference["accelerate_version"]
    assert set(first["checkpoint_files"]) - ANYACCEL_FILES == set(reference["checkpoint_files"]) == {
        "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "unet/config.json",
        "unet/diffusion_pytorch_model.safetensors", "unet_ema/config.json", "unet_ema/diffusion_pytorch_model.safetensors"}
    for run in ("interrupted", "uninterrupted"):
        for key in ("checkpoints", "saved", "losses", "model", "ema", "weights", "ema_weights", "lr", "global_step",
                    "trackers", "validation_restored_weights"):
            assert ours[(0, run)][key] == theirs[(0, run)][key], (run, key)  # bit for bit, in one process
    assert first["checkpoints"] == ["checkpoint-2", "checkpoint-4"]
    assert ours[(0, "boundary")]["checkpoints"] == ["checkpoint-6", "checkpoint-8"]
    assert_resumed_bitwise(ours, 0, steps_per_epoch=6)  # 24 images, batch 2, accumulation 2
    assert theirs[(0, "mid_epoch")]["ema_restored"] and theirs[(0, "boundary")]["ema_restored"]


@pytest.mark.slow
def test_two_processes_save_on_the_main_process_and_resume_on_every_rank(tmp_path):
    folder = swapped(tmp_path)
    proc = anyaccel("launch", "--num_processes", "2", "--cpu", "train.py", "--output_dir", "out", cwd=folder,
                    timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    found = {}  # from the files each rank writes (printed lines of two ranks can interleave)
    for path in folder.glob("out*_facts_*.json"):
        item = json.loads(path.read_text())
        found[(item["rank"], item["run"])] = item
    runs = ("interrupted", "mid_epoch", "boundary", "uninterrupted")
    assert set(found) == {(rank, run) for rank in (0, 1) for run in runs}
    for run in runs:
        main, other = found[(0, run)], found[(1, run)]
        assert main["lr"] == other["lr"] == pytest.approx(0.008)  # --scale_lr: num_processes counted
        assert main["hooks"] and other["hooks"]
        assert main["weights"] == other["weights"] and main["ema"] == other["ema"]  # DDP: one model; EMA on every rank
        assert main["trackers"] == ["tensorboard"] and other["trackers"] == []  # started on the main process only
        assert other["saved"] == [] and main["validation_restored_weights"]
    assert found[(0, "interrupted")]["saved"] == [2, 4] and found[(0, "uninterrupted")]["saved"] == [2, 4, 6, 8]
    assert found[(0, "boundary")]["checkpoints"] == ["checkpoint-6", "checkpoint-8"]
    assert set(found[(0, "boundary")]["checkpoint_files"]) - ANYACCEL_FILES == {
        "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "unet/config.json",
        "unet/diffusion_pytorch_model.safetensors", "unet_ema/config.json", "unet_ema/diffusion_pytorch_model.safetensors"}
    manifest = json.loads((folder / "out" / "checkpoint-8" / "anyaccel_checkpoint.json").read_text())
    assert manifest["saved_by"] == "the main process alone" and manifest["world_size"] == 2
    for rank in (0, 1):  # load_state on every rank restored what the main process saved alone
        assert_resumed_bitwise(found, rank, steps_per_epoch=3, bitwise=False)  # 6 batches per rank, accumulation 2
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
    assert "process 1: it is in forward (parameter all-gather) at tests/compat/main_only_sharded.py:26" in headline
    assert elapsed < 240, elapsed  # loose: ~1 s of finding out, then the launcher stops rank 1


def _model_weights(directory):
    from safetensors.torch import load_file

    files = sorted(p for p in directory.iterdir() if p.name.startswith("model") and p.suffix == ".safetensors")
    assert files, sorted(p.name for p in directory.iterdir())
    return [load_file(str(p)) for p in files]


@pytest.mark.slow
def test_counts_that_differ_between_processes_neither_end_the_job_nor_make_a_save_alone(tmp_path):
    """tests/compat/participation_checks.py, three DDP processes in one job: uneven loaders and an
    evaluation on the main process before a save on every process; a late process of three; saves
    between accumulation micro-steps; load_state on the main process alone loading there (as
    Accelerate under DDP: one warning, nobody waits, the others keep their weights); resume() on
    the main process alone refused; two processes asking the hang doctor at once; a long evaluation
    forward on one process before a save on every process. A save on the main process alone writes what a save on every
    process writes at the same point."""
    import torch

    proc = warm_launch(3, SCRIPTS / "participation_checks.py", tmp_path, timeout=400)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-5000:]
    for case in ("uneven", "late", "accumulation", "ask", "long-forward"):
        for rank in range(3):
            assert f"CASE {case} {rank} ok" in out, (case, rank, out[-3000:])
    for rank in (1, 2):  # B2: each of two requests made at once is answered by every process
        asked = json.loads(re.search(rf"ASKED {rank} (\{{.*?\}})", out).group(1))  # (lines of ranks may interleave)
        assert asked["answered"] == [0, 1, 2], asked
    loaded = json.loads(re.search(r"MAIN-ONLY LOAD (\{.*?\})\n", out).group(1))
    assert loaded["first"].startswith(f"load_state({str(tmp_path / 'micro')!r}) was called by the main process alone")
    assert loaded == dict(loaded, warnings=1, weights_loaded=True, rng_restored=True, micro_step_kept=True), loaded
    assert loaded["hook_refused"].startswith(f"barrier (a collective) was called during load_state("
                                             f"{str(tmp_path / 'micro')!r}), which the main process runs alone"), loaded
    assert "MAIN-ONLY RESUME REFUSED: resume(" + repr(str(tmp_path / "micro")) + ") was called by the main process " \
        "alone" in out and "NOT REFUSED" not in out
    for rank in range(3):  # the replicas went on apart, by what the load changed, until every process loaded
        apart = json.loads(re.search(rf"APART {rank} (\{{.*?\}})", out).group(1))
        assert apart == {"others_equal": True, "main_differs": True, "by_the_load": True}, (rank, apart)
    for name in ("uneven", "late", "micro", "long-forward"):  # long-forward: a long forward is no absence
        manifest = json.loads((tmp_path / name / "anyaccel_checkpoint.json").read_text())
        assert manifest["saved_by"] == "every process", (name, manifest["saved_by"])
        assert all((tmp_path / name / f"random_states_{r}.pkl").exists() for r in range(3)), name
    for name in ("late", "micro"):
        alone = json.loads((tmp_path / f"{name}-main-only" / "anyaccel_checkpoint.json").read_text())
        assert alone["saved_by"] == "the main process alone" and alone["world_size"] == 3
        together, by_main = _model_weights(tmp_path / name), _model_weights(tmp_path / f"{name}-main-only")
        assert len(together) == len(by_main)
        for a, b in zip(together, by_main):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
