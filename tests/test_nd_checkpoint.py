"""Checkpoints across N-D layouts (issue 22, item 4): ``save_state``/``load_state`` move a
TP2 x DP2 checkpoint into FSDP2 over 4 processes, into one process and back into TP2 x DP2 (and
into DDP over 4); ``save_model`` of a TP x FSDP model writes one safetensors file that a plain
module loads.

The slow test chains the moves in two launches of 4 real CPU processes on gloo (several
Accelerators one after the other in the same processes) and one plain single process, through
tests/scripts/nd_ckpt_checks.py. Each hop saves what it loaded before training, so:

* model parameters, optimizer state (AdamW moments and step counts), scheduler and loader
  positions and RNG states must come back **bitwise** after TP2xDP2 -> FSDP4 -> 1 -> TP2xDP2;
* back in TP2 x DP2, training (dropout on) must continue **bitwise** like the run that never
  stopped: same layout, same numbers, same random draws — a TP peer restoring another RNG state
  than its partner's draws another dropout mask and the losses differ at 1e-1;
* in the other layouts training continues (dropout off) like the uninterrupted TP2 x DP2 run to
  rel 1e-5 in losses and 1e-5 in weights: the same fp32 numbers summed in another order
  (matmuls cut along TP, gradients averaged over 2 or 4 data-parallel ranks) differ by rounding;
  observed after 3 AdamW steps: 1e-7 relative in losses, 3e-8 in weights. A wrong shard, a lost
  optimizer moment or a shuffled epoch replayed in another order changes them at 1e-2 or more.
"""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from conftest import SCRIPTS, anyaccel, clean_env

from anyaccel import Accelerator
from anyaccel.checkpoint.rng import rng_source_rank

PHASES = {"fsdp4": 4, "one": 1, "back": 4, "ddp4": 4}  # the jobs that loaded a moved checkpoint: processes


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
    """A shuffled epoch interrupted mid-way, loaded and saved again before the loop runs (a save
    at start-up, a preemption right after resuming): the second checkpoint continues the same
    epoch in the same order (before the fix it lost the epoch's order and drew a new one)."""
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
    accelerator.load_state(tmp_path / "a")
    accelerator.save_state(tmp_path / "b")  # before iterating
    accelerator.end_training()
    torch.manual_seed(1)  # a fresh process: other global RNG state
    accelerator, loader = job()
    accelerator.load_state(tmp_path / "b")
    assert [b[0].tolist() for b in loader] == rest
    assert len(seen) + len(rest) == 8
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


@pytest.mark.slow
def test_a_tp2dp2_checkpoint_moves_to_fsdp4_one_process_and_back(tmp_path):
    def launch(stage):
        proc = anyaccel("launch", "--num_processes", 4, "--cpu", SCRIPTS / "nd_ckpt_checks.py", tmp_path, stage,
                        timeout=500)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    launch("first")  # TP2xDP2 trains, saves A (and the references); FSDP over 4 loads A, saves B
    proc = subprocess.run([sys.executable, SCRIPTS / "nd_ckpt_checks.py", tmp_path, "one"], capture_output=True,
                          text=True, timeout=300, env=clean_env())  # one plain process loads B, saves C
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    launch("back")  # TP2xDP2 loads C, continues, save_model; DDP over 4 loads A

    def ranks(phase, n):
        return [json.loads((tmp_path / f"{phase}_rank{r}.json").read_text()) for r in range(n)]

    def state(phase):
        return torch.load(tmp_path / f"{phase}.pt", weights_only=True)

    saved = ranks("save", 4)
    assert len({r["rng"] for r in saved}) == 1  # the premise: TP2xDP2's processes all drew alike
    at_save = state("save")
    assert at_save["optimizer"]["state"]  # AdamW moments and steps exist, so they are compared
    for phase, n in PHASES.items():  # what each layout holds right after loading: bitwise the saved state
        assert _same(at_save, state(phase), phase) == []
        for r in ranks(phase, n):
            assert (r["rng"], r["scheduler"], r["lr"], r["loader"]) == (
                saved[0]["rng"], saved[0]["scheduler"], saved[0]["lr"], saved[0]["loader"]), phase
        # get_state_dict: gathered to rank 0 from sharded layouts; every rank's own copy under DDP
        others = len(at_save["model"]) if phase == "ddp4" else 0
        assert [r["state_keys"] for r in ranks(phase, n)] == [len(at_save["model"])] + [others] * (n - 1)

    # back in TP2xDP2 after three moves: training continues exactly like the run that never stopped
    assert ranks("back_after", 4)[0]["losses"] == ranks("reference_train", 4)[0]["losses"]
    assert _same(state("reference_train"), state("back_after")) == []
    # other layouts: the same training to rounding (see the module docstring)
    reference = ranks("reference_eval", 4)[0]["losses"]
    expected = state("reference_eval")["model"]
    for phase in ("fsdp4", "one", "ddp4"):
        assert ranks(phase + "_after", PHASES[phase])[0]["losses"] == pytest.approx(reference, rel=1e-5), phase
        weights = state(phase + "_after")["model"]
        assert max(float((weights[k] - expected[k]).abs().max()) for k in expected) < 1e-5, phase

    # save_model of the TP x FSDP model: one full safetensors file, loadable by a never-wrapped module
    from safetensors.torch import load_file

    assert sorted(p.name for p in (tmp_path / "exported").iterdir()) == ["model.safetensors"]
    plain = _script_module().Net()
    plain.load_state_dict(load_file(tmp_path / "exported" / "model.safetensors"), strict=True)
    assert _same(state("back_after")["model"], plain.state_dict()) == []
    assert json.loads((tmp_path / "unwrap.json").read_text()) == {"is_net": True, "same_object": True,
                                                                  "dtensors": len(expected)}
