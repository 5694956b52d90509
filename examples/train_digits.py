"""The smallest complete anyaccel program: an MLP on scikit-learn's bundled digits.

Run it on 2 CPU processes (a few seconds; reaches about 95 % test accuracy)::

    anyaccel launch --num_processes 2 --cpu examples/train_digits.py
    python -m torch.distributed.run --nproc_per_node 2 examples/train_digits.py   # same thing
    python examples/train_digits.py                                              # one process

What changes compared with a plain single-process PyTorch script::

    # before                                   # after
                                               accelerator = Accelerator()
                                               model, optimizer, train_loader, test_loader = \\
                                                   accelerator.prepare(model, optimizer, train_loader, test_loader)
    loss.backward()                            accelerator.backward(loss)
    preds, y = preds, y                        preds, y = accelerator.gather_for_metrics((preds, y))
    print(...)                                 accelerator.print(...)   # once, not once per process

Each process trains on its own half of every epoch; ``gather_for_metrics`` collects the
predictions of all processes so the accuracy is over the whole test set, each sample once.
"""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from anyaccel import Accelerator, set_seed


def digits_datasets():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))  # same split on every rank
    train, test = order[:1437], order[1437:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=32, help="per-process batch size")
    parser.add_argument("--lr", type=float, default=5e-3)
    args = parser.parse_args()

    accelerator = Accelerator()
    set_seed(0)  # same initial weights everywhere (prepare() also broadcasts rank 0's)
    accelerator.print(f"{accelerator.num_processes} process(es) on {accelerator.device}")

    train_set, test_set = digits_datasets()
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=64)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)

    start = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()

        model.eval()
        correct = total = 0
        for x, y in test_loader:
            with torch.no_grad():
                preds = model(x).argmax(dim=-1)
            preds, y = accelerator.gather_for_metrics((preds, y))
            correct += (preds == y).sum().item()
            total += y.numel()
        accelerator.print(f"epoch {epoch}: test accuracy {correct / total:.4f} ({total} samples), "
                          f"last loss {loss.item():.4f}")

    accelerator.print(f"final test accuracy {correct / total:.4f} in {time.perf_counter() - start:.1f} s")
    accelerator.end_training()


if __name__ == "__main__":
    main()
