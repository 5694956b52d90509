"""Step overhead in one process: the same training loop through each framework, divided by raw PyTorch.

    python benchmarks/overhead.py            # full run (about a minute)
    python benchmarks/overhead.py --quick    # smoke run

One loop step = DataLoader batch + forward + cross-entropy + backward + SGD step + zero_grad,
on a tiny 64-wide MLP (where framework overhead shows most; Accelerate measured 1.87x here)
and a medium MLP. All contenders live in this one process with identical weights and data;
each round times a short run of steps (32 tiny / 8 medium, crossing epoch boundaries so epoch
start-up is included in proportion) of every contender, the order rotating each round; the
reported ratio is the median over rounds of (contender time / raw time in the same round).
Time is the process's CPU time (user + system) per step: on a machine shared with other jobs it
does not count the moments this process waited for a core, which wall-clock time does (the
wall-clock ratio is shown in the note). Torch intra-op threads are pinned to ``--threads`` (default 1) for every contender.
``raw'`` is a second, independent raw loop: its ratio shows the measurement noise.
A second row per model counts the Python function calls per step (cProfile over one epoch):
a measure of framework overhead that other jobs on the machine cannot disturb.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from typing import Dict, List

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

TARGET = "<= 1.01"  # issue 20: the tiny-MLP step back to within 1 % of raw PyTorch
# (size, steps per measurement, rounds) for the full and the quick run
PLAN = {False: [("tiny", 32, 240), ("medium", 8, 120)], True: [("tiny", 32, 15), ("medium", 8, 8)]}


def measure(size: str, chunk: int, rounds: int, threads: int = 1, contenders: List[str] = None) -> List[dict]:
    import torch

    from benchmarks import workloads

    torch.set_num_threads(threads)
    names = contenders or ["raw", "raw'", "anyaccel", "accelerate", "fabric"]
    rows: List[dict] = []
    loops: Dict[str, object] = {}
    base_model = workloads.make_model(size)
    for name in names:
        kind = name.rstrip("'")
        mod = workloads.PEER_MODULES.get(kind)
        if mod and not common.have(mod):
            rows.append(common.skip_row("overhead", f"{size} MLP step", name, f"{mod} not installed"))
            continue
        try:
            loops[name] = workloads.stepper(workloads.SETUPS[kind](size, distributed=False, model=base_model))
        except Exception as exc:  # a peer that cannot run here is reported, not fatal
            rows.append(common.skip_row("overhead", f"{size} MLP step", name, f"set-up failed: {exc!r}"[:200]))

    def timed(steps):
        def one() -> dict:
            torch.set_num_threads(threads)  # a framework may have changed it
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in itertools.islice(steps, chunk):
                pass
            t1, c1 = time.perf_counter(), time.process_time()
            return {"cpu": (c1 - c0) / chunk, "wall": (t1 - t0) / chunk}

        return one

    res = common.interleaved({n: timed(f) for n, f in loops.items()}, rounds=rounds, warmup=2, baseline="raw")
    for name in loops:
        cpu, wall = res[name]["cpu"], res[name]["wall"]
        target = TARGET if name == "anyaccel" else None
        note = "noise floor (raw vs raw); " if name == "raw'" else ""
        if name != "raw":
            note += common.ci_text(cpu["ratio_ci"]) + f"; wall-clock ratio {wall['ratio']:.3f}"
        rows.append(common.row("overhead", f"{size} MLP step", name, cpu["median"] * 1e6, "us/step (CPU)",
                               ratio=None if name == "raw" else cpu["ratio"],
                               baseline=None if name == "raw" else "raw", target=target, note=note))
    # Deterministic complement: Python calls per step (cProfile), whole epochs' worth of steps.
    steps_per_epoch = workloads.SIZES[size]["n"] // workloads.SIZES[size]["batch"]
    calls = {n: common.python_calls(f, steps_per_epoch) for n, f in loops.items() if n != "raw'"}
    for name, c in calls.items():
        is_base = name == "raw"
        rows.append(common.row("overhead", f"{size} MLP step: Python calls", name, c, "calls/step",
                               ratio=None if is_base else c / calls["raw"], baseline=None if is_base else "raw",
                               note="" if is_base else f"{c - calls['raw']:+.1f} calls/step (cProfile, deterministic)"))
    order = {n: i for i, n in enumerate(names)}
    rows.sort(key=lambda r: (r["name"], order.get(r["contender"], 99)))
    return rows


def pieces(repeat: int = 9, calls: int = 20000) -> Dict[str, float]:
    """Nanoseconds per call (this thread's CPU time, best of ``repeat``) of each piece anyaccel
    adds to a step, with the work itself removed (a no-op optimizer, a loss whose ``backward``
    does nothing): the loader's per-batch preemption boundary, ``backward``'s wrapper, the
    prepared optimizer's ``step`` and ``zero_grad``. A noisy machine moves these far less than
    the step ratio, so they show where the overhead is."""
    import torch

    from anyaccel import Accelerator

    def best(fn) -> float:
        out = float("inf")
        for _ in range(repeat):
            t0 = time.thread_time_ns()
            for _ in range(calls):
                fn()
            out = min(out, (time.thread_time_ns() - t0) / calls)
        return out

    class _NoOp:
        def step(self, closure=None):
            return None

        def zero_grad(self, set_to_none=True):
            return None

        def backward(self, **kwargs):
            return None

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=1)
    _, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
    opt.optimizer = _NoOp()
    noop = _NoOp()
    out = {"empty call": best(lambda: None)}
    if loader.on_batch is not None:
        out["loader on_batch (preemption boundary)"] = best(loader.on_batch)
    out["backward wrapper"] = best(lambda: acc.backward(noop))
    out["optimizer.step wrapper"] = best(opt.step)
    out["optimizer.zero_grad wrapper"] = best(opt.zero_grad)
    return out


def run(quick: bool = False) -> List[dict]:
    """All overhead rows (tiny and medium model)."""
    threads = int(os.environ.get("BENCH_THREADS", "1"))
    rows: List[dict] = []
    for size, chunk, rounds in PLAN[quick]:
        rows += measure(size, chunk, rounds, threads=threads)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few rounds only (smoke run)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for every contender")
    p.add_argument("--size", choices=["tiny", "medium"], action="append", help="only these model sizes")
    p.add_argument("--rounds", type=int, help="override the number of rounds")
    p.add_argument("--pieces", action="store_true", help="only the ns/call of each per-step piece anyaccel adds")
    args = p.parse_args(argv)
    if args.pieces:
        for name, ns in pieces().items():
            print(f"{name:40s} {ns:8.0f} ns/call (thread CPU time, best of 9)")
        return 0
    rows: List[dict] = []
    for size, chunk, rounds in PLAN[args.quick]:
        if args.size and size not in args.size:
            continue
        rows += measure(size, chunk, args.rounds or rounds, threads=args.threads)
    common.print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
