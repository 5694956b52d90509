"""N-D parallelism measurements inside each worker of a torchrun job (never imported by the parent).

    python -m torch.distributed.run --nproc_per_node 4 ... benchmarks/nd_worker.py --out r.json   # CPU, gloo
    python -m torch.distributed.run --nproc_per_node 1 ... benchmarks/nd_worker.py --out r.json   # one GPU

The model is examples/llama_tp_fsdp.py's ``TinyLlama`` (benchmark sizes), with that example's
tensor-parallel plan, and AdamW. Contenders, all in the same process group, rounds alternating:

* ``hand-written TP x FSDP``: what a user writes without a framework: ``init_device_mesh`` with
  ``("dp_shard", "tp")``, ``parallelize_module`` of each block on ``mesh["tp"]`` with the plan,
  ``fully_shard`` of each block then of the root on ``mesh["dp_shard"]``, AdamW after.
* ``hand-written TP x FSDP'``: a second, independent copy of the first: its ratio to the first is
  what "no difference" looks like in this run (the noise floor).
* ``anyaccel nd``: ``Accelerator(parallelism_config=ParallelismConfig(dp_shard_size, tp_size,
  tp_plan=PLAN, fsdp=FSDPOptions(transformer_cls_names_to_wrap=["Block"])))``, the optimizer built
  before ``prepare`` as users do; ``accelerator.backward``.

Proof that both did what is timed, written into the result: the mesh and the placements of one
q projection per contender, the first step's loss of each (same weights, same batch: they must
agree to rounding), and the bytes of parameters and optimizer state each rank holds (sum of local
shards) — against ``torch.nn.parallel.DistributedDataParallel`` of the same model in the same job
(every rank holds everything).

Sizes: the layout is ``dp_shard = world / tp`` with ``tp = 2`` on 4 processes; with one process
(one GPU) both sizes are 1 (a mesh of one: see the README for what that measures).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from typing import Callable, Dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import common  # noqa: E402

EXAMPLE = os.path.join(common.REPO, "examples", "llama_tp_fsdp.py")
SIZES = dict(vocab=512, width=256, n_heads=8, hidden=512, layers=2, length=64)
QUICK_SIZES = dict(vocab=128, width=64, n_heads=4, hidden=128, layers=2, length=32)
BATCH = 4  # sequences per data-parallel rank and step


def _example():
    spec = importlib.util.spec_from_file_location("llama_tp_fsdp", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _device() -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], None], device: torch.device, steps: int) -> Dict[str, float]:
    """Per step: ``wall`` of the job (slowest rank, after a barrier) and ``cpu``, the CPU time of
    all ranks together (process time: every thread, gloo's included) — the clock that other jobs
    on a shared machine disturb least."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    _sync(device)
    wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64, device=device)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
    return {"wall": float(wall.item()) / steps, "cpu": float(cpu.item()) / steps}


def _local_bytes(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


def _held(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Dict[str, int]:
    return {"params": _local_bytes(model.parameters()),
            "optimizer": _local_bytes([v for st in opt.state.values() for v in st.values()
                                       if isinstance(v, torch.Tensor) and v.dim() > 0])}


def _layout(model: torch.nn.Module) -> str:
    w = model.layers[0].attention.q_proj.weight
    if not hasattr(w, "placements"):
        return f"q_proj.weight: a plain {type(w).__name__} {tuple(w.shape)} (not a DTensor)"
    return (f"q_proj.weight {tuple(w.shape)} on {w.device_mesh}: {tuple(w.placements)}, "
            f"local {tuple(w.to_local().shape)}")


class Job:
    """What every contender shares: the example module, sizes, layout, device and this rank's batch."""

    def __init__(self, quick: bool, tp: int):
        self.example = _example()
        self.sizes = QUICK_SIZES if quick else SIZES
        self.device = _device()
        self.world = dist.get_world_size()
        self.tp = tp if self.world % tp == 0 and self.world > 1 else 1
        self.dp = self.world // self.tp
        dp_rank = dist.get_rank() // self.tp  # tp innermost: the ranks of one TP group share a batch
        data = self.example.counting_sequences(BATCH * self.dp, self.sizes["vocab"], self.sizes["length"], seed=1)
        x, y = data.tensors
        self.batch = (x[dp_rank::self.dp].to(self.device), y[dp_rank::self.dp].to(self.device))

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return self.example.TinyLlama(**self.sizes)

    def loss(self, model: torch.nn.Module) -> torch.Tensor:
        x, y = self.batch
        return torch.nn.functional.cross_entropy(model(x).reshape(-1, self.sizes["vocab"]), y.reshape(-1))


def hand_written(job: Job):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = job.model().to(job.device)
    mesh = init_device_mesh(job.device.type, (job.dp, job.tp), mesh_dim_names=("dp_shard", "tp"))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    block_plan = {pattern.split("*.", 1)[1]: styles[style]() for pattern, style in job.example.PLAN.items()}
    for block in model.layers:
        parallelize_module(block, mesh["tp"], block_plan)
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        job.loss(model).backward()
        opt.step()
        opt.zero_grad()

    return model, opt, step


def with_anyaccel(job: Job):
    from anyaccel import Accelerator, ParallelismConfig
    from anyaccel.strategies.options import FSDPOptions

    config = ParallelismConfig(dp_shard_size=job.dp, tp_size=job.tp, tp_plan=job.example.PLAN,
                               fsdp=FSDPOptions(transformer_cls_names_to_wrap=["Block"]))
    acc = Accelerator(parallelism_config=config)
    model = job.model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # before prepare, as users do
    model, opt = acc.prepare(model, opt)

    def step():
        acc.backward(job.loss(model))
        opt.step()
        opt.zero_grad()

    return model, opt, step, acc


def ddp_held(job: Job) -> Dict[str, int]:
    """Bytes a rank holds under DDP after one step (everything: parameters and AdamW state)."""
    model = torch.nn.parallel.DistributedDataParallel(job.model().to(job.device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    job.loss(model).backward()
    opt.step()
    opt.zero_grad()
    return _held(model, opt)


def run(quick: bool, tp: int) -> Dict:
    job = Job(quick, tp)
    raw_model, raw_opt, raw_step = hand_written(job)
    any_model, any_opt, any_step, acc = with_anyaccel(job)
    # the same weights and batch: the first losses agree to rounding (a wrong layout would not)
    first = {"hand-written TP x FSDP": float(job.loss(raw_model)), "anyaccel nd": float(job.loss(any_model))}
    proof = {"anyaccel mesh": str(acc.torch_device_mesh), "strategy": acc.strategy.name,
             "hand-written TP x FSDP": _layout(raw_model), "anyaccel nd": _layout(any_model), "first loss": first}
    floor_step = hand_written(job)[2]  # a second, independent hand-written loop: the run's noise floor
    steppers = {"hand-written TP x FSDP": raw_step, "hand-written TP x FSDP'": floor_step, "anyaccel nd": any_step}
    chunk = 2 if quick else 3

    def measure(step):
        return lambda: _timed(lambda: [step() for _ in range(chunk)], job.device, chunk)

    res = common.interleaved({n: measure(s) for n, s in steppers.items()}, rounds=3 if quick else 16, warmup=1,
                             baseline="hand-written TP x FSDP")
    # Python calls per step on rank 0 (cProfile; the other ranks run the same steps uncounted):
    # framework overhead that no other job on the machine can disturb
    calls = {n: common.python_calls((s() for _ in iter(int, 1)), 2, enabled=dist.get_rank() == 0)
             for n, s in steppers.items()}
    held = {"hand-written TP x FSDP": _held(raw_model, raw_opt), "anyaccel nd": _held(any_model, any_opt),
            "DDP": ddp_held(job)}
    per_rank = [None] * job.world
    dist.all_gather_object(per_rank, held)
    full = sum(p.numel() * p.element_size() for p in job.model().parameters())
    return {"device": job.device.type, "world": job.world, "dp_shard": job.dp, "tp": job.tp, "sizes": job.sizes,
            "model_bytes": full, "proof": proof, "held": per_rank,
            "calls": calls,
            "step": {n: {clock: {"median": m["median"], "ratio": m.get("ratio"), "ci": m.get("ratio_ci")}
                         for clock, m in r.items()} for n, r in res.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    result = run(args.quick, args.tp)
    if dist.get_rank() == 0:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
