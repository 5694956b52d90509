"""The single-process tests; the multi-process ones (real launches, marked slow) are in tests/multiprocess/test_async_checkpoint.py.

Asynchronous checkpoints (save_state(async_save=True), anyaccel/checkpoint/async_save.py).

The multi-process checks run through `anyaccel launch` (tests/scripts/async_checkpoint_checks.py):
the files of a save taken at step 3 are written only after the epoch (the worker holds the write
back), and resuming from it reproduces the epoch bitwise, under DDP (full states) and FSDP2
(shards through dcp.async_save on the saver's own gloo group). A process SIGKILLed during an
asynchronous write leaves the previous checkpoint as the newest loadable one.
"""

from pathlib import Path

import torch



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
