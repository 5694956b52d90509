"""Train a DDP model a few steps, run a collective, and simply end: no end_training, no destroy.

The prepared model is still referenced at exit (its DDP reducer holds the process group), which
is the case where gloo used to abort at interpreter shutdown."""
import torch
from anyaccel import Accelerator

acc = Accelerator()
net = torch.nn.Linear(8, 2)
model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
for _ in range(5):
    acc.backward(model(torch.randn(4, 8)).sum())
print("sum", acc.reduce(torch.ones(1)).item())
