"""Step overhead in one process: the same training loop through each framework, divided by raw PyTorch.

    python benchmarks/overhead.py            # full run (about a minute)
    python benchmarks/overhead.py --quick    # smoke run

One loop step = DataLoader batch + forward + cross-entropy + backward + SGD step + zero_grad,
on a tiny 64-wide MLP (where framework overhead shows most; Accelerate measured 1.87x here)
and a medium MLP. All contenders live in this one process with identical weights and data;
each round times one or more epochs of every contender, the order rotating each round; the
reported ratio is the median over rounds of (contender time / raw time in the same round).
``raw'`` is a second, independent raw loop: its ratio shows the measurement noise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

TARGET = "<= 1.02"
# (size, epochs per measurement, rounds) for the full and the quick run
PLAN = {False: [("tiny", 2, 21), ("medium", 1, 9)], True: [("tiny", 1, 3), ("medium", 1, 2)]}


def measure(size: str, epochs: int, rounds: int, threads: int = 1, contenders: List[str] = None) -> List[dict]:
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
            loops[name] = workloads.SETUPS[kind](size, distributed=False, model=base_model)
        except Exception as exc:  # a peer that cannot run here is reported, not fatal
            rows.append(common.skip_row("overhead", f"{size} MLP step", name, f"set-up failed: {exc!r}"[:200]))

    def timed(run_epoch):
        def one() -> float:
            torch.set_num_threads(threads)  # a framework may have changed it
            t0 = time.perf_counter()
            steps = sum(run_epoch() for _ in range(epochs))
            return (time.perf_counter() - t0) / steps

        return one

    res = common.interleaved({n: timed(f) for n, f in loops.items()}, rounds=rounds, warmup=1, baseline="raw")
    for name in loops:
        r = res[name]
        target = TARGET if name == "anyaccel" else None
        note = "noise floor (raw vs raw)" if name == "raw'" else ""
        rows.append(common.row("overhead", f"{size} MLP step", name, r["median"] * 1e6, "us/step",
                               ratio=None if name == "raw" else r["ratio"],
                               baseline=None if name == "raw" else "raw", target=target, note=note))
    order = {n: i for i, n in enumerate(names)}
    rows.sort(key=lambda r: order.get(r["contender"], 99))
    return rows


def run(quick: bool = False) -> List[dict]:
    """All overhead rows (tiny and medium model)."""
    threads = int(os.environ.get("BENCH_THREADS", "1"))
    rows: List[dict] = []
    for size, epochs, rounds in PLAN[quick]:
        rows += measure(size, epochs, rounds, threads=threads)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few rounds only (smoke run)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for every contender")
    p.add_argument("--size", choices=["tiny", "medium"], action="append", help="only these model sizes")
    p.add_argument("--rounds", type=int, help="override the number of rounds")
    args = p.parse_args(argv)
    rows: List[dict] = []
    for size, epochs, rounds in PLAN[args.quick]:
        if args.size and size not in args.size:
            continue
        rows += measure(size, epochs, args.rounds or rounds, threads=args.threads)
    common.print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
