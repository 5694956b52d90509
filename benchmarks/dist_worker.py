"""The 2-process measurements, run inside each worker of a torchrun job (never imported by the parent).

    python -m torch.distributed.run --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint localhost:0 \\
        benchmarks/dist_worker.py --task ddp --out result.json [--quick]

Tasks (rank 0 writes the JSON result to ``--out``):

* ``ddp``     training throughput, 2 processes: raw DDP + DistributedSampler vs anyaccel (and
              Accelerate / Lightning Fabric when installed), each contender its own model copy,
              all in the same process group, rounds alternating; only the steady-state loop is timed.
* ``gather``  ``anyaccel.ops.gather`` with the shape-check header (check=True), without it
              (check=False), and a raw ``dist.all_gather`` + ``torch.cat``, per call.
* ``gfm``     an evaluation epoch of an uneven dataset: ``accelerator.gather_for_metrics`` vs a raw
              loop (DistributedSampler + all_gather + truncating the padding at the end), and
              Accelerate's ``gather_for_metrics``; checks that every sample is counted once.


The process group is created here first (gloo, env://); every framework then joins the existing one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import common, workloads  # noqa: E402


def _barrier_timed(fn: Callable[[], None]) -> float:
    """Wall time of ``fn`` on the slowest rank (barrier before, max over ranks after)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt.item())


def _timed_both(fn: Callable[[], None]) -> Dict[str, float]:
    """Wall time of ``fn`` on the slowest rank, and CPU time (all threads, e.g. gloo's) summed over ranks."""
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    t1, c1 = time.perf_counter(), time.process_time()
    wall = torch.tensor([t1 - t0], dtype=torch.float64)
    cpu = torch.tensor([c1 - c0], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
    return {"wall": float(wall.item()), "cpu": float(cpu.item())}


def _contenders(names: List[str]) -> List[str]:
    out = []
    for n in names:
        mod = workloads.PEER_MODULES.get(n.rstrip("'"))
        if mod is None or common.have(mod):
            out.append(n)
    return out


def task_ddp(quick: bool) -> Dict:
    """Samples/s of the whole job for each contender (median over rounds) and per-round ratios."""
    plan = {"tiny": (32, 6 if quick else 150), "medium": (8, 4 if quick else 80)}
    result: Dict = {}
    for size, (chunk, rounds) in plan.items():
        base_model = workloads.make_model(size)
        loops, errors = {}, {}
        for name in _contenders(["raw", "raw'", "anyaccel", "accelerate", "fabric"]):
            try:
                loops[name] = workloads.stepper(workloads.SETUPS[name.rstrip("'")](size, True, model=base_model))
            except Exception as exc:  # noqa: BLE001 - report, do not abort the job
                errors[name] = f"set-up failed: {exc!r}"[:200]
        global_batch = workloads.SIZES[size]["batch"] * dist.get_world_size()

        def timed(steps):
            def one() -> Dict[str, float]:
                torch.set_num_threads(1)
                t = _timed_both(lambda: [None for _ in itertools.islice(steps, chunk)])
                samples = chunk * global_batch
                # samples per second of the job; samples per CPU-second of the job (robust to other load)
                return {"wall": samples / t["wall"], "cpu": samples / t["cpu"]}

            return one

        res = common.interleaved({n: timed(s) for n, s in loops.items()}, rounds=rounds, warmup=2, baseline="raw")
        # Deterministic complement: Python calls per step on rank 0 (both ranks keep stepping).
        per_epoch = workloads.SIZES[size]["n"] // (workloads.SIZES[size]["batch"] * dist.get_world_size())
        calls = {n: common.python_calls(s, per_epoch, enabled=dist.get_rank() == 0)
                 for n, s in loops.items() if n != "raw'"}
        result[size + " calls"] = calls
        result[size] = {"results": {n: {"median": r["wall"]["median"], "ratio": r["wall"]["ratio"],
                                        "ci": r["wall"]["ratio_ci"], "cpu_median": r["cpu"]["median"],
                                        "cpu_ratio": r["cpu"]["ratio"], "cpu_ci": r["cpu"]["ratio_ci"]}
                                    for n, r in res.items()},
                        "errors": errors, "chunk": chunk, "rounds": rounds}
    return result


def _cpu_timed(fn: Callable[[], None]) -> float:
    c0 = time.process_time()
    fn()
    return time.process_time() - c0


class _local_collectives:
    """Replace ``dist.all_gather``/``all_gather_single`` (``all_gather_into_tensor`` on older
    torch) by local copies (every rank "sends" its own tensor) inside the block; no communication
    happens, so ranks may run it alone."""

    _NAMES = ("all_gather", "all_gather_single", "all_gather_into_tensor")

    def __enter__(self):
        self.saved = {name: getattr(dist, name) for name in self._NAMES if hasattr(dist, name)}

        def all_gather(out, t, group=None, async_op=False):
            for o in out:
                o.copy_(t)

        def all_gather_into_tensor(out, t, group=None, async_op=False):
            if t.numel():
                out.reshape(-1).view(out.numel() // t.numel(), -1).copy_(t.reshape(1, -1))

        for name in self.saved:
            setattr(dist, name, all_gather if name == "all_gather" else all_gather_into_tensor)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)
        dist.barrier()
        return False


def task_gather(quick: bool) -> Dict:
    """Microseconds per gather call: raw all_gather, ops.gather(check=False), ops.gather(check=True)."""
    from anyaccel import ops

    world = dist.get_world_size()
    result: Dict = {}
    for label, shape in (("64x10 float", (64, 10)), ("64x1024 float", (64, 1024))):
        t = torch.randn(*shape)
        calls = 50
        rounds = 10 if quick else 80

        def raw() -> None:
            for _ in range(calls):
                out = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(out, t)
                torch.cat(out, dim=0)

        def unchecked() -> None:
            for _ in range(calls):
                ops.gather(t, check=False)

        def checked() -> None:
            for _ in range(calls):
                ops.gather(t, check=True)

        assert torch.equal(ops.gather(t, check=True), ops.gather(t, check=False))
        fns = {"raw all_gather": raw, "gather(check=False)": unchecked, "gather(check=True)": checked}
        res = common.interleaved({n: (lambda f=f: _barrier_timed(f) / calls) for n, f in fns.items()},
                                 rounds=rounds, warmup=2, baseline="raw all_gather")
        result[label] = {n: {"median": r["median"], "ratio": r["ratio"], "ci": r["ratio_ci"]} for n, r in res.items()}
        # The same calls with the collectives replaced by local copies: what each costs in CPU
        # work on the calling rank (hashing, formatting, tensor ops), apart from network round trips.
        with _local_collectives():
            local = common.interleaved({n: (lambda f=f: _cpu_timed(f) / calls) for n, f in fns.items()},
                                       rounds=rounds, warmup=2, baseline="raw all_gather")
        result[label + ", local work only"] = {n: {"median": r["median"], "ratio": r["ratio"], "ci": r["ratio_ci"]}
                                               for n, r in local.items()}
    return result


def task_gfm(quick: bool) -> Dict:
    """One evaluation epoch (uneven dataset) with per-batch metric gathering, per contender."""
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    n, batch = 10_007, 64  # does not divide by 2 x 64: padding must be removed
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, 10, generator=g), torch.arange(n))
    world = dist.get_world_size()
    counts: Dict[str, int] = {}

    # raw: DistributedSampler pads the index list to a multiple of world size; gather every batch,
    # cut the total back to n at the end (the usual hand-written loop).
    sampler = DistributedSampler(ds, shuffle=False)
    raw_loader = DataLoader(ds, batch_size=batch, sampler=sampler)

    def raw() -> None:
        preds, labels = [], []
        for x, y in raw_loader:
            ox = [torch.empty_like(x) for _ in range(world)]
            oy = [torch.empty_like(y) for _ in range(world)]
            dist.all_gather(ox, x)
            dist.all_gather(oy, y)
            preds.append(torch.cat(ox))
            labels.append(torch.cat(oy))
        counts["raw all_gather loop"] = int(torch.cat(labels)[:n].numel())

    fns = {"raw all_gather loop": raw}

    import anyaccel

    acc = anyaccel.Accelerator()
    any_loader = acc.prepare(DataLoader(ds, batch_size=batch, shuffle=False))

    def ours() -> None:
        labels = []
        for x, y in any_loader:
            px, py = acc.gather_for_metrics((x, y))
            labels.append(py)
        allv = torch.cat(labels)
        counts["anyaccel"] = int(allv.numel()) if int(torch.unique(allv).numel()) == n else -int(allv.numel())

    fns["anyaccel"] = ours

    if common.have("accelerate"):
        try:
            import accelerate

            hacc = accelerate.Accelerator(cpu=True)
            hf_loader = hacc.prepare(DataLoader(ds, batch_size=batch, shuffle=False))

            def hf() -> None:
                labels = []
                for x, y in hf_loader:
                    px, py = hacc.gather_for_metrics((x, y))
                    labels.append(py)
                allv = torch.cat(labels)
                counts["accelerate"] = int(allv.numel()) if int(torch.unique(allv).numel()) == n else -int(allv.numel())

            fns["accelerate"] = hf
        except Exception as exc:  # noqa: BLE001
            counts["accelerate"] = f"set-up failed: {exc!r}"[:200]
    rounds = 3 if quick else 15
    res = common.interleaved({k: (lambda f=f: _barrier_timed(f)) for k, f in fns.items()}, rounds=rounds,
                             warmup=1, baseline="raw all_gather loop")
    return {"n": n, "batch": batch, "counts": counts,
            "results": {k: {"median": r["median"], "ratio": r["ratio"], "ci": r["ratio_ci"]} for k, r in res.items()}}


TASKS = {"ddp": task_ddp, "gather": task_gather, "gfm": task_gfm}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--task", choices=sorted(TASKS), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        result = TASKS[args.task](args.quick)
        if dist.get_rank() == 0:
            tmp = args.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(result, f)
            os.replace(tmp, args.out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
