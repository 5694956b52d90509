"""Per-step fault tolerance: training that goes on when a replica group dies, FSDP2 inside each group.

The usual loop; fault tolerance adds one line, ``start = accelerator.resume()`` before it (a
restarted group heals there from a live one: weights, optimizer, schedule, loader position, RNG),
and asks for ``accelerator.backward(loss)`` (the gradients are averaged over the live groups
there)::

    # before (plain FSDP2, a lost process ends the job)     # after
    model, opt, loader = accelerator.prepare(...)           model, opt, loader = accelerator.prepare(...)
                                                            start = accelerator.resume()   # heals a restarted group
    for epoch in range(epochs):                             for epoch in range(start.epoch, epochs):
        for x, y in loader:                                     for x, y in loader:
            loss = criterion(model(x), y)                           loss = criterion(model(x), y)
            accelerator.backward(loss)                              accelerator.backward(loss)
            opt.step()                                              opt.step()    # skipped if not committed
            opt.zero_grad()                                         opt.zero_grad()

Two replica groups of two processes on one machine (torchft manages the replica dimension, FSDP2
shards within each group; kill a group's processes and watch the other go on)::

    anyaccel launch --cpu --fault_tolerance on --num_processes 4 --max_restarts 2 \\
        --parallelism_config_dp_replicate_size 2 --parallelism_config_dp_shard_size 2 examples/fault_tolerance.py

One SLURM job step per group: ``examples/slurm/fault_tolerance.sbatch``. Guide:
docs/guides/fault-tolerance.md.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from anyaccel import Accelerator, set_seed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=16, help="per process")
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()

    set_seed(0)  # the same seed in every group: the same initial weights and one shuffle order for all
    accelerator = Accelerator()
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(4096, 64, generator=g)
    data = TensorDataset(x, (x @ torch.randn(64, 8, generator=g)).argmax(dim=1))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    model = nn.Sequential(nn.Linear(64, args.width), nn.GELU(), nn.Linear(args.width, args.width), nn.GELU(),
                          nn.Linear(args.width, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    start = accelerator.resume()  # a restarted group heals here from a live one and continues where it is
    if start.checkpoint:
        accelerator.print(f"continuing at epoch {start.epoch}, step {start.step}, from {start.checkpoint}")
    for epoch in range(start.epoch, args.epochs):
        total, count = torch.zeros(()), 0
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(model(xb), yb)
            accelerator.backward(loss)  # averaged over the replica groups of this step
            optimizer.step()  # skipped (optimizer.step_was_skipped) when the groups did not commit the step
            optimizer.zero_grad()
            total, count = total + loss.detach(), count + 1
        accelerator.print(f"epoch {epoch}: loss {float(total) / max(count, 1):.4f}")  # each group prints its own
    accelerator.end_training()


if __name__ == "__main__":
    main()
