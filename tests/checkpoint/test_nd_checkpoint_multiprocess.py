"""Checkpoints across N-D layouts (issue 22, item 4): ``save_state``/``load_state`` move a
TP2 x DP2 checkpoint into FSDP2 over 4 processes, into one process and back into TP2 x DP2 (and
into DDP over 4); ``save_model`` of a TP x FSDP model writes one safetensors file that a plain
module loads.

The slow test chains the moves in two launches of 4 real CPU processes on gloo (several
Accelerators one after the other in the same processes) and one plain single process, through
tests/checkpoint/nd_ckpt_checks.py. Each hop saves what it loaded before training, so:

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

import json
import subprocess
import sys

import pytest
import torch

from conftest import SCRIPTS, clean_env, warm_launch
import rank_results  # tests/scripts
from test_nd_checkpoint import _same, _script_module  # helpers shared with the unit tests


PHASES = {"fsdp4": 4, "one": 1, "back": 4, "ddp4": 4}  # the jobs that loaded a moved checkpoint: processes


@pytest.mark.slow
def test_a_tp2dp2_checkpoint_moves_to_fsdp4_one_process_and_back(tmp_path):
    def launch(stage):
        proc = warm_launch(4, SCRIPTS / "nd_ckpt_checks.py", tmp_path, stage, timeout=500)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    launch("first")  # TP2xDP2 trains, saves A (and the references); FSDP over 4 loads A, saves B
    proc = subprocess.run([sys.executable, SCRIPTS / "nd_ckpt_checks.py", tmp_path, "one"], capture_output=True,
                          text=True, timeout=300, env=clean_env())  # one plain process loads B, saves C
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    launch("back")  # TP2xDP2 loads C, continues, save_model; DDP over 4 loads A

    def ranks(phase, n):
        return rank_results.read(tmp_path, phase, n)

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
