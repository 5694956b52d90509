"""N-D parallelism benchmark (``nd``), as result rows: tensor parallel x FSDP2 through anyaccel
against the same thing written by hand, and the bytes each rank holds against DDP.

* step: 4 CPU processes on gloo, ``ParallelismConfig(dp_shard_size=2, tp_size=2)`` vs a
  hand-written ``parallelize_module`` + ``fully_shard`` loop (same model — examples/llama_tp_fsdp.py's
  ``TinyLlama`` —, same plan, same AdamW, same batches), rounds alternating in one job; target
  <= 1.02. A second hand-written loop gives the noise floor.
* memory: parameter + optimizer-state bytes each rank holds (sum of its local shards) for both,
  over ``DistributedDataParallel`` of the same model in the same job.
* The rows' notes carry the proof that what was timed happened: the mesh, the q projection's
  placements and local shape for each contender, and their first losses (same weights, same
  batch: equal to rounding).

With 4 GPUs the same job runs on them (NCCL); with 1 to 3, as 1 process on one GPU. Every size
is then 1: anyaccel's ``nd`` keeps the plain module (no DTensors, no TP code path), while the
hand-written loop still runs ``parallelize_module`` + ``fully_shard`` over a mesh of one (in one
process) — the row says so and carries no target::

    python -m benchmarks --only nd [--quick]
    python benchmarks/nd.py [--quick]
"""

from __future__ import annotations

import os
import sys
from typing import List

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nd_worker.py")
BASE = "hand-written TP x FSDP"
# What one process measures (a GPU lent for the benchmark): every size is 1, so anyaccel's nd keeps
# the plain module (no DTensors), while the hand-written loop runs TP and FSDP over a mesh of one.
ONE = ("one process: anyaccel keeps the plain module (all sizes 1), the hand-written loop pays for DTensors over "
       "a mesh of one; no target")


def _processes() -> int:
    import torch

    if torch.cuda.is_available():
        return 4 if torch.cuda.device_count() >= 4 else 1  # one GPU: a mesh of one (see ONE)
    return 4


def run(quick: bool = False) -> List[dict]:
    nproc = _processes()
    try:
        res = common.run_torchrun_json(WORKER, ["--quick"] if quick else [], timeout=1500, nproc=nproc)
    except RuntimeError as exc:
        return [common.skip_row("nd", f"TP x FSDP step, {nproc} proc(s)", "anyaccel nd", f"failed: {exc}"[:300],
                                target="<= 1.02")]
    s, proof = res["sizes"], res["proof"]
    model = (f"Llama-style {s['layers']} x {s['width']} ({s['n_heads']} heads), seq {s['length']}, "
             f"{res['model_bytes'] / 2**20:.1f} MiB fp32")
    layout = f"dp_shard {res['dp_shard']} x tp {res['tp']}, {res['world']} {res['device']} proc(s)"
    print(f"mesh (anyaccel): {proof['anyaccel mesh']}, strategy {proof['strategy']}")
    for who in (BASE, "anyaccel nd"):
        print(f"{who}: {proof[who]}; first loss {proof['first loss'][who]!r}")
    rows = []
    name = f"TP x FSDP step + AdamW, {layout}, {model}"
    losses = proof["first loss"]
    same = abs(losses[BASE] - losses["anyaccel nd"]) <= 1e-5 * abs(losses[BASE])
    calls = res["calls"]
    for contender, clocks in res["step"].items():
        base = contender == BASE
        wall = clocks["wall"]
        if base:
            note = f"{proof[BASE]}; first loss {losses[BASE]:.6f}"
        elif contender == "anyaccel nd":
            note = (f"{common.ci_text(wall['ci'])}; {proof['anyaccel nd']}; first loss {losses[contender]:.6f} "
                    f"({'equal to' if same else 'DIFFERENT FROM'} the hand-written loop's)")
        else:
            note = f"noise floor; {common.ci_text(wall['ci'])}"
        note = "; ".join(part for part in note.split("; ") if part)  # no CI with few rounds
        rows.append(common.row("nd", name, contender, wall["median"] * 1e3, "ms/step",
                               ratio=None if base else wall["ratio"],
                               baseline=None if base else BASE,
                               target="<= 1.02" if contender == "anyaccel nd" and res["world"] > 1 else None,
                               note=note if res["world"] > 1 or contender != "anyaccel nd" else ONE + "; " + note))
    rows += common.cpu_rows("nd", f"same step, CPU time of all ranks and Python calls (rank 0), {layout}",
                            res["step"], calls, BASE)

    name = f"bytes held per rank (params + AdamW state), {layout}"
    held = res["held"]
    ddp = max(h["DDP"]["params"] + h["DDP"]["optimizer"] for h in held)
    for contender in ("DDP", BASE, "anyaccel nd"):
        per_rank = [h[contender]["params"] + h[contender]["optimizer"] for h in held]
        first = held[0][contender]
        note = (f"rank 0: params {first['params'] / 2**20:.3f} MiB, optimizer {first['optimizer'] / 2**20:.3f} MiB; "
                f"per rank {', '.join(f'{b / 2**20:.3f}' for b in per_rank)} MiB")
        rows.append(common.row("nd", name, contender, max(per_rank) / 2**20, "MiB (largest rank)",
                               ratio=None if contender == "DDP" else max(per_rank) / ddp,
                               baseline=None if contender == "DDP" else "DDP", note=note))
    return rows


if __name__ == "__main__":
    common.print_table(run("--quick" in sys.argv))
