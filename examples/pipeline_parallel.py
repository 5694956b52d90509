"""Pipeline parallelism: an ``nn.Sequential`` cut into stages over 2 processes, on scikit-learn's digits.

Run it on 2 CPU processes (about half a minute; reaches about 95 % test accuracy)::

    anyaccel launch --num_processes 2 --cpu examples/pipeline_parallel.py
    anyaccel launch --num_processes 2 --cpu examples/pipeline_parallel.py --schedule Interleaved1F1B  # 2 stages per rank
    python examples/pipeline_parallel.py --pp 1                                # one process, same script

``ParallelismConfig(pp_size=2)`` cuts the model at its children into two stages, one per process
(parameter names kept), and trains it through a schedule of micro-batches. No process holds the
whole model, so ``model(x)`` cannot run: the forward, the loss and the backward are one call, and
the loss comes back on every rank::

    # before (one process)                     # after (pipeline stages)
                                               accelerator = Accelerator(parallelism_config=ParallelismConfig(pp_size=2))
                                               model, optimizer, train_loader, test_loader = \\
                                                   accelerator.prepare(model, optimizer, train_loader, test_loader)
    loss = criterion(model(x), y)              loss = accelerator.pipeline_step(model, x, y, criterion)
    loss.backward()                            # (forward and backward of every micro-batch, in the schedule)
    optimizer.step()                           optimizer.step()
    with torch.no_grad():                      with torch.no_grad():
        logits = model(x)                          _, logits = accelerator.pipeline_step(model, x, return_outputs=True)

Both processes read the same batches (they are one pipeline, not two data-parallel replicas);
each batch is cut into ``--microbatches`` micro-batches, so its size must divide by that
(``drop_last=True`` on the training loader). ``save_model`` gathers every stage into one
safetensors file that the plain model loads.
"""

import argparse
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from anyaccel import Accelerator, ParallelismConfig, set_seed


def digits_datasets():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))  # same split on every rank
    train, test = order[:1437], order[1437:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def build_model(width=128, depth=4):
    """64 pixels -> ``depth`` hidden layers -> 10 classes; each Linear (with its ReLU) is a block."""
    layers = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2, help="pipeline-parallel processes")
    parser.add_argument("--schedule", default="1F1B", help="GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble, ...")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--output_dir", default="outputs")
    args = parser.parse_args()

    config = ParallelismConfig(pp_size=args.pp, pp_schedule=args.schedule, pp_microbatches=args.microbatches)
    accelerator = Accelerator(parallelism_config=config)
    set_seed(0)
    train_set, test_set = digits_datasets()
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=40)  # 360 test images: 9 batches of 40
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    criterion = nn.CrossEntropyLoss()
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)

    pipeline = accelerator.strategy.pipeline_for(model)
    if pipeline is not None:  # what this process holds: its stages, under the original names
        names = sorted({n.split(".")[0] for n, _ in model.named_parameters()}, key=int)
        print(f"process {accelerator.process_index} holds stage(s) {pipeline.stages} of {pipeline.num_stages}: "
              f"layers {', '.join(names)} ({sum(p.numel() for p in model.parameters()):,} parameters)", flush=True)

    for epoch in range(args.epochs):
        start = time.perf_counter()
        model.train()
        for x, y in train_loader:
            loss = accelerator.pipeline_step(model, x, y, criterion)
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        correct = total = 0
        for x, y in test_loader:
            with torch.no_grad():  # forward only; the last stage's outputs reach every rank
                _, logits = accelerator.pipeline_step(model, x, return_outputs=True)
            preds, labels = accelerator.gather_for_metrics((logits.argmax(dim=1), y))
            correct += (preds == labels).sum().item()
            total += labels.numel()
        accelerator.print(f"epoch {epoch}: loss {loss.item():.4f}, test accuracy {correct / total:.4f} "
                          f"({total} images), {time.perf_counter() - start:.1f} s")

    accelerator.save_model(model, os.path.join(args.output_dir, "model"))  # every rank: stages are gathered
    accelerator.print(f"saved {os.path.join(args.output_dir, 'model', 'model.safetensors')}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
