"""Gradient accumulation vs one large batch, run on 2 processes (warm launcher, torchrun or anyaccel launch).

    train_accumulation.py OUT

Run A: per-process batch 4, ``gradient_accumulation_steps=5``. Run B: per-process batch 20, no
accumulation. 96 samples, 2 epochs: A has 12 micro-batches per epoch per process, grouped 5, 5
and a short last group of 2 (forced sync at the end of the loader); B has 3 batches per epoch.
Both cover the same samples per optimizer step, so the weights must agree to float rounding.

A DDP communication hook records on which micro-steps gradients were all-reduced. Rank 0 writes
OUT/result.json and the two weight sets to OUT/accum.pt and OUT/large.pt.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_common as tc  # noqa: E402

from anyaccel import Accelerator, set_seed  # noqa: E402

out = sys.argv[1]
EPOCHS = 2


def run(accum: int, batch: int):
    acc = Accelerator(gradient_accumulation_steps=accum)
    set_seed(0)
    model = tc.make_model(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    loader = DataLoader(tc.data(96), batch_size=batch, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)

    calls = {"n": 0}

    def counting_hook(state, bucket):
        calls["n"] += 1
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0] / dist.get_world_size())

    model.register_comm_hook(None, counting_hook)
    log = []  # per micro-step: (sync_gradients, all-reduce happened, optimizer stepped)
    for _ in range(EPOCHS):
        for xb, yb in loader:
            before_calls = calls["n"]
            before = [p.detach().clone() for p in model.parameters()]
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
            log.append([acc.sync_gradients, calls["n"] > before_calls, changed])
    return tc.weights(acc, model), log, sched.get_last_lr()[0], sched.last_epoch


accum_w, accum_log, accum_lr, accum_sched_steps = run(5, 4)
large_w, large_log, large_lr, large_sched_steps = run(1, 20)
diff = max((accum_w[k] - large_w[k]).abs().max().item() for k in accum_w)
if dist.get_rank() == 0:
    torch.save(accum_w, os.path.join(out, "accum.pt"))
    torch.save(large_w, os.path.join(out, "large.pt"))
    with open(os.path.join(out, "result.json"), "w") as fh:
        json.dump({"max_abs_diff": diff, "accum_log": accum_log, "large_log": large_log, "accum_lr": accum_lr,
                   "large_lr": large_lr, "accum_sched_steps": accum_sched_steps,
                   "large_sched_steps": large_sched_steps, "world": dist.get_world_size()}, fh)
dist.barrier()
