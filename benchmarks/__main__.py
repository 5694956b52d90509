"""Run every benchmark, print one table of ratios measured in this run, and publish it.

    python -m benchmarks                    # everything (about 15-25 minutes on a 2-core box)
    python -m benchmarks --quick            # smoke run: few rounds (a few minutes); nothing saved
    python -m benchmarks --only overhead    # one benchmark (repeat --only, or comma-separate)
    python -m benchmarks --json out.json --markdown
    python -m benchmarks --publish          # no run: redraw the charts and rewrite the pages' figures
    python -m benchmarks --plot DIR         # PNG charts of saved results (benchmarks/results/, newest), no run

A run that is not ``--quick`` writes its results file, ``benchmarks/results/<date>-<HHMM>-cpu.json``
(``-gpu`` with CUDA), then draws the charts from that file and rewrites the figures blocks of the
README and the docs (``benchmarks/figures.py``; ``--no-publish`` keeps the pages and charts as they
are). Commit the results file with the pages it changed.

Benchmarks: see ``BENCHMARKS`` below (``--list``). Contenders alternate over several rounds in
each benchmark and medians are reported; ratios are always anyaccel (or a peer) over the raw
PyTorch way of doing the same thing, measured in the same run. Accelerate and Lightning Fabric
are measured when installed (``pip install -r benchmarks/requirements.txt``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import sys
import time
import traceback
from typing import Callable, Dict, List

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402


def _lazy(module: str, func: str = "run") -> Callable[[bool], List[dict]]:
    def call(quick: bool) -> List[dict]:
        return getattr(importlib.import_module(module), func)(quick)

    return call


def _training(quick: bool) -> List[dict]:
    """Rows of benchmarks/bench_training.py (bf16, accumulation), written by another engineer."""
    try:
        mod = importlib.import_module("benchmarks.bench_training")
    except ImportError as exc:
        return [common.skip_row("training", "bf16 / accumulation", "anyaccel", f"bench_training not available: {exc}")]
    rows = []
    for r in mod.run(quick):
        if "contender" in r:  # already a full row
            rows.append(r)
        else:  # {"name", "anyaccel", "raw", "ratio"}
            rows.append(common.row("training", r["name"], "anyaccel", r.get("anyaccel"), r.get("unit", ""),
                                   ratio=r.get("ratio"), baseline="raw", target=r.get("target"),
                                   note=r.get("note", f"raw {r.get('raw')}")))
    return rows


# name -> (what it measures, runner). Order: the most noise-sensitive first.
BENCHMARKS: Dict[str, tuple] = {
    "import": ("import anyaccel / façade / peers on top of import torch (fresh interpreters)",
               _lazy("benchmarks.import_time")),
    "overhead": ("1-process step overhead, tiny + medium MLP, vs raw PyTorch", _lazy("benchmarks.overhead")),
    "training": ("bf16 and gradient-accumulation step overhead (benchmarks/bench_training.py)", _training),
    "data": ("sharded DataLoader iteration, rank 0 of 2, vs DataLoader + DistributedSampler",
             _lazy("benchmarks.data_shard")),
    "ddp": ("2-process CPU DDP training throughput vs raw DDP + DistributedSampler",
            _lazy("benchmarks.distributed", "run_ddp")),
    "gather": ("ops.gather shape-check header cost vs raw all_gather, 2 processes",
               _lazy("benchmarks.distributed", "run_gather")),
    "gfm": ("gather_for_metrics over an eval epoch vs a raw all_gather loop, 2 processes",
            _lazy("benchmarks.distributed", "run_gfm")),
    "fsdp": ("FSDP2 step vs hand-written fully_shard, peak memory per rank vs DDP, 2 processes",
             _lazy("benchmarks.sharding", "run_fsdp")),
    "deepspeed": ("DeepSpeed ZeRO-2/3 step vs the same engine by hand (deepspeed.initialize), peak memory per rank "
                  "ZeRO-1/2/3 vs DDP, 2 CPU processes", _lazy("benchmarks.deepspeed_bench")),
    "nd": ("TP x FSDP2 step vs hand-written parallelize_module + fully_shard, bytes per rank vs DDP, "
           "4 CPU procs (1 GPU process with CUDA)",
           _lazy("benchmarks.nd")),
    "sequence": ("Ulysses sp2 step vs a hand-written all-to-all attention loop; activation memory per rank with sp "
                 "vs one process (measured RSS peak), 2 CPU procs", _lazy("benchmarks.sequence")),
    "expert": ("ep2 x FSDP2 step through the Accelerator vs a hand-written torchtitan-style dispatcher + fully_shard; "
               "all-to-all bytes vs the routing's theory, expert bytes per rank, 2 CPU procs", _lazy("benchmarks.expert")),
    "pipeline": ("pp2 step vs a hand-written PipelineStage + Schedule1F1B loop, bubble per schedule vs theory, "
                 "bytes per rank vs DDP, 2 CPU procs", _lazy("benchmarks.pipeline")),
    "compile": ("torch.compile (inductor) step vs eager, 1 process: anyaccel, raw, Accelerate",
                _lazy("benchmarks.sharding", "run_compile")),
    "bigmodel": ("load a safetensors model into FSDP2 shards, 2 and 4 CPU procs: peak RSS per rank vs raw / Accelerate",
                 _lazy("benchmarks.bigmodel")),
    "async_checkpoint": ("training stall per checkpoint, save_state(async_save=True) vs sync, DDP and FSDP2 x2, 256 MiB model",
                         _lazy("benchmarks.async_checkpoint")),
    "fault_tolerance": ("step time with torchft fault tolerance vs DDP (2 groups x 1) and HSDP (2 x 2 FSDP2: an MLP, "
                        "a GPT-2 wrapped per block) and FSDP2 (1 group x 2: the protocol's fixed cost, a core per "
                        "process); bytes a heal moves",
                        _lazy("benchmarks.fault_tolerance")),
    "launch": ("CLI launchers: 2 CPU processes to first collective", _lazy("benchmarks.launch")),
    "notebook": ("notebook launchers: 2 CPU processes to first collective", _lazy("benchmarks.notebook")),
}


def header(argv: List[str]) -> Dict[str, str]:
    v = common.versions()
    try:
        load = "load average %.2f %.2f %.2f at start" % os.getloadavg()
    except OSError:
        load = ""
    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": f"{common.cpu_model()}, {v['cpus']} CPU(s), {platform.system()} {platform.release()}; {load}",
        "python": v["python"],
        "torch": v["torch"],
        "anyaccel": v["anyaccel"],
        "accelerate": v["accelerate"],
        "lightning": v["lightning"],
        "command": "python -m benchmarks " + " ".join(argv),
    }


def main(argv: List[str] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few rounds: a smoke run, not numbers to quote")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help="run only these benchmarks (repeat or comma-separate); see --list")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("--json", metavar="PATH", help="also write the header and rows as JSON")
    p.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    p.add_argument("--plot", metavar="DIR", help="write PNG charts of saved results into DIR and exit (no run; "
                   "needs matplotlib: pip install -e '.[bench]')")
    p.add_argument("--results", metavar="PATH", help="with --plot: a --json file (or a --markdown table) to plot; "
                   "default: the newest file in benchmarks/results/")
    p.add_argument("--publish", action="store_true", help="run nothing: redraw the charts and rewrite every figures "
                   "block of the README and the docs from the saved results files (benchmarks/figures.py)")
    p.add_argument("--no-publish", action="store_true", help="after the run, write its results file but leave the "
                   "pages and charts as they are")
    args = p.parse_args(argv)
    if args.plot:
        return _plot(p, args.plot, args.results)
    if args.publish:
        return _publish()
    if args.list:
        for name, (what, _) in BENCHMARKS.items():
            print(f"{name:10s} {what}")
        return 0
    only = [n.strip() for item in args.only for n in item.split(",") if n.strip()]
    unknown = [n for n in only if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    import warnings

    warnings.filterwarnings("ignore")
    head = header(argv)
    for k, v in head.items():
        print(f"# {k}: {v}")
    rows: List[dict] = []
    timings: Dict[str, float] = {}
    for name, (what, runner) in BENCHMARKS.items():
        if only and name not in only:
            continue
        print(f"\n## {name}: {what}", flush=True)
        t0 = time.perf_counter()
        try:
            got = runner(args.quick)
        except Exception as exc:  # one broken benchmark must not hide the others
            traceback.print_exc()
            got = [common.skip_row(name, what, "-", f"benchmark failed: {type(exc).__name__}: {exc}"[:300])]
        timings[name] = time.perf_counter() - t0
        common.print_table(got)
        print(f"({timings[name]:.0f} s)", flush=True)
        rows += got
    print("\n# All results (ratio = contender / baseline, medians over alternating rounds)\n")
    common.print_table(rows)
    missed = [r for r in rows if r.get("ok") is False]
    if missed:
        print(f"\n{len(missed)} target(s) missed: " + "; ".join(f"{r['bench']}/{r['name']}/{r['contender']}"
                                                            for r in missed))
    if args.markdown:
        print("\n" + common.markdown_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": head, "seconds": timings, "rows": rows}, f, indent=1)
    if args.quick:
        print("\n(--quick: no results file written; these numbers are not for quoting)")
        return 0
    from benchmarks import figures

    kind = "gpu" if common.cuda_available() else "cpu"
    path = figures.write_results({**head, "benches": sorted({r["bench"] for r in rows})}, rows, timings, kind)
    print(f"\nresults file: {os.path.relpath(path)}")
    return 0 if args.no_publish else _publish()


def _publish() -> int:
    """Charts and pages from the saved results files (benchmarks/figures.py)."""
    from benchmarks import figures

    try:
        import matplotlib  # noqa: F401
        draw = True
    except ImportError:
        draw = False
        print("matplotlib is not installed (pip install -e '.[bench]'): the pages are rewritten, the charts are not "
              "redrawn -- tests/project/test_docs_figures.py will say which chart is stale", file=sys.stderr)
    for changed in figures.publish(draw=draw):
        print(f"updated {os.path.relpath(changed, common.REPO)}")
    for line in figures.conflicts():
        print(f"warning: {line}", file=sys.stderr)
    return 0


def _plot(parser: argparse.ArgumentParser, out_dir: str, source: str = None) -> int:
    from benchmarks import plot

    source = source or plot.newest_results()
    if source is None:
        parser.error(f"no saved results in {plot.RESULTS_DIR}; run `python -m benchmarks --json PATH` and pass "
                     "--results PATH")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error("--plot needs matplotlib: pip install -e '.[bench]' (or pip install matplotlib)")
    for path in plot.plot_all(plot.load_results(source), out_dir):
        print(path)
    print(f"(from {source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
