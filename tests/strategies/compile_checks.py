"""torch.compile through anyaccel, per model kind: ``python compile_checks.py OUT RUNS`` (1 process)
or under ``anyaccel launch --num_processes 2`` (DDP and FSDP2). ``RUNS`` is a comma-separated list
of ``strategy:kind:backend``: strategy ``default`` (single in one process, DDP in several),
``fsdp`` (FSDP2 over the root) or ``fsdp_blocks`` (FSDP2 over every submodule of >= 100
parameters too); kinds in ``MODELS``. For each run, rank r trains the model eager and compiled
from the same seed and writes to OUT/rank<r>.json: Dynamo's frames and graphs compiled during the
compiled run, both loss curves, the state-dict keys, whether ``unwrap_model`` gave back the user's
object, and the warnings about compiling nothing. Also imported by tests/strategies/test_compile.py for the
in-process checks."""

import json
import os
import sys
import warnings

import torch

from anyaccel import Accelerator, set_seed
from anyaccel.plugins import FullyShardedDataParallelPlugin, TorchDynamoPlugin
from anyaccel.strategies.compile import dynamo_counts


class Net(torch.nn.Module):  # a user's subclass with its own forward
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.fc2 = torch.nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Block(torch.nn.Module):  # torchvision's BasicBlock, shrunk
    def __init__(self, channels):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(channels)

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + x)


class TinyResNet(torch.nn.Module):  # the shape of torchvision.models.resnet18 (not installable here)
    def __init__(self, classes=4):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
                                        torch.nn.ReLU())
        self.layer1 = torch.nn.Sequential(Block(8), Block(8))
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.fc = torch.nn.Linear(8, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.layer1(self.stem(x))), 1))


def sequential():
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def transformer():
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


# kind -> (build the user's model, the uncompiled model it must match, the input shape of a batch)
MODELS = {
    "sequential": (sequential, sequential, (8, 8)),
    "transformer": (transformer, transformer, (4, 5, 8)),
    "subclass": (Net, Net, (8, 8)),
    "resnet": (TinyResNet, TinyResNet, (4, 3, 8, 8)),
    "user_compiled": (lambda: torch.compile(sequential(), backend="aot_eager"), sequential, (8, 8)),
}


def train(acc, model, shape, steps=4):
    """``steps`` SGD steps on fixed random batches (the same on every rank); the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(*shape, generator=g)).float().pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return model, losses


def check(strategy, kind, backend):
    """One run: the model eager, then compiled, from the same seed. Collective under DDP/FSDP2."""
    build, build_eager, shape = MODELS[kind]
    strat = {"default": {}, "fsdp": {"strategy": "fsdp"}, "fsdp_blocks": {"fsdp_plugin": FullyShardedDataParallelPlugin(
        auto_wrap_policy="size_based_wrap", min_num_params=100)}}[strategy]
    set_seed(0)
    _, eager = train(Accelerator(**strat), build_eager(), shape)
    torch._dynamo.reset()  # each run compiles from an empty cache: its own frames are counted
    set_seed(0)
    user_model = build()
    names = [n for n, _ in user_model.named_parameters()]
    expected_keys = sorted(getattr(user_model, "_orig_mod", user_model).state_dict())
    acc = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend=backend), **strat)
    before = dynamo_counts()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, compiled = train(acc, user_model, shape)
    frames, graphs = (a - b for a, b in zip(dynamo_counts(), before))
    keys = sorted(acc.get_state_dict(model))  # collective under FSDP2: every rank asks
    unwrapped = acc.unwrap_model(model)
    return {"frames": frames, "graphs": graphs, "eager": eager, "compiled": compiled,
            "keys": keys, "expected_keys": expected_keys, "names": sorted(names), "same_object": model is user_model,
            "unwrap_is_users": unwrapped is user_model, "unwrapped": type(unwrapped).__name__,
            "param_names_kept": sorted(n for n, _ in unwrapped.named_parameters()) == sorted(names),
            "warnings": [str(w.message) for w in caught if "compiled nothing" in str(w.message)],
            "strategy": type(acc._strategy).__name__}


def main(out, runs):
    results = {}
    for run in runs.split(","):
        strategy, kind, backend = run.split(":")
        results[run] = check(strategy, kind, backend)
    rank = int(os.environ.get("RANK", 0))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
