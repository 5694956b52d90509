"""FSDP2 measurements inside each worker of a 2-process torchrun job (never imported by the parent).

    python -m torch.distributed.run --nproc_per_node 2 ... benchmarks/sharding_worker.py --task step --out r.json
    ... --task memory --strategy fsdp|ddp --out r.json       (one job per strategy: peak RSS is per process)

* ``step``    step time of anyaccel's FSDP2 vs a hand-written ``fully_shard`` loop (same model, same
              wrapping, same data), both in the same process group, rounds alternating.
* ``memory``  peak resident memory of one rank over a few training steps of a model whose
              parameters dominate (16 x Linear(1024, 1024), AdamW), DDP or FSDP2 through anyaccel,
              above what the process held before the model existed; plus the bytes of parameters,
              gradients and optimizer state this rank holds.

On CUDA the same tasks run on the GPU (``torch.cuda.max_memory_allocated`` for memory).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from typing import Callable, Dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import common  # noqa: E402

WIDTH = 1024


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def make_model(width: int = WIDTH, blocks: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(Block(width) for _ in range(blocks)))


def _device() -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _batches(device: torch.device, batch: int = 16, width: int = WIDTH):
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(batch, width, generator=g).to(device)
    while True:
        yield x


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    _sync(device)
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt.item())


def raw_fsdp_stepper(device: torch.device):
    """What a user writes by hand: fully_shard each block and the root, optimizer after sharding."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model().to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = _batches(device)

    def steps():
        while True:
            loss = model(next(data)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            yield

    return steps()


def make_accelerator(strategy: str):
    from anyaccel import Accelerator
    from anyaccel.plugins import FullyShardedDataParallelPlugin

    kwargs = {"fsdp_plugin": FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"])} \
        if strategy == "fsdp" else {"strategy": strategy}
    return Accelerator(**kwargs)


def anyaccel_stepper(strategy: str, acc=None):
    acc = acc or make_accelerator(strategy)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # built before prepare, as users do
    model, opt = acc.prepare(model, opt)
    data = _batches(acc.device)

    def steps():
        while True:
            loss = model(next(data)).square().mean()
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            yield

    return steps(), acc, model, opt


def task_step(quick: bool) -> Dict:
    device = _device()
    loops = {"hand-written fully_shard": raw_fsdp_stepper(device), "anyaccel fsdp": anyaccel_stepper("fsdp")[0]}
    chunk = 5

    def measure(steps):
        return lambda: _timed(lambda: [None for _ in itertools.islice(steps, chunk)], device) / chunk

    res = common.interleaved({n: measure(s) for n, s in loops.items()}, rounds=4 if quick else 25, warmup=2,
                             baseline="hand-written fully_shard")
    return {n: {"median": r["median"], "ratio": r["ratio"], "ci": r["ratio_ci"]} for n, r in res.items()}


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _local_bytes(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


def task_memory(quick: bool, strategy: str) -> Dict:
    device = _device()
    # Everything but the model first, for both strategies alike: the code FSDP2 and DTensor load
    # takes memory of its own, which is not what this measures.
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    acc = make_accelerator(strategy)
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = _rss_bytes("VmRSS:")
    steps, acc, model, opt = anyaccel_stepper(strategy, acc)
    for _ in itertools.islice(steps, 3 if quick else 6):
        pass
    _sync(device)
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _rss_bytes("VmHWM:")) - before
    held = {"params": _local_bytes(model.parameters()),
            "optimizer": _local_bytes([v for st in opt.state.values() for v in st.values()
                                       if isinstance(v, torch.Tensor) and v.dim() > 0])}
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, {"peak": peak, **held})
    return {"device": device.type, "per_rank": peaks, "model_bytes": sum(p.numel() * 4 for p in make_model().parameters())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", choices=("step", "memory"), required=True)
    parser.add_argument("--strategy", choices=("fsdp", "ddp"), default="fsdp")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    result = task_step(args.quick) if args.task == "step" else task_memory(args.quick, args.strategy)
    if dist.get_rank() == 0:
        with open(args.out, "w") as fh:
            json.dump(result, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
