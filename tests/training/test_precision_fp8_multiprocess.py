"""fp8 (torchao, emulated on the CPU) in real jobs through ``anyaccel launch`` and
tests/training/fp8_checks.py, two launches in all: 2 processes (DDP, FSDP2 with the fp8 all-gather,
checkpoints) and 4 processes (TP2 x FSDP2). Each run is checked against one process training the
same micro-batches in fp8 (rank 0 runs it; the single-process half is tests/training/test_precision_fp8.py).

What emulation cannot show here: speed, and fp8 matmul kernels (``torch._scaled_mm``), which
``make gpu-check`` runs (tests/gpu/check_fp8.py). Everything else is the GPU path: the same
``Float8Linear`` modules, dynamic scales, the fp8 all-gather's weight type, DTensor sharding.

Tolerances, from what was measured (2 steps of 2 micro-batches, SGD with momentum, gradient norms
clipped at 1.0, a tiny Llama of 13 fp8 linear layers):

* DDP: the reference runs each rank's micro-batches with the same fp8 scales (dynamic scales are
  per micro-batch on both sides), so only fp32 sums are ordered differently; observed 5e-8
  relative in losses, 2e-9 in weights, equal gradient norms. Asserted 1e-4: room for one fp8
  rounding that an fp32 ulp tips the other way, far below a micro-batch left out, a rank fed
  another batch (~5e-3 in that step's loss) or gradients not averaged (the norm doubles).
* FSDP2 and TP2 x FSDP2: FSDP2 also casts the layers kept in high precision, the norms and the
  embedding to bf16 before computing (the reference's autocast leaves the last two in fp32), and
  TP cuts the matmuls; observed 2e-4 / 3e-4 relative in losses, 5e-4 / 8e-4 in weights and
  1e-3 / 2e-3 in gradient norms. Asserted: losses 2e-3, weights 5e-3, norms 1e-2.
"""

import json

import pytest

from conftest import SCRIPTS, warm_launch

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")


def _launch(out, layout, nproc):
    proc = warm_launch(nproc, SCRIPTS / "fp8_checks.py", out, layout, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def _close_to_one_process(result, losses, weights, norms):
    assert result["same_keys"] and result["max_weight_diff"] < weights
    assert result["losses"] == pytest.approx(result["ref_losses"], rel=losses)
    assert result["norms"] == pytest.approx(result["ref_norms"], rel=norms)
    assert result["float8_layers"] == 13  # 15 linear layers, the first and the last kept


def test_ddp_fsdp2_and_checkpoints_on_two_processes(tmp_path):
    ranks = _launch(tmp_path, "two", 2)
    r0 = ranks[0]
    _close_to_one_process(r0["ddp"], losses=1e-4, weights=1e-4, norms=1e-4)
    _close_to_one_process(r0["fsdp"], losses=2e-3, weights=5e-3, norms=1e-2)
    for r in ranks:
        assert r["ddp"]["losses"] == r0["ddp"]["losses"] and r["fsdp"]["losses"] == r0["fsdp"]["losses"]
        assert r["ddp"]["all_gather"] is None and r["fsdp"]["all_gather"] is True  # FSDP2 all-gathers in fp8
        assert "FSDP2 all-gathers their weights in fp8" in r["fsdp"]["report"]
    ck = r0["checkpoints"]
    # save_state -> a new job's resume() continues bitwise (sharded checkpoint, fp8 all-gather weights)
    assert ck["first"] == [0, 0, None] and ck["resumed_from"] == "checkpoint_0" and ck["bitwise"], ck
    assert ck["all_gather"] is True
    # ... and the other way: the bf16 run's checkpoint into an fp8 run (fp8 all-gather on), which trains on
    assert ck["bf16_to_fp8"] is True and ck["bf16_to_fp8_trains"], ck
    assert ck["state_dict_types"] == ["Tensor"], ck["state_dict_types"]  # no torchao subclass reaches a script
    # save_model (gathered) and the fp8 checkpoint loaded by a bf16 run: plain tensors the plain Llama loads
    for name in ("fp8_model", "bf16_model"):
        assert ck[name] == {"missing": [], "unexpected": [], "types": ["Tensor"], "equal": True}, (name, ck[name])


def test_tensor_parallel_times_fsdp2_on_four_processes(tmp_path):
    ranks = _launch(tmp_path, "tp_fsdp", 4)
    _close_to_one_process(ranks[0]["tp_fsdp"], losses=2e-3, weights=5e-3, norms=1e-2)
    for r in ranks:
        assert r["tp_fsdp"]["losses"] == ranks[0]["tp_fsdp"]["losses"] and r["tp_fsdp"]["all_gather"] is True
