"""Asynchronous checkpoints (save_state(async_save=True), anyaccel/checkpoint/async_save.py).

The multi-process checks run through `anyaccel launch` (tests/scripts/async_checkpoint_checks.py):
the files of a save taken at step 3 are written only after the epoch (the worker holds the write
back), and resuming from it reproduces the epoch bitwise, under DDP (full states) and FSDP2
(shards through dcp.async_save on the saver's own gloo group). A process SIGKILLed during an
asynchronous write leaves the previous checkpoint as the newest loadable one.
"""

import json
from pathlib import Path

import pytest
import torch

from conftest import SCRIPTS, anyaccel, launch_checks


def test_single_process_async_save_is_complete_after_wait_and_loads(tmp_path):
    from anyaccel import Accelerator, ProjectConfiguration

    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path),
                                                                    automatic_checkpoint_naming=True, async_save=True))
    model = acc.prepare(torch.nn.Linear(4, 2))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    first = acc.save_state()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training goes on while the write happens
    second = acc.save_state()  # waits for the first one
    assert Path(first).name == "checkpoint_0" and Path(second).name == "checkpoint_1"
    assert acc.wait_for_checkpoint() == second
    assert (Path(first) / "anyaccel_checkpoint.json").exists()
    acc.load_state(first)
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    acc.end_training()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_async_save_takes_the_state_of_its_step_and_resumes_bitwise(tmp_path, strategy):
    ranks = launch_checks("async_checkpoint_checks.py", tmp_path, "--strategy", strategy, timeout=400)
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


def test_staging_buffers_are_reused_from_one_save_to_the_next_and_hold_the_values_of_the_save():
    from anyaccel.checkpoint.async_save import StagingBuffers

    stage = StagingBuffers()
    a, b, c = torch.randn(3, 4), torch.randn(3, 4), torch.randn(5)
    stage.begin()
    first = [stage(t) for t in (a, b, c)]
    stage.end()
    assert [f.data_ptr() for f in first] != [t.data_ptr() for t in (a, b, c)]  # copies, not the tensors
    a.add_(1.0)
    assert not torch.equal(first[0], a)  # training changing a tensor leaves the staged copy alone
    stage.begin()
    second = [stage(t) for t in (a, b, c)]
    stage.end()
    assert [s.data_ptr() for s in second] == [f.data_ptr() for f in first]  # no new allocation
    assert all(torch.equal(s, t) for s, t in zip(second, (a, b, c)))
    assert stage.nbytes == 4 * (12 + 12 + 5)
    stage.begin()(a)  # the state shrank: what this save did not use is freed
    stage.end()
    assert stage.nbytes == 4 * 12
    stage.release()
    assert stage.nbytes == 0
