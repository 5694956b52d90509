"""DeepSpeed measurements inside each worker of a 2-process torchrun job (never imported by the parent).

    python -m torch.distributed.run --nproc_per_node 2 ... benchmarks/deepspeed_worker.py --task step --stage 2 --out r.json
    ... --task memory --strategy ddp|zero1|zero2|zero3 --out r.json   (one job per strategy: peak RSS is per process)

* ``step``    step time of anyaccel's DeepSpeed strategy vs the same DeepSpeed engine driven by hand
              (``deepspeed.initialize`` with the same config, ``engine(x)``, ``engine.backward``,
              ``engine.step``), both in the same process group, rounds alternating. Each contender
              proves its steps happened: the engine's ``global_steps`` must have advanced by the
              steps timed.
* ``memory``  peak resident memory of one rank over a few training steps of a model whose
              parameters dominate (16 x Linear(1024, 1024), AdamW), DDP or ZeRO-1/2/3 through
              anyaccel, above what the process held before the model existed (the model is built
              whole in every process, as a script does without zero3_init), what stays resident
              after the steps, and the bytes of parameters and optimizer state this rank holds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
import warnings
from typing import Callable, Dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import common  # noqa: E402

WIDTH = 1024
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.*deprecated")


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def make_model(width: int = WIDTH, blocks: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(Block(width) for _ in range(blocks)))


def _batches(batch: int = 16, width: int = WIDTH):
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(batch, width, generator=g)
    while True:
        yield x


def _timed(fn: Callable[[], None]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt.item())


def make_accelerator(strategy: str):
    from anyaccel import Accelerator
    from anyaccel.utils import DeepSpeedPlugin

    if strategy.startswith("zero"):
        return Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=int(strategy[-1])))
    return Accelerator(strategy=strategy)


def anyaccel_stepper(strategy: str, acc=None, blocks: int = 16):
    acc = acc or make_accelerator(strategy)
    model = make_model(blocks=blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(64, 1)), batch_size=16)
    model, opt, _ = acc.prepare(model, opt, loader)  # a loader in the call: DeepSpeed's batch size from it
    data = _batches()

    def steps():
        while True:
            loss = model(next(data)).square().mean()
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            yield

    return steps(), acc, model, opt


def raw_stepper(config: Dict, blocks: int = 16):
    """The same engine by hand: deepspeed.initialize with the config anyaccel's engine runs."""
    import deepspeed

    model = make_model(blocks=blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    data = _batches()

    def steps():
        while True:
            loss = engine(next(data)).square().mean()
            engine.backward(loss)
            engine.step()
            yield

    return steps(), engine


def task_step(quick: bool, stage: int) -> Dict:
    blocks = 4 if quick else 16
    ours, acc, engine, _ = anyaccel_stepper(f"zero{stage}", blocks=blocks)
    raw, raw_engine = raw_stepper(dict(engine.config), blocks=blocks)
    loops = {"deepspeed.initialize by hand": (raw, raw_engine), "anyaccel deepspeed": (ours, engine)}
    chunk = 3
    counted = {name: 0 for name in loops}

    def measure(name):
        steps, eng = loops[name]

        def run():
            before = eng.global_steps
            t = _timed(lambda: [None for _ in itertools.islice(steps, chunk)]) / chunk
            counted[name] += eng.global_steps - before
            return t

        return run

    rounds = 4 if quick else 20
    res = common.interleaved({n: measure(n) for n in loops}, rounds=rounds, warmup=1,
                             baseline="deepspeed.initialize by hand")
    out = {n: {"median": r["median"], "ratio": r["ratio"], "ci": r["ratio_ci"], "steps": counted[n]}
           for n, r in res.items()}
    out["_config"] = {"stage": engine.zero_optimization_stage(), "blocks": blocks}
    return out


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def task_memory(quick: bool, strategy: str) -> Dict:
    import gc

    # DeepSpeed's and DDP's code first, for every contender alike: not what this measures.
    import deepspeed  # noqa: F401
    import deepspeed.runtime.zero.stage3  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401

    acc = make_accelerator(strategy)
    gc.collect()
    before = _rss_bytes("VmRSS:")
    steps, acc, model, opt = anyaccel_stepper(strategy, acc)
    for _ in itertools.islice(steps, 2 if quick else 4):
        pass
    peak = _rss_bytes("VmHWM:") - before
    gc.collect()
    steady = _rss_bytes("VmRSS:") - before  # what stays resident while training goes on
    module = getattr(model, "module", model)
    params = sum(getattr(p, "ds_tensor", p).numel() * p.element_size() for p in module.parameters())
    base = getattr(opt.optimizer, "optimizer", opt.optimizer)
    base = getattr(base, "optimizer", base)
    optimizer = sum(v.numel() * v.element_size() for st in base.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, {"peak": peak, "steady": steady, "params": params, "optimizer": optimizer})
    return {"per_rank": peaks, "model_bytes": sum(p.numel() * 4 for p in make_model().parameters())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", choices=("step", "memory"), required=True)
    parser.add_argument("--strategy", choices=("ddp", "zero1", "zero2", "zero3"), default="zero2")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = task_step(args.quick, args.stage) if args.task == "step" else task_memory(args.quick, args.strategy)
    if dist.get_rank() == 0:
        with open(args.out, "w") as fh:
            json.dump(result, fh)
    dist.barrier()


if __name__ == "__main__":
    main()
