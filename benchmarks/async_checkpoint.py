"""Training stall per checkpoint: ``save_state(async_save=True)`` vs the synchronous ``save_state``,
2 CPU processes, under DDP (full states, the main process writes) and FSDP2 (every process writes
its shards through DCP). One torchrun job per strategy.

The model: an MLP of 16 x Linear(2048, 2048) (256 MiB of fp32 weights; Adam adds twice that).
After a warm-up (one save of each kind: files, page cache, the saver's group, the staging
buffers), ``ROUNDS`` rounds each take one synchronous and one asynchronous save (the order
alternating round by round), each after two training steps and followed by ``AFTER`` steps:

- **stall** of a save = how long ``save_state`` holds the training loop: its wall time on each
  process, the larger of the two (the other process waits for it at the next collective). For the
  synchronous save that is the whole write; for the asynchronous one, the staging copy.
- **wait**: after the ``AFTER`` steps, ``wait_for_checkpoint()``; its time is the part of the write
  the steps did not cover (reported; the target is about the stall).
- **overlap cost**: the ``AFTER`` steps after an asynchronous save minus the same steps after a
  synchronous one (whose write is over), per round: what the background write takes from the
  training it overlaps on this machine (the write shares the CPU with both training processes).
  On a shared machine this figure is noisy; medians over the rounds are reported.

What it proves: every save's files are listed with their sizes by the checkpoint's manifest
(``bytes_written``: their total, compared to the state's size), and the last asynchronous
checkpoint, taken while training went on, is loaded back and compared tensor by tensor with the
state at the moment of the save (``loads_back_equal``). Extra host memory: the resident-set growth
of each process across the first asynchronous save (its staging buffers stay allocated from one
save to the next), and the bytes staged.

    python -m benchmarks --only async_checkpoint [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Dict, List

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

ROUNDS, AFTER = 5, 4
STRATEGIES = ("ddp", "fsdp")


def run(quick: bool = False) -> List[dict]:
    """Rows for ``python -m benchmarks`` (one 2-process torchrun job per strategy)."""
    rows = []
    for strategy in STRATEGIES:
        args = ["--strategy", strategy] + (["--quick"] if quick else [])
        r = common.run_torchrun_json(os.path.abspath(__file__), args, timeout=1800)
        rows += _rows(strategy, r)
    return rows


def _rows(strategy: str, r: Dict) -> List[dict]:
    mib = 2**20
    label = "DDP (full state, main process writes)" if strategy == "ddp" else "FSDP2 (shards, every process writes)"
    name = (f"MLP {r['model_bytes'] / mib:.0f} MiB + Adam, {label}, x2: stall per checkpoint "
            f"({r['rounds']} rounds, median)")
    sync, stall = r["stall"]["sync"], r["stall"]["async"]
    proof = (f"{r['bytes_written'] / mib:.0f} MiB written per save (state {r['state_bytes'] / mib:.0f} MiB); "
             f"async checkpoint loads back equal: {r['loads_back_equal']}")
    return [
        common.row("async_checkpoint", name, "sync save_state", sync * 1e3, "ms", note=proof),
        common.row("async_checkpoint", name, "save_state(async_save=True)", stall * 1e3, "ms",
                   ratio=stall / sync if sync > 0 else None, baseline="sync", target="<= 0.10",
                   note=(f"extra host memory {r['extra_rss_bytes'] / mib:.0f} MiB RSS on the process that stages most "
                         f"({r['staged_bytes'] / mib:.0f} MiB staged); write not covered by {AFTER} steps "
                         f"{r['wait']['async'] * 1e3:.0f} ms; overlap cost {r['overlap_cost'] * 1e3:.0f} ms "
                         f"(noisy: steps {r['step'] * 1e3:.0f} ms median)")),
    ]


# ---- the worker (under torchrun) -------------------------------------------------------------------


def _local(t):
    """The part of a tensor this process holds (a DTensor's shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _state_tensors(acc, model, opt) -> Dict[str, "torch.Tensor"]:  # noqa: F821
    """Copies of this process's model and optimizer tensors, flat."""
    import torch

    out = {f"model.{k}": _local(v).detach().clone() for k, v in model.state_dict().items()}
    for pid, s in opt.optimizer.state_dict()["state"].items():
        for k, v in s.items():
            if torch.is_tensor(v):
                out[f"opt.{pid}.{k}"] = _local(v).detach().clone()
    return out


def _worker(strategy: str, quick: bool, out: str) -> None:
    import psutil
    import torch
    import torch.distributed as dist

    from anyaccel import Accelerator, ProjectConfiguration

    width, layers = (512, 4) if quick else (2048, 16)
    rounds = 1 if quick else ROUNDS
    root = os.path.join(tempfile.gettempdir(),
                        f"anyaccel-bench-async-{strategy}-{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}")
    acc = Accelerator(cpu=True, strategy=strategy,
                      project_config=ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True,
                                                          total_limit=2))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(4, width)
    proc = psutil.Process()

    def step():
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def save(mode: str) -> Dict[str, float]:
        step()
        step()
        acc.wait_for_everyone()
        t0 = time.perf_counter()
        directory = acc.save_state(async_save=(mode == "async"))
        held = time.perf_counter() - t0
        t1 = time.perf_counter()
        for _ in range(AFTER):
            step()
        steps = time.perf_counter() - t1
        t2 = time.perf_counter()
        acc.wait_for_checkpoint()
        waited = time.perf_counter() - t2
        return {"stall": slowest(held), "steps": slowest(steps), "wait": slowest(waited), "dir": directory}

    step()  # Adam's state exists from here on
    local_bytes = sum(v.numel() * v.element_size() for v in _state_tensors(acc, model, opt).values())
    save("sync")  # warm-up: files, page cache
    rss0 = proc.memory_info().rss
    save("async")  # the saver's group and staging buffers
    extra_rss = slowest(float(proc.memory_info().rss - rss0))
    samples: Dict[str, List[Dict[str, float]]] = {"sync": [], "async": []}
    t_steps = time.perf_counter()
    for _ in range(AFTER):
        step()
    step_time = slowest((time.perf_counter() - t_steps) / AFTER)
    for r in range(rounds):
        for mode in (("sync", "async") if r % 2 == 0 else ("async", "sync")):
            samples[mode].append(save(mode))

    # proof: the last asynchronous checkpoint holds the state of its step, written in full
    step()
    expected = _state_tensors(acc, model, opt)
    directory = acc.save_state(async_save=True)
    step()  # training changes the live state while the write goes on
    acc.wait_for_checkpoint()
    with open(os.path.join(directory, "anyaccel_checkpoint.json")) as fh:
        bytes_written = sum(json.load(fh)["files"].values())
    acc.load_state(directory)
    loaded = _state_tensors(acc, model, opt)
    equal = torch.tensor([int(loaded.keys() == expected.keys()
                              and all(torch.equal(loaded[k], expected[k]) for k in expected))])
    dist.all_reduce(equal, op=dist.ReduceOp.MIN)
    staged = torch.tensor([local_bytes if (strategy != "ddp" or acc.is_main_process) else 0])
    dist.all_reduce(staged, op=dist.ReduceOp.MAX)
    model_bytes = sum(p.numel() * p.element_size() for p in acc.unwrap_model(model).parameters())  # DTensor: global
    state_bytes = local_bytes * (1 if strategy == "ddp" else acc.num_processes)
    if acc.is_main_process:
        med = {m: {k: common.median(s[k] for s in samples[m]) for k in ("stall", "steps", "wait")} for m in samples}
        result = {"strategy": strategy, "rounds": rounds, "world": acc.num_processes,
                  "stall": {m: med[m]["stall"] for m in med}, "wait": {m: med[m]["wait"] for m in med},
                  "overlap_cost": common.median(a["steps"] - s["steps"] for a, s in zip(samples["async"], samples["sync"])),
                  "step": step_time, "samples": samples, "extra_rss_bytes": extra_rss, "staged_bytes": int(staged),
                  "model_bytes": model_bytes, "state_bytes": state_bytes, "bytes_written": bytes_written,
                  "loads_back_equal": bool(int(equal)), "load_average": os.getloadavg()}
        with open(out, "w") as fh:
            json.dump(result, fh)
    acc.end_training()
    if acc.is_main_process:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    _worker(args.strategy, args.quick, args.out)
