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
