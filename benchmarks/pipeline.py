"""Pipeline-parallelism benchmark (``pipeline``), as result rows: anyaccel's ``pipeline_step``
against the same pipeline written by hand, the bubble of each schedule against theory, and the
bytes each rank holds against DDP.

* step: 2 CPU processes on gloo, ``ParallelismConfig(pp_size=2, pp_microbatches=4)`` (1F1B) vs
  torchtitan's recipe by hand (this rank's children, ``PipelineStage``, ``Schedule1F1B``, the loss
  divided by the micro-batch count), same model (an ``nn.Sequential`` of an embedding, residual MLP
  blocks and a head), same AdamW, same batches, rounds alternating in one job; target <= 1.02.
  Each contender is 3 copies, the median of a round's copies its value (one copy runs a few per
  cent faster or slower than another for a whole run); one hand-written copy against another
  gives the noise floor. anyaccel's step also sends the loss to every rank (one scalar
  broadcast), which the hand-written loop does not.
* bubble: for GPipe, 1F1B, Interleaved1F1B and ZBVZeroBubble through anyaccel, the part of a step
  each rank does not compute, ``1 - B / T`` (``B``: time inside its stages' forward and backward
  chunks, ``T``: time inside the schedule, both per rank), against ``(P - 1) / (v * m + P - 1)`` (``v`` stages
  per rank; about 0 for zero-bubble schedules).
* memory: parameter + AdamW bytes per rank over DDP of the same model in the same job.
* The notes carry the proof: the stages each rank holds, schedule steps counted by anyaccel, the
  first loss of both contenders (same weights, same batch: equal to rounding).

    python -m benchmarks --only pipeline [--quick]
    python benchmarks/pipeline.py [--quick]
"""

from __future__ import annotations

import os
import sys
from typing import List

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pipeline_worker.py")
BASE = "hand-written pipeline"


def run(quick: bool = False) -> List[dict]:
    try:
        res = common.run_torchrun_json(WORKER, ["--quick"] if quick else [], timeout=1800, nproc=2)
    except RuntimeError as exc:
        return [common.skip_row("pipeline", "pp2 step, 2 CPU procs", "anyaccel pp", f"failed: {exc}"[:300],
                                target="<= 1.02")]
    s, ranks = res["sizes"], res["per_rank"]
    model = (f"Sequential: embedding, {s['blocks']} MLP blocks {s['width']}->{s['hidden']}, head {s['vocab']}; "
             f"batch {s['batch']} x seq {s['seq']}, {s['microbatches']} micro-batches, "
             f"{res['model_bytes'] / 2**20:.1f} MiB fp32")
    stages = "; ".join(f"rank {r}: stage {p['stages']} = children {','.join(p['anyaccel names'])} "
                       f"(hand-written: {','.join(p['units'])})" for r, p in enumerate(ranks))
    losses = res["first_loss"]
    same = abs(losses[BASE] - losses["anyaccel pp"]) <= 1e-5 * abs(losses[BASE])
    print(f"pipeline: {stages}; {res['anyaccel_steps']} anyaccel schedule steps")
    rows = []
    name = f"pp2 1F1B step + AdamW, 2 CPU procs, {model}"
    order = [BASE, BASE + "'", "anyaccel pp"]
    copies = res.get("copies", 1)

    def each(clock: dict, scale: float = 1e3) -> str:
        found = clock.get("copies") or []
        return f"median of {len(found)} copies per round ({', '.join(f'{x * scale:.0f}' for x in found)})" \
            if len(found) > 1 else ""

    for contender in order:
        wall = res["step"][contender]["wall"]
        base = contender == BASE
        if base:
            note = f"{each(wall)}; {stages}; first loss {losses[BASE]:.6f}"
        elif contender == "anyaccel pp":
            note = (f"{each(wall)}; {common.ci_text(wall['ci'])}; {res['anyaccel_steps']} schedule steps counted; "
                    f"first loss {losses[contender]:.6f} ({'equal to' if same else 'DIFFERENT FROM'} the "
                    "hand-written loop's)")
        else:
            note = (f"noise floor: one hand-written copy against another{' (why each contender is ' + str(copies) + ' copies)' if copies > 1 else ''}; "
                    f"{common.ci_text(wall['ci'])}")
        note = "; ".join(part for part in note.split("; ") if part)
        rows.append(common.row("pipeline", name, contender, wall["median"] * 1e3, "ms/step",
                               ratio=None if base else wall["ratio"], baseline=None if base else BASE,
                               target="<= 1.02" if contender == "anyaccel pp" else None, note=note))
    rows += common.cpu_rows("pipeline", "same step, CPU time of both ranks and Python calls (rank 0)",
                            {who: res["step"][who] for who in order}, res["calls"], BASE)
    for schedule, b in res["bubbles"].items():
        measured = sum(b["bubble"]) / len(b["bubble"])
        rows.append(common.row(
            "pipeline", f"bubble (idle part of a step), pp2, m={s['microbatches']}", f"anyaccel {schedule}", measured,
            "fraction", note=(f"theory {b['theory']:.3f} ({b['stages_per_rank']} stage(s) per rank); per rank "
                              f"{', '.join(f'{x:.3f}' for x in b['bubble'])}; rank 0: schedule {b['schedule_s'] * 1e3:.0f} ms, "
                              f"computing {b['compute_s'] * 1e3:.0f} ms (step with AdamW {b['step_s'] * 1e3:.0f} ms); "
                              f"{b['steps']} schedule steps")))
    ddp = max(p["held"]["DDP"] for p in ranks)
    for contender in ("DDP", BASE, "anyaccel pp"):
        per_rank = [p["held"][contender] for p in ranks]
        rows.append(common.row("pipeline", "bytes held per rank (params + AdamW state), pp2", contender,
                               max(per_rank) / 2**20, "MiB (largest rank)",
                               ratio=None if contender == "DDP" else max(per_rank) / ddp,
                               baseline=None if contender == "DDP" else "DDP",
                               note=f"per rank {', '.join(f'{b / 2**20:.3f}' for b in per_rank)} MiB"))
    return rows


if __name__ == "__main__":
    common.print_table(run("--quick" in sys.argv))
