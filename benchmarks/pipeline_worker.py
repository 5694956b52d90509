"""Pipeline-parallel measurements inside each worker of a torchrun job (never imported by the parent).

    python -m torch.distributed.run --nproc_per_node 2 ... benchmarks/pipeline_worker.py --out r.json   # CPU, gloo

The model is an ``nn.Sequential``: an embedding, ``blocks`` pre-norm residual MLP blocks, a norm
and a vocabulary head (what ``prepare`` cuts at its children); AdamW; cross entropy. Contenders,
all in the same process group, rounds alternating:

* ``hand-written pipeline``: torchtitan's recipe written by hand: this rank's children in an
  ``nn.Sequential`` (the even cut anyaccel makes), ``PipelineStage``, ``Schedule1F1B`` with the
  loss divided by the micro-batch count, ``schedule.step`` fed on the first stage and given the
  targets on the last; AdamW.
* ``hand-written pipeline'``: one hand-written copy against another: the noise floor.
* ``anyaccel pp``: ``Accelerator(parallelism_config=ParallelismConfig(pp_size=P, pp_microbatches=m))``,
  the optimizer built before ``prepare``, ``accelerator.pipeline_step(model, x, y, loss_fn)`` —
  which also sends the loss to every rank, something the hand-written loop does not do.

Each contender is 3 copies (``pooled``): two identical copies differ by a few per cent for a
whole run, so a contender's value in a round is the median of its copies' (benchmarks/README.md).
Each rank is pinned to a core of its own.

Proof, in the result: the stages each rank holds under each contender, the schedule steps counted
by anyaccel's pipeline, and the first loss of each (same weights, same batch: equal to rounding).

Bubble: for each schedule (GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble) through anyaccel, the step
time ``T`` each rank spends inside the schedule (``pipeline_step`` without the optimizer step) and
the time ``B`` it spends inside the forward and backward chunks of its stages during it (torch's
``PipelineStage`` methods, timed on the built schedule); ``1 - B / T`` is the part it waits (the bubble, plus sends and receives), against the
theory ``(P - 1) / (m + P - 1)`` for GPipe/1F1B, ``(P - 1) / (v * m + P - 1)`` for
``v`` stages per rank, and about 0 for zero-bubble schedules.

Memory: parameter + AdamW-state bytes each rank holds after a step, anyaccel pp against DDP
of the same model in the same job (every rank holds everything).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import common  # noqa: E402

SIZES = dict(vocab=512, width=256, hidden=1024, blocks=8, seq=64, batch=16, microbatches=4)
QUICK_SIZES = dict(vocab=128, width=64, hidden=256, blocks=4, seq=32, batch=8, microbatches=4)
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")
BASE = "hand-written pipeline"


class Block(torch.nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, hidden)
        self.fc2 = torch.nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def build(s: Dict[str, int]) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(s["vocab"], s["width"]),
                               *[Block(s["width"], s["hidden"]) for _ in range(s["blocks"])],
                               torch.nn.LayerNorm(s["width"]), torch.nn.Linear(s["width"], s["vocab"]))


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _held(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    tensors = list(model.parameters())
    tensors += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return sum(t.numel() * t.element_size() for t in tensors)


class Job:
    def __init__(self, quick: bool):
        self.s = QUICK_SIZES if quick else SIZES
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, self.s["vocab"], (self.s["batch"], self.s["seq"]), generator=g)
        self.y = torch.randint(0, self.s["vocab"], (self.s["batch"], self.s["seq"]), generator=g)


def hand_written(job: Job):
    """torchtitan's recipe by hand: this rank's children, a stage, 1F1B, the loss / m."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from anyaccel.strategies.nd.pipeline.split import plan_stages

    model = build(job.s)
    plan = plan_stages(model, job.world)  # the same cut as anyaccel's, for a like-for-like comparison
    mine = plan.stages[job.rank]
    stage_module = torch.nn.Sequential()
    for name in mine:
        stage_module.add_module(name, model.get_submodule(name))
    m = job.s["microbatches"]
    stage = PipelineStage(stage_module, job.rank, job.world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, m, loss_fn=lambda out, tgt: loss_fn(out, tgt) / m, scale_grads=False)
    opt = torch.optim.AdamW(stage_module.parameters(), lr=1e-4)
    first, last = job.rank == 0, job.rank == job.world - 1
    losses: List[torch.Tensor] = []

    def step() -> None:
        if first:
            schedule.step(job.x)
        else:
            schedule.step(target=job.y if last else None, losses=losses if last else None)
        opt.step()
        opt.zero_grad()

    return stage_module, opt, step, losses, list(mine)


def with_anyaccel(job: Job, schedule: str = "1F1B"):
    from anyaccel import Accelerator, ParallelismConfig

    config = ParallelismConfig(pp_size=job.world, pp_schedule=schedule, pp_microbatches=job.s["microbatches"])
    acc = Accelerator(parallelism_config=config)
    model = build(job.s)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # before prepare, as users do
    model, opt = acc.prepare(model, opt)
    last: List[float] = []

    def step() -> None:
        last[:] = [float(acc.pipeline_step(model, job.x, job.y, loss_fn))]
        opt.step()
        opt.zero_grad()

    return model, opt, step, acc, last


def busy_clock(pipeline: Any) -> List[float]:
    """Time every forward and backward chunk this rank's stages run inside the schedule (torch's
    ``PipelineStage`` methods, wrapped on the built schedule's stage objects): the returned list's
    one element accumulates seconds. Waits for sends and receives happen outside these methods."""
    busy = [0.0]
    stages = [st for schedule in pipeline._schedules.values()
              for st in (getattr(schedule, "_stages", None) or [schedule._stage])]
    for stage in stages:
        for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            inner = getattr(stage, method)

            def timed(*args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    busy[0] += time.perf_counter() - t0

            setattr(stage, method, timed)
    return busy


def bubbles(job: Job, quick: bool) -> Dict[str, Any]:
    """Measured and theoretical bubble of each schedule, through anyaccel (one Accelerator each)."""
    out: Dict[str, Any] = {}
    p, m = job.world, job.s["microbatches"]
    for name in SCHEDULES:  # torch's Interleaved1F1B / ZBV run 2 stages per rank here
        model, opt, step, acc, _ = with_anyaccel(job, name)
        pipeline = acc.strategy.pipeline_for(model)
        step()  # builds the schedule
        busy = busy_clock(pipeline)
        inside = [0.0]  # time inside the schedule's step (not the optimizer's)
        run_schedule = pipeline.step

        def timed_step(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return run_schedule(*args, **kwargs)
            finally:
                inside[0] += time.perf_counter() - t0

        pipeline.step = timed_step
        steps = 3 if quick else 8
        busy[0] = 0.0
        wall = common.timed_collective(lambda: [step() for _ in range(steps)], steps)["wall"]
        compute, schedule_s = busy[0] / steps, inside[0] / steps
        measured = torch.tensor([1.0 - compute / schedule_s], dtype=torch.float64)
        gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(job.world)]
        dist.all_gather(gathered, measured)
        v = len(pipeline.stages)
        theory = 0.0 if "ZeroBubble" in name else (p - 1) / (v * m + p - 1)
        out[name] = {"step_s": wall, "schedule_s": schedule_s, "compute_s": compute, "bubble": [float(t.item()) for t in gathered],
                     "theory": theory, "stages_per_rank": v, "steps": pipeline.steps}
        acc.end_training()
        del model, opt
    return out


def pooled(res: Dict[str, Dict[str, Any]], groups: Dict[str, List[str]], baseline: str,
           pairs: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Per clock: each group's value of a round is the median of its copies' values in that round;
    ``ratio`` is the median over rounds of a group's value to ``baseline``'s, with its 95% CI.
    ``pairs``: extra rows ``{name: (copy, other copy)}`` (one copy against another: what a single
    copy's ratio can be)."""
    out: Dict[str, Dict[str, Any]] = {}
    for clock in ("wall", "cpu"):
        value = {g: [common.median(r) for r in zip(*(res[c][clock]["samples"] for c in copies))]
                 for g, copies in groups.items()}
        value.update({name: res[a][clock]["samples"] for name, (a, _) in pairs.items()})
        against = {name: res[b][clock]["samples"] for name, (_, b) in pairs.items()}
        for name, xs in value.items():
            base = against.get(name, value[baseline])
            ratios = [a / b for a, b in zip(xs, base) if b > 0]
            entry = {"median": common.median(xs), "ratio": None if name == baseline else common.median(ratios),
                     "ci": None if name == baseline else common.median_ci(ratios)}
            if name in groups:
                entry["copies"] = [res[c][clock]["median"] for c in groups[name]]
            out.setdefault(name, {})[clock] = entry
    return out


def run(quick: bool) -> Dict[str, Any]:
    job = Job(quick)
    copies = 1 if quick else 3  # one copy of a model runs a few % faster or slower than another, for
    hand = [hand_written(job) for _ in range(copies)]  # the whole run (where its tensors lie): each
    mine = [with_anyaccel(job) for _ in range(copies)]  # contender is the median of its copies
    (raw_model, raw_opt, _, raw_losses, raw_units), (any_model, any_opt, _, acc, any_losses) = hand[0], mine[0]
    pipeline = acc.strategy.pipeline_for(any_model)
    for h in hand:
        h[2]()
    for a in mine:
        a[2]()
    first_any = any_losses[0]  # the step overwrites it
    m = job.s["microbatches"]  # the schedule's losses are those of its loss function: divided by m
    first_raw = torch.tensor([float(torch.stack(raw_losses).mean()) * m if raw_losses else 0.0])
    dist.broadcast(first_raw, src=job.world - 1)
    if copies == 1:  # the quick run: an independent second copy for the noise floor
        hand.append(hand_written(job))
    steppers = {f"{BASE} #{i + 1}": h[2] for i, h in enumerate(hand)}
    steppers.update({f"anyaccel pp #{i + 1}": a[2] for i, a in enumerate(mine)})
    chunk = 2 if quick else 3

    def measure(step: Callable[[], None]) -> Callable[[], Dict[str, float]]:
        return lambda: common.timed_collective(lambda: [step() for _ in range(chunk)], chunk)

    res = common.interleaved({n: measure(s) for n, s in steppers.items()}, rounds=3 if quick else 24, warmup=1)
    groups = {BASE: [f"{BASE} #{i + 1}" for i in range(copies)],
              "anyaccel pp": [f"anyaccel pp #{i + 1}" for i in range(copies)]}
    step = pooled(res, groups, BASE, {BASE + "'": (f"{BASE} #2", f"{BASE} #1")})
    calls = {n: common.python_calls((steppers[f"{n} #1"]() for _ in iter(int, 1)), 2, enabled=job.rank == 0)
             for n in (BASE, "anyaccel pp")}
    calls[BASE + "'"] = calls[BASE]
    ddp = torch.nn.parallel.DistributedDataParallel(build(job.s))
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    loss_fn(ddp(job.x), job.y).backward()
    ddp_opt.step()
    held = {"DDP": _held(ddp, ddp_opt), "anyaccel pp": _held(any_model, any_opt), BASE: _held(raw_model, raw_opt)}
    per_rank: List[Any] = [None] * job.world
    dist.all_gather_object(per_rank, {"held": held, "stages": pipeline.stages, "units": raw_units,
                                      "anyaccel names": sorted({n.split(".")[0] for n, _ in any_model.named_parameters()},
                                                               key=int)})
    steps = sum(a[3].strategy.pipeline_for(a[0]).steps for a in mine)
    for a in mine:
        a[3].end_training()
    result = {"world": job.world, "sizes": job.s, "per_rank": per_rank, "calls": calls, "anyaccel_steps": steps,
              "copies": copies, "rounds": 3 if quick else 24, "chunk": chunk,
              "first_loss": {BASE: float(first_raw.item()), "anyaccel pp": first_any},
              "model_bytes": sum(p.numel() * p.element_size() for p in build(job.s).parameters()),
              "step": step}
    result["bubbles"] = bubbles(job, quick)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= int(os.environ.get("LOCAL_WORLD_SIZE", "1")):  # one core per rank: no migrations between
        os.sched_setaffinity(0, {cores[int(os.environ.get("LOCAL_RANK", "0")) % len(cores)]})  # rounds (less noise)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    result = run(args.quick)
    if dist.get_rank() == 0:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
