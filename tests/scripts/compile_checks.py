"""torch.compile through anyaccel: ``python compile_checks.py OUT`` (1 process) or under
``anyaccel launch --num_processes 2`` (DDP and FSDP2). Rank r writes OUT/rank<r>.json."""

import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from anyaccel import Accelerator, set_seed
from anyaccel.plugins import TorchDynamoPlugin

out = sys.argv[1]


class Net(torch.nn.Module):  # a user's module (torch's own modules are not traced as user code)
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.fc2 = torch.nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def run(acc, wrap=None, steps=6):
    set_seed(0)
    model = Net() if wrap is None else wrap(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    model, opt, loader = acc.prepare(model, opt, loader)
    losses = []
    for i, (xb, yb) in enumerate(loader):
        if i == steps:
            break
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return model, losses


def graphs():
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


res = {}
eager_acc = Accelerator()
r, world = eager_acc.process_index, eager_acc.num_processes
_, res["eager"] = run(eager_acc)

before = graphs()
acc = Accelerator(dynamo_backend="inductor")
model, res["compiled"] = run(acc)
res["graphs_compiled"] = graphs() - before
res["keys"] = sorted(acc.get_state_dict(model))
res["unwrapped_is_module"] = type(acc.unwrap_model(model)).__name__
acc.save_state(os.path.join(out, "ckpt"))
res["checkpoint_files"] = sorted(f for f in os.listdir(os.path.join(out, "ckpt")) if f.startswith("model")) if r == 0 else None

if world == 1:
    # A model the user compiled before prepare: trained compiled, saved without `_orig_mod.`.
    user = Accelerator()
    model, res["user_compiled"] = run(user, torch.compile)
    res["user_keys"] = sorted(user.get_state_dict(model))
    res["user_unwrap"] = [type(user.unwrap_model(model)).__name__,
                          type(user.unwrap_model(model, keep_torch_compile=False)).__name__]
else:
    before = graphs()
    fsdp = Accelerator(strategy="fsdp", dynamo_plugin=TorchDynamoPlugin(backend="inductor"))
    model, res["fsdp_compiled"] = run(fsdp)
    res["fsdp_graphs"] = graphs() - before
    res["fsdp_keys"] = sorted(fsdp.get_state_dict(model))  # collective under FSDP: every rank asks

with open(os.path.join(out, f"rank{r}.json"), "w") as fh:
    json.dump(res, fh)
