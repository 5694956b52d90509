"""The 2-process benchmarks, as result rows: each starts one torchrun job of
:mod:`benchmarks.dist_worker` (which does the measuring inside the workers) and turns its JSON
into rows.

* ``ddp``     training throughput, anyaccel / raw DDP + DistributedSampler (target >= 0.99)
* ``gather``  cost of the shape-check header of ``anyaccel.ops.gather``
* ``gfm``     ``gather_for_metrics`` over an evaluation epoch vs a raw all_gather loop
"""

from __future__ import annotations

import os
import sys
from typing import List

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_worker.py")


def _job(task: str, quick: bool):
    return common.run_torchrun_json(WORKER, ["--task", task] + (["--quick"] if quick else []), timeout=1800)


def _ddp_note(contender: str, r: dict) -> str:
    parts = ["noise floor (raw vs raw)"] if contender == "raw'" else []
    if contender != "raw":
        parts.append(common.ci_text(r["ci"]))
        ci = common.ci_text(r["cpu_ci"])
        parts.append(f"per CPU-second: ratio {r['cpu_ratio']:.3f}" + (f" ({ci})" if ci else ""))
    else:
        parts.append(f"{r['cpu_median']:,.0f} samples per CPU-second")
    return "; ".join(p for p in parts if p)


def run_ddp(quick: bool = False) -> List[dict]:
    """2-process CPU DDP training throughput (samples/s of the job), tiny and medium MLP."""
    rows: List[dict] = []
    results = _job("ddp", quick)
    for size in sorted(results, key=lambda k: (k.split()[0] != "tiny", k.endswith(" calls"))):
        res = results[size]
        if size.endswith(" calls"):
            name = f"2-proc DDP train, {size[:-6]} MLP: Python calls on rank 0"
            for contender, c in res.items():
                is_base = contender == "raw"
                rows.append(common.row("ddp", name, contender, c, "calls/step",
                                       ratio=None if is_base else c / res["raw"], baseline=None if is_base else "raw",
                                       note="" if is_base else f"{c - res['raw']:+.1f} calls/step (cProfile, deterministic)"))
            continue
        name = f"2-proc DDP train, {size} MLP"
        for contender, r in res["results"].items():
            is_base = contender == "raw"
            rows.append(common.row("ddp", name, contender, r["median"], "samples/s",
                                   ratio=None if is_base else r["ratio"], baseline=None if is_base else "raw",
                                   target=">= 0.99" if contender == "anyaccel" else None,
                                   note=_ddp_note(contender, r)))
        for contender, why in res["errors"].items():
            rows.append(common.skip_row("ddp", name, contender, why))
    return rows


def run_gather(quick: bool = False) -> List[dict]:
    """Per-call cost of ops.gather with and without the shape-check header, vs raw all_gather."""
    rows: List[dict] = []
    for label, res in _job("gather", quick).items():
        name = f"gather {label}, 2 procs" if "local" not in label else f"gather {label} (collectives stubbed)"
        unchecked = res["gather(check=False)"]["median"]
        for contender, r in res.items():
            is_base = contender == "raw all_gather"
            note = ""
            if "check=True" in contender:
                note = f"header costs {(r['median'] - unchecked) * 1e6:.0f} us/call over check=False"
                if "local" in label:
                    note += " (CPU work, no round trip)"
            rows.append(common.row("gather", name, contender, r["median"] * 1e6, "us/call",
                                   ratio=None if is_base else r["ratio"],
                                   baseline=None if is_base else "raw all_gather", note=note))
    return rows


def run_gfm(quick: bool = False) -> List[dict]:
    """gather_for_metrics over one evaluation epoch (uneven dataset) vs a raw all_gather loop."""
    res = _job("gfm", quick)
    rows: List[dict] = []
    name = f"eval epoch + per-batch gather, n={res['n']}, batch {res['batch']}, 2 procs"
    for contender, r in res["results"].items():
        is_base = contender == "raw all_gather loop"
        count = res["counts"].get(contender)
        note = f"samples counted: {count}" if isinstance(count, int) and count >= 0 else f"WRONG COUNT {count}"
        if count == res["n"]:
            note += " (each once)" if contender != "raw all_gather loop" else " (after cutting the padding)"
        rows.append(common.row("gfm", name, contender, r["median"] * 1e3, "ms/epoch",
                               ratio=None if is_base else r["ratio"],
                               baseline=None if is_base else "raw all_gather loop",
                               target="<= 1.05" if contender == "anyaccel" else None, note=note))
    for contender, why in res["counts"].items():
        if isinstance(why, str):
            rows.append(common.skip_row("gfm", name, contender, why))
    return rows


if __name__ == "__main__":
    q = "--quick" in sys.argv
    common.print_table(run_ddp(q) + run_gather(q) + run_gfm(q))
