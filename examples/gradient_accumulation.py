"""Gradient accumulation: a large effective batch from small micro-batches, with the right LR schedule.

With ``gradient_accumulation_steps=k`` and ``with accelerator.accumulate(model):`` around each
micro-batch, gradients add up locally for ``k-1`` micro-batches (DDP skips its all-reduce there)
and the optimizer steps on the ``k``-th and on the last batch of the epoch. The prepared
optimizer's ``step``/``zero_grad`` and the prepared scheduler's ``step`` do nothing on the other
micro-batches, so the loop body stays the plain PyTorch one, and the LR schedule advances once
per real optimizer step — ``OneCycleLR`` below is built for exactly that many steps and would
raise if stepped more often::

    # before (manual accumulation with DDP)               # after
    ctx = model.no_sync() if (i + 1) % k else nullcontext()  accelerator = Accelerator(gradient_accumulation_steps=k)
    with ctx:                                             with accelerator.accumulate(model):
        loss = criterion(model(x), y) / k                     loss = criterion(model(x), y)
        loss.backward()                                       accelerator.backward(loss)   # divides by k
    if (i + 1) % k == 0 or i + 1 == len(loader):              optimizer.step()             # only when synced
        optimizer.step()                                      scheduler.step()             # once per real step
        scheduler.step()                                      optimizer.zero_grad()
        optimizer.zero_grad()

Effective batch = per-process batch x processes x k. ``accelerator.sync_gradients`` says
whether this micro-batch was a real optimizer step (use it for logging or clipping once per step).

    python -m torch.distributed.run --nproc_per_node 2 examples/gradient_accumulation.py --gradient_accumulation_steps 4
"""

import argparse
import math
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SmallCNN, add_common_args, image_datasets  # noqa: E402

from anyaccel import Accelerator, set_seed  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, epochs=3, batch_size=8, lr=0.05)  # here --max_steps counts optimizer steps
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              mixed_precision=args.mixed_precision)
    set_seed(args.seed)
    k = accelerator.gradient_accumulation_steps
    accelerator.print(f"{accelerator.num_processes} process(es) x micro-batch {args.batch_size} x {k} "
                      f"accumulation steps = effective batch {accelerator.num_processes * args.batch_size * k}")

    train_set, test_set, num_classes = image_datasets("cifar10", args.data, 16, 3, print_fn=accelerator.print,
                                                      limit=args.limit)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=64)
    model = SmallCNN(3, num_classes, width=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()

    # The loader must be prepared before sizing the schedule: len() is then per process.
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)
    steps_per_epoch = math.ceil(len(train_loader) / k)  # the last batch of an epoch always steps
    if args.max_steps is not None:
        steps_per_epoch = min(steps_per_epoch, args.max_steps)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr,
                                                    total_steps=args.epochs * steps_per_epoch)
    scheduler = accelerator.prepare(scheduler)

    for epoch in range(args.epochs):
        model.train()
        optimizer_steps = micro_batches = 0
        for x, y in train_loader:
            with accelerator.accumulate(model):
                loss = criterion(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            micro_batches += 1
            optimizer_steps += int(accelerator.sync_gradients)
            if optimizer_steps == steps_per_epoch:  # only differs from the loader's end with --max_steps
                break

        model.eval()
        correct = total = 0
        for x, y in test_loader:
            with torch.no_grad():
                pred = model(x).argmax(dim=1)
            pred, y = accelerator.gather_for_metrics((pred, y))
            correct += (pred == y).sum().item()
            total += y.numel()
        accelerator.print(f"epoch {epoch}: {optimizer_steps} optimizer steps for {micro_batches} micro-batches, "
                          f"lr {scheduler.get_last_lr()[0]:.5f}, loss {loss.item():.4f}, "
                          f"test accuracy {correct / total:.4f}")

    accelerator.print(f"scheduler stepped {scheduler.last_epoch} times for {args.epochs * steps_per_epoch} "
                      "planned optimizer steps")
    accelerator.end_training()


if __name__ == "__main__":
    main()
