"""Checkpoints across N-D layouts in one process: which saved RNG state each rank restores when
the layout changes, and a checkpoint saved right after loading. The 4-process moves
(TP2 x DP2 -> FSDP4 -> 1 -> TP2 x DP2, and DDP4) are in tests/checkpoint/test_nd_checkpoint_multiprocess.py."""

import importlib.util

import torch

from conftest import SCRIPTS

from anyaccel import Accelerator
from anyaccel.checkpoint.rng import rng_source_rank


def test_rng_states_follow_the_data_parallel_rank_when_the_layout_changes():
    # same layout: each process its own file (bitwise resume)
    assert [rng_source_rank(r, 4, (r // 2, 2), 4, 2) for r in range(4)] == [0, 1, 2, 3]
    # TP2xDP2 saved (dp ranks 0,0,1,1); FSDP over 4 loads: dp rank d takes saved dp rank d mod 2's leader
    assert [rng_source_rank(r, 4, (r, 4), 4, 2) for r in range(4)] == [0, 2, 0, 2]
    # one process saved; TP2xDP2 loads: both processes of each TP pair restore the same state
    assert [rng_source_rank(r, 4, (r // 2, 2), 1, 1) for r in range(4)] == [0, 0, 0, 0]
    # FSDP over 4 saved; TP2xDP2 loads: TP peers (0,1) and (2,3) each restore one state
    assert [rng_source_rank(r, 4, (r // 2, 2), 4, 4) for r in range(4)] == [0, 0, 1, 1]


def test_a_checkpoint_saved_right_after_loading_replays_the_same_epoch(tmp_path):
    """A shuffled epoch interrupted mid-way, resumed and saved again before the loop runs (a save
    at start-up, a preemption right after resuming): the second checkpoint continues the same
    epoch in the same order (before the fix it lost the epoch's order and drew a new one).
    ``resume()`` restores the loader's position; ``load_state`` restores the epoch and its order
    only (Accelerate's rule), so after it the same epoch runs whole."""
    data = torch.utils.data.TensorDataset(torch.arange(32.0))

    def job():
        accelerator = Accelerator(cpu=True)
        loader = accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
        return accelerator, loader

    torch.manual_seed(0)
    accelerator, loader = job()
    batches = iter(loader)
    seen = [next(batches)[0].tolist() for _ in range(3)]
    accelerator.save_state(tmp_path / "a")
    rest = [b[0].tolist() for b in batches]
    accelerator.end_training()
    accelerator, loader = job()
    accelerator.resume(tmp_path / "a")
    accelerator.save_state(tmp_path / "b")  # before iterating
    accelerator.end_training()
    torch.manual_seed(1)  # a fresh process: other global RNG state
    accelerator, loader = job()
    assert accelerator.resume(tmp_path / "b").step == 3
    assert [b[0].tolist() for b in loader] == rest
    assert len(seen) + len(rest) == 8
    accelerator.end_training()
    torch.manual_seed(2)
    accelerator, loader = job()
    accelerator.load_state(tmp_path / "b")  # the epoch and its order, from its first batch
    assert [b[0].tolist() for b in loader] == seen + rest
    accelerator.end_training()


def _script_module():
    spec = importlib.util.spec_from_file_location("nd_ckpt_checks", SCRIPTS / "nd_ckpt_checks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _same(a, b, where=""):
    """Paths where two nested states differ (tensors compared bitwise, dtype and shape included)."""
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(set(a) ^ set(b), key=str)[:4]}"]
        return [d for k in a for d in _same(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor):
        ok = type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if ok else [f"{where}: differs"]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]
