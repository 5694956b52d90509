"""Overhead of anyaccel's training features in one process, against raw PyTorch doing the same.

    python benchmarks/bench_training.py            # full run (about a minute)
    python benchmarks/bench_training.py --quick    # smoke run

Workloads (the MLPs and data of ``benchmarks/workloads.py``; cross-entropy, SGD with momentum):

* ``bf16 step`` -- ``Accelerator(mixed_precision="bf16")`` + ``prepare`` + ``backward`` against
  raw ``torch.autocast("cpu", torch.bfloat16)`` around the forward and ``out.float()`` for the loss.
* ``accumulation k=4 micro-step`` -- ``Accelerator(gradient_accumulation_steps=4)`` with
  ``with accelerator.accumulate(model)`` and unconditional ``optimizer.step()/zero_grad()``,
  against a raw loop dividing the loss by 4 and stepping every 4th batch (and at the epoch end).

All contenders live in this process with identical weights and data. A measurement times a
fixed number of consecutive steps (crossing epoch boundaries); the contenders alternate, the
order rotating every round; ``ratio`` is the median over rounds of (anyaccel / raw in the same
round). Time is process CPU time per step (robust to other jobs on the machine); the wall-clock
ratio is in the note. ``raw'`` is a second raw loop: its ratio is the noise floor.
Torch intra-op threads are pinned to ``--threads`` (default 1).

``run(quick) -> list[dict]`` returns the rows (see ``benchmarks/common.py``) for the benchmarks
entry point.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings
from typing import Callable, Dict, Iterator, List

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

BENCH = "training"
TARGET = "<= 1.02"
ACCUM = 4
# (workload, model size, steps per measurement, rounds) for the full and the quick run
PLAN = {
    False: [("bf16", "medium", 30, 21), ("accumulation", "tiny", 200, 21), ("accumulation", "medium", 30, 15)],
    True: [("bf16", "medium", 5, 3), ("accumulation", "tiny", 20, 3)],
}


# ------------------------------------------------------------------------------------------
# contenders: each returns an endless iterator that performs one training step per next()
# ------------------------------------------------------------------------------------------


def _data(size: str):
    from torch.utils.data import DataLoader

    from benchmarks import workloads

    return DataLoader(workloads.make_dataset(size), batch_size=workloads.SIZES[size]["batch"], shuffle=True)


def _opt(model):
    import torch

    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def raw_bf16(size: str, model) -> Iterator[None]:
    import torch
    import torch.nn.functional as F

    model = copy.deepcopy(model)
    opt, loader = _opt(model), _data(size)
    while True:
        for x, y in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = F.cross_entropy(out.float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            yield


def anyaccel_bf16(size: str, model) -> Iterator[None]:
    import torch.nn.functional as F

    from anyaccel import Accelerator

    acc = Accelerator(mixed_precision="bf16")
    model = copy.deepcopy(model)
    model, opt, loader = acc.prepare(model, _opt(model), _data(size))
    while True:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            yield


def raw_accumulation(size: str, model) -> Iterator[None]:
    import torch.nn.functional as F

    model = copy.deepcopy(model)
    opt, loader = _opt(model), _data(size)
    while True:
        n = len(loader)
        for i, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y) / ACCUM
            loss.backward()
            if (i + 1) % ACCUM == 0 or i + 1 == n:
                opt.step()
                opt.zero_grad()
            yield


def anyaccel_accumulation(size: str, model) -> Iterator[None]:
    import torch.nn.functional as F

    from anyaccel import Accelerator

    acc = Accelerator(gradient_accumulation_steps=ACCUM)
    model = copy.deepcopy(model)
    model, opt, loader = acc.prepare(model, _opt(model), _data(size))
    while True:
        for x, y in loader:
            with acc.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            yield


CONTENDERS: Dict[str, Dict[str, Callable]] = {
    "bf16": {"raw": raw_bf16, "raw'": raw_bf16, "anyaccel": anyaccel_bf16},
    "accumulation": {"raw": raw_accumulation, "raw'": raw_accumulation, "anyaccel": anyaccel_accumulation},
}
TITLES = {"bf16": "bf16 step (CPU autocast)", "accumulation": f"accumulation k={ACCUM} micro-step"}


# ------------------------------------------------------------------------------------------
# measuring
# ------------------------------------------------------------------------------------------


def measure(workload: str, size: str, steps: int, rounds: int, threads: int = 1) -> List[dict]:
    """Rows for one workload: raw, raw' (noise floor) and anyaccel, CPU µs per step."""
    import torch

    from benchmarks import workloads

    torch.set_num_threads(threads)
    base = workloads.make_model(size)
    name = f"{TITLES[workload]}, {size} MLP"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loops = {who: make(size, base) for who, make in CONTENDERS[workload].items()}

    def timed(loop):
        def one():
            torch.set_num_threads(threads)
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(steps):
                next(loop)
            t1, c1 = time.perf_counter(), time.process_time()
            return {"cpu": (c1 - c0) / steps, "wall": (t1 - t0) / steps}

        return one

    res = common.interleaved({who: timed(loop) for who, loop in loops.items()}, rounds=rounds, warmup=1,
                             baseline="raw")
    rows = []
    for who in loops:
        cpu, wall = res[who]["cpu"], res[who]["wall"]
        note = "noise floor (raw vs raw); " if who == "raw'" else ""
        if who != "raw":
            note += f"wall-clock ratio {wall['ratio']:.3f}; {rounds} rounds x {steps} steps"
        rows.append(common.row(BENCH, name, who, cpu["median"] * 1e6, "us/step (CPU)",
                               ratio=None if who == "raw" else cpu["ratio"],
                               baseline=None if who == "raw" else "raw",
                               target=TARGET if who == "anyaccel" else None, note=note))
    return rows


def run(quick: bool = False) -> List[dict]:
    """All rows of this benchmark (bf16 overhead, accumulation overhead)."""
    threads = int(os.environ.get("BENCH_THREADS", "1"))
    rows: List[dict] = []
    for workload, size, steps, rounds in PLAN[quick]:
        rows += measure(workload, size, steps, rounds, threads=threads)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few rounds only (smoke run)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for every contender")
    p.add_argument("--rounds", type=int, help="override the number of rounds")
    args = p.parse_args(argv)
    rows: List[dict] = []
    for workload, size, steps, rounds in PLAN[args.quick]:
        rows += measure(workload, size, steps, args.rounds or rounds, threads=args.threads)
    common.print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
