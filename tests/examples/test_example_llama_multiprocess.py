"""examples/llama_tp_fsdp.py runs end to end with 4 real CPU processes (TP 2 x FSDP 2 on gloo),
started as a user starts it (``anyaccel launch --num_processes 4 --cpu``), at tiny sizes.

What a user relies on and reads in the output: the mesh is (dp_shard=2, tp=2); a q projection is
a 2-D DTensor (sharded over both dimensions); each rank holds exactly its share of the parameters
(a quarter of every weight in the TP plan, half of every other one) and twice that in AdamW state;
the loss goes down (the counting task needs attention across heads held by different TP ranks).
"""

import re

import pytest

from conftest import anyaccel, clean_env
from project.test_example_llama import EXAMPLE, example_module as _example

SIZES = {"width": 32, "heads": 4, "layers": 1}


@pytest.mark.slow
def test_llama_trains_with_tp2_fsdp2_on_four_processes(tmp_path):
    example = _example()
    args = [f"--{k}={v}" for k, v in SIZES.items()] + ["--steps=20", "--batch_size=8", "--lr=1e-2"]
    proc = anyaccel("launch", "--num_processes", 4, "--cpu", EXAMPLE, *args, timeout=500,
                    env=clean_env(ANYACCEL_HOME=str(tmp_path)))
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-5000:]
    assert "mesh DeviceMesh((dp_shard=2, tp=2)" in out, out
    # q_proj (32, 32): cut in 2 by TP (colwise, dim 0), then in 2 by FSDP on the same dim -> (8, 32);
    # the data-parallel placement is torch's _StridedShard (FSDP's shard of a TP shard)
    placed = r"q_proj.weight: \(32, 32\) as \(\w*Shard\(dim=0[^)]*\), Shard\(dim=0\)\), local shard \(8, 32\)"
    assert re.search(placed, out), out

    model = example.TinyLlama(width=32, n_heads=4, hidden=64, layers=1)
    suffixes = tuple(pattern.split("*.")[1] for pattern in example.PLAN)
    planned = {name + ".weight" for name, _ in model.named_modules() if name.endswith(suffixes)}
    full = sum(p.numel() * 4 for p in model.parameters())
    expected = sum(p.numel() * 4 // (4 if n in planned else 2) for n, p in model.named_parameters())
    held = re.findall(r"rank (\d) \(dp_shard (\d), tp (\d)\): holds parameters ([\d,]+) B and optimizer state "
                      r"([\d,]+) B of the model's ([\d,]+) B", out)
    assert [(r, d, t) for r, d, t, *_ in held] == [("0", "0", "0"), ("1", "0", "1"), ("2", "1", "0"), ("3", "1", "1")]
    for *_, params, optimizer, whole in held:
        params, optimizer, whole = (int(x.replace(",", "")) for x in (params, optimizer, whole))
        assert (params, optimizer, whole) == (expected, 2 * expected, full)

    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) in 20 steps", out).groups())
    assert last < 0.7 * first, out
