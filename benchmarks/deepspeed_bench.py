"""DeepSpeed benchmarks (the ``deepspeed`` strategy), as result rows.

* step time, 2 processes: anyaccel's ``deepspeed`` strategy (ZeRO-2 and ZeRO-3) vs the same
  DeepSpeed engine driven by hand (``deepspeed.initialize`` with the config anyaccel built,
  ``engine(x)`` / ``engine.backward`` / ``engine.step``), target <= 1.02. Accelerate cannot run
  DeepSpeed on a CPU (a row says so).
* peak memory per rank, 2 processes: ZeRO-1/2/3 vs DDP through anyaccel, for a model whose
  parameters dominate (16 x Linear(1024), AdamW): RSS high-water above what the process held
  before the model, each strategy in a job of its own; the note gives what stays resident after
  the steps and the bytes each rank holds. The model is built whole in each process (as a script
  without ``zero3_init_flag`` does), so the peak includes ``deepspeed.initialize``'s copies.

    python benchmarks/deepspeed_bench.py [--quick]

(Not ``benchmarks/deepspeed.py``: a file of that name would shadow the deepspeed package for the
scripts that run from this folder.)
"""

from __future__ import annotations

import os
import sys
from typing import Dict, List

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_worker.py")
# a fixed mmap threshold: every large tensor its own mapping, returned when freed (see sharding.py)
_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072"}
_ACCELERATE = ("Accelerate turns DeepSpeed off on a CPU (its DeepSpeed path needs a GPU-like device): it cannot run "
               "this")


def run(quick: bool = False) -> List[dict]:
    if not common.have("deepspeed"):
        return [common.skip_row("deepspeed", "DeepSpeed step", "anyaccel deepspeed",
                                "deepspeed is not installed (pip install anyaccel[deepspeed])")]
    rows: List[dict] = []
    for stage in (2, 3):
        name = f"2-proc ZeRO-{stage} step, 16 x Linear(1024) + AdamW"
        try:
            res = common.run_torchrun_json(WORKER, ["--task", "step", "--stage", str(stage)]
                                           + (["--quick"] if quick else []), timeout=1800)
        except RuntimeError as exc:
            rows.append(common.skip_row("deepspeed", name, "anyaccel deepspeed", f"failed: {exc}"[:300],
                                        target="<= 1.02"))
            continue
        config = res.pop("_config")
        if quick:
            name = f"2-proc ZeRO-{stage} step, {config['blocks']} x Linear(1024) + AdamW"
        for contender, r in res.items():
            base = contender.startswith("deepspeed.initialize")
            note = f"{r['steps']} engine steps counted while timed"
            if not base:
                note = f"{common.ci_text(r['ci'])}; {note}"
            rows.append(common.row("deepspeed", name, contender, r["median"] * 1e3, "ms/step",
                                   ratio=None if base else r["ratio"],
                                   baseline=None if base else "deepspeed.initialize by hand",
                                   target=None if base else "<= 1.02", note=note))
        rows.append(common.skip_row("deepspeed", name, "accelerate", _ACCELERATE))

    name = "peak memory per rank, 2 procs, 16 x Linear(1024) + AdamW"
    peaks: Dict[str, dict] = {}
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        try:
            peaks[strategy] = common.run_torchrun_json(WORKER, ["--task", "memory", "--strategy", strategy]
                                                       + (["--quick"] if quick else []), timeout=900, env=_MALLOC)
        except RuntimeError as exc:
            rows.append(common.skip_row("deepspeed", name, f"anyaccel {strategy}", f"failed: {exc}"[:300]))
    if "ddp" in peaks:
        ddp_peak = max(p["peak"] for p in peaks["ddp"]["per_rank"])
        for strategy, res in peaks.items():
            peak = max(p["peak"] for p in res["per_rank"])
            held = res["per_rank"][0]
            steady = max(p["steady"] for p in res["per_rank"])
            note = (f"resident after the steps {steady / 2**20:.1f} MiB; held by rank 0: params "
                    f"{held['params'] / 2**20:.1f} MiB, optimizer state {held['optimizer'] / 2**20:.1f} MiB "
                    f"(model {res['model_bytes'] / 2**20:.1f} MiB fp32, built whole in each process)")
            rows.append(common.row("deepspeed", name, f"anyaccel {strategy}", peak / 2**20, "MiB (RSS high-water)",
                                   ratio=None if strategy == "ddp" else peak / ddp_peak,
                                   baseline=None if strategy == "ddp" else "anyaccel ddp", note=note))
    rows.append(common.skip_row("deepspeed", name, "accelerate", _ACCELERATE))
    return rows


if __name__ == "__main__":
    common.print_table(run("--quick" in sys.argv))
