"""Worker script for the launcher tests: train a small model with the public API and write what
this rank saw to OUT/rank{R}.json.

Usage: launch_train.py --out DIR [--batch B] [--epochs E] [anything else, recorded untouched]
With 2 processes × batch B the final weights equal 1 process × batch 2B (DDP equivalence).
"""

import argparse
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from anyaccel import Accelerator, set_seed

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--epochs", type=int, default=2)
args, _unknown = parser.parse_known_args()

acc = Accelerator()
set_seed(0)
n = 64
x = torch.randn(n, 8)
y = (x @ torch.randn(8, 1)).squeeze(1) + 0.1 * torch.randn(n)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
train = DataLoader(TensorDataset(torch.arange(n), x, y), batch_size=args.batch, shuffle=True)
evaluation = DataLoader(TensorDataset(torch.arange(37)), batch_size=4)
model, opt, train, evaluation = acc.prepare(model, opt, train, evaluation)

seen = []
for epoch in range(args.epochs):
    train.set_epoch(epoch)
    for idx, xb, yb in train:
        if epoch == 0:
            seen += idx.tolist()
        loss = torch.nn.functional.mse_loss(model(xb).squeeze(1), yb)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()

gathered = []
for (idx,) in evaluation:
    gathered += acc.gather_for_metrics(idx).tolist()

state = acc.unwrap_model(model).state_dict()
result = {
    "rank": acc.process_index,
    "world": acc.num_processes,
    "local_rank": acc.local_process_index,
    "node_rank": acc.environment.node_rank,
    "master_addr": os.environ.get("MASTER_ADDR"),
    "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
    "source": acc.environment.source,
    "distributed_type": str(acc.distributed_type),
    "device": str(acc.device),
    "mixed_precision": acc.mixed_precision,
    "pid": os.getpid(),
    "ppid": os.getppid(),
    "argv": sys.argv[1:],
    "seen": seen,
    "gathered": gathered,
    "weights": {k: v.flatten().tolist() for k, v in state.items()},
    "env": {k: v for k, v in os.environ.items() if k.startswith("ANYACCEL_") and k not in ("ANYACCEL_AGENT_PID", "ANYACCEL_FAILURE_DIR")},
    "omp": os.environ.get("OMP_NUM_THREADS"),
}
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"rank{acc.process_index}.json"), "w") as f:
    json.dump(result, f)
acc.end_training()
