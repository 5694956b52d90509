"""Asynchronous checkpoints (save_state(async_save=True), anyaccel/checkpoint/async_save.py).

The multi-process checks (tests/checkpoint/async_checkpoint_checks.py) run forked from the suite's
warm launcher with the strategy's variable (what `anyaccel launch --strategy S` tells the workers),
and the SIGKILL check through `anyaccel launch`:
the files of a save taken at step 3 are written only after the epoch (the worker holds the write
back), and resuming from it reproduces the epoch bitwise, under DDP (full states) and FSDP2
(shards through dcp.async_save on the saver's own gloo group). A process SIGKILLed during an
asynchronous write leaves the previous checkpoint as the newest loadable one.
"""

import json

import pytest

from conftest import SCRIPTS, anyaccel, clean_env, launch_checks


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_async_save_takes_the_state_of_its_step_and_resumes_bitwise(tmp_path, strategy):
    ranks = launch_checks("async_checkpoint_checks.py", tmp_path, env=clean_env(ANYACCEL_STRATEGY=strategy), timeout=400)
    assert all(r["bitwise"] for r in ranks), ranks
    manifest = ranks[0]["manifest"]
    assert (manifest["strategy"], manifest["checkpoint_format"]) == \
        ((strategy, "sharded") if strategy == "fsdp" else (strategy, "full")), manifest


@pytest.mark.slow
def test_sigkill_during_async_write_leaves_previous_checkpoint_newest(tmp_path):
    cmd = ("launch", "--num_processes", 2, "--cpu", SCRIPTS / "async_checkpoint_checks.py", tmp_path, "--kill_during_write")
    killed = anyaccel(*cmd, timeout=300)
    assert killed.returncode != 0
    root = tmp_path / "project" / "checkpoints"
    assert (root / ".checkpoint_1.anyaccel-tmp").is_dir() and not (root / "checkpoint_1").exists()
    again = anyaccel(*cmd, timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    for r in range(2):
        result = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert result["resumed_from"] == str(root / "checkpoint_0") and result["resumed_step"] == 2, result
