"""Train a small model for a few steps and save the final weights (rank 0).

Run with 1 process and batch 2b, and with 2 processes and batch b: the weights must match.
Usage: ddp_equivalence.py OUT.pt PER_PROCESS_BATCH (or main(out, batch) from another job's script:
tests/accelerator/core_checks.py runs it last, in its 2-process job, with its own Accelerator).
"""

import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from anyaccel import Accelerator, set_seed

def main(out, batch):
    acc = Accelerator()
    set_seed(0)
    x = torch.randn(64, 8)
    y = (x @ torch.randn(8, 1)).squeeze(1) + 0.1 * torch.randn(64)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    for epoch in range(3):
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb).squeeze(1), yb)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
    acc.wait_for_everyone()
    acc.save(acc.unwrap_model(model).state_dict(), out)
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
