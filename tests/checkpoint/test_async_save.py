"""The single-process tests; the multi-process ones (real launches, marked slow) are in tests/checkpoint/test_async_checkpoint_multiprocess.py.

Asynchronous checkpoints (save_state(async_save=True), anyaccel/checkpoint/async_save.py).

The multi-process checks run through `anyaccel launch` (tests/checkpoint/async_checkpoint_checks.py):
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


def test_sharded_staging_copies_shards_into_reused_buffers_and_dcp_writes_them(tmp_path):
    """FSDP2's asynchronous save stages its DTensor shards through dcp.async_stager into the saver's
    StagingBuffers: the staged state is a copy (training may change the live one), DTensors keep their
    layout, the next save reuses the same buffers, and DCP writes what was staged."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from anyaccel.checkpoint.async_save import StagingBuffers
    from anyaccel.strategies.dcp import async_stager

    def buffer_addresses():
        return sorted(t.data_ptr() for kept in buffers._buffers.values() for t in kept)

    if dist.is_initialized():  # a one-process group an earlier test file of this pytest worker left
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
        exp_avg = torch.randn(8, 4)
        state = {"model_0": {"w": w, "b": torch.randn(4)},
                 "optimizer_0": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": exp_avg}},
                                 "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}]}}
        buffers = StagingBuffers()
        stager = async_stager(buffers)
        assert stager.should_synchronize_after_execute is False

        buffers.begin()
        staged = stager.stage(state)
        buffers.end()
        staged_w = staged["model_0"]["w"]
        assert isinstance(staged_w, DTensor) and staged_w.placements == w.placements and staged_w.shape == w.shape
        assert torch.equal(staged_w.to_local(), w.to_local())
        assert staged_w.to_local().data_ptr() != w.to_local().data_ptr()
        assert staged["optimizer_0"]["param_groups"] == state["optimizer_0"]["param_groups"]
        assert buffers.nbytes == (8 * 4 + 4 + 1 + 8 * 4) * 4
        first = buffer_addresses()

        expected = {"w": w.to_local().clone(), "exp_avg": exp_avg.clone()}
        buffers.begin()
        future = dcp.async_save(state, checkpoint_id=str(tmp_path / "ck"), async_stager=stager)
        buffers.end()
        assert buffer_addresses() == first  # the second save copied into the first one's buffers
        with torch.no_grad():  # training goes on while DCP writes
            w.to_local().add_(1.0)
            exp_avg.add_(1.0)
        future.result()

        target = {"model_0": {"w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]), "b": torch.zeros(4)},
                  "optimizer_0": {"state": {"w": {"step": torch.tensor(0.0), "exp_avg": torch.zeros(8, 4)}}}}
        dcp.load(target, checkpoint_id=str(tmp_path / "ck"))
        assert torch.equal(target["model_0"]["w"].to_local(), expected["w"])
        assert torch.equal(target["optimizer_0"]["state"]["w"]["exp_avg"], expected["exp_avg"])
        assert float(target["optimizer_0"]["state"]["w"]["step"]) == 3.0
    finally:
        dist.destroy_process_group()
