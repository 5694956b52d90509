"""Training stall per checkpoint: ``save_state(async_save=True)`` vs the synchronous ``save_state``
(and a raw ``torch.save`` of the same state on rank 0 + barrier), 2 CPU processes under DDP.

The worker (this file under torchrun) trains an MLP of a few hundred MB (Adam: 3x that in state)
for ``STEPS`` steps per round in four modes, rotating the order every round: no checkpoint, raw,
sync and async saves after steps 2 and 6. A mode's stall per checkpoint is
``(its round time - the no-checkpoint round time) / checkpoints``, so it includes what the
background write costs the training steps it overlaps (on a 2-core machine they share the CPU),
and the asynchronous round ends with ``wait_for_checkpoint()`` inside the timed window (a write
that outlasts the round is counted). Also reported: the time ``save_state`` blocks the training
thread, and the extra host memory on rank 0 (resident set grown by the staging copy).

    python -m benchmarks --only async_checkpoint
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import List

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

SAVE_AFTER = (2, 6)


def run(quick: bool = False) -> List[dict]:
    """Rows for ``python -m benchmarks`` (runs the 2-process worker once)."""
    r = common.run_torchrun_json(os.path.abspath(__file__), ["--quick"] if quick else [], timeout=1800)
    mb = r["model_mb"]
    name = f"MLP {mb:.0f} MB (+Adam {r['state_mb'] - mb:.0f} MB), DDP x2, stall per checkpoint"
    sync = r["stall"]["sync"]
    rows = [common.row("async_checkpoint", name, "sync", sync, "s",
                       note=f"save_state blocks {r['blocking']['sync']:.2f} s"),
            common.row("async_checkpoint", name, "raw torch.save", r["stall"]["raw"], "s",
                       ratio=r["stall"]["raw"] / sync if sync > 0 else None, baseline="sync",
                       note="rank 0 torch.save(model+optimizer state) + barrier"),
            common.row("async_checkpoint", name, "async", r["stall"]["async"], "s",
                       ratio=r["stall"]["async"] / sync if sync > 0 else None, baseline="sync", target="<= 0.10",
                       note=f"save_state blocks {r['blocking']['async']:.2f} s; extra host memory on rank 0 "
                            f"{r['extra_rss_mb']:.0f} MB (staged state {r['state_mb']:.0f} MB)")]
    return rows


# ---- the worker (under torchrun) -------------------------------------------------------------------


def _worker(quick: bool, out: str) -> None:
    import psutil
    import torch
    import torch.distributed as dist

    from anyaccel import Accelerator, ProjectConfiguration

    width, layers = (512, 4) if quick else (2048, 12)
    rounds = 1 if quick else 2
    steps = 10
    # one directory for the job (torchrun gives every rank the same run id)
    root = os.path.join(tempfile.gettempdir(), f"anyaccel-bench-ckpt-{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}")
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True,
                                                                    total_limit=1))
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

    step()  # Adam state exists from here on
    blocking = {"sync": [], "async": [], "raw": []}
    extra_rss = [0.0]

    def raw_save(path):
        if acc.is_main_process:
            torch.save({"model": acc.unwrap_model(model).state_dict(), "opt": opt.state_dict()}, path)
            with open(path, "rb+") as fh:
                os.fsync(fh.fileno())
        acc.wait_for_everyone()

    def one_round(mode: str) -> float:
        acc.wait_for_everyone()
        start = time.perf_counter()
        for i in range(1, steps + 1):
            step()
            if mode != "none" and i in SAVE_AFTER:
                t0, rss0 = time.perf_counter(), proc.memory_info().rss
                if mode == "raw":
                    raw_save(os.path.join(root, "raw.pt"))
                else:
                    acc.save_state(async_save=(mode == "async"))
                blocking[mode].append(time.perf_counter() - t0)
                if mode == "async":
                    extra_rss[0] = max(extra_rss[0], (proc.memory_info().rss - rss0) / 2**20)
        acc.wait_for_checkpoint()
        acc.wait_for_everyone()
        return time.perf_counter() - start

    modes = ["none", "raw", "sync", "async"]
    times = {m: [] for m in modes}
    one_round("sync")  # warm-up: files, page cache, the saver's group
    one_round("async")
    for r in range(rounds):
        order = modes[r % 4:] + modes[:r % 4]
        for m in order:
            times[m].append(one_round(m))
    state_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    opt_bytes = sum(v.numel() * v.element_size() for s in opt.state_dict()["state"].values()
                    for v in s.values() if torch.is_tensor(v))
    if acc.is_main_process:
        # per round, paired with the no-checkpoint round of the same round (drifts of a shared box cancel)
        stall = {m: common.median([(t - n) / len(SAVE_AFTER) for t, n in zip(times[m], times["none"])])
                 for m in ("raw", "sync", "async")}
        result = {"stall": stall, "blocking": {m: common.median(v) for m, v in blocking.items() if v},
                  "times": times, "model_mb": state_bytes / 2**20, "state_mb": (state_bytes + opt_bytes) / 2**20,
                  "extra_rss_mb": extra_rss[0], "world": dist.get_world_size()}
        with open(out, "w") as fh:
            json.dump(result, fh)
        shutil.rmtree(root, ignore_errors=True)
    acc.end_training()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    _worker(args.quick, args.out)
