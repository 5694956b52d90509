"""The training workloads the benchmarks time, and one set-up function per contender.

Every contender runs the *same* loop -- DataLoader iteration, forward, loss, backward,
optimizer step, zero_grad -- on an identically initialised model and identical data; only the
framework calls differ:

* ``raw``        plain PyTorch (``DistributedDataParallel`` + ``DistributedSampler`` when distributed)
* ``anyaccel``   ``Accelerator()`` + ``prepare`` + ``accelerator.backward``
* ``accelerate`` Hugging Face Accelerate, same three calls (when installed)
* ``fabric``     Lightning Fabric: ``setup`` + ``setup_dataloaders`` + ``fabric.backward`` (when installed)

Each ``setup_*`` returns ``run_epoch() -> steps``; :func:`stepper` turns it into an endless
generator that yields after every step, so a caller can time any number of steps (crossing
epoch boundaries, epoch start-up costs included in proportion) and interleave contenders finely.
"""

from __future__ import annotations

import copy
from typing import Callable, Dict

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["SIZES", "make_model", "make_dataset", "SETUPS", "stepper", "run_epoch"]


def stepper(epoch_fn):
    """Endless generator over the steps of consecutive epochs of ``epoch_fn`` (a setup's result)."""
    while True:
        yield from epoch_fn()


def run_epoch(epoch_fn) -> int:
    """Run one whole epoch; return its number of steps."""
    n = 0
    for n in epoch_fn():
        pass
    return n

# 64-wide MLP like the ANCHORS measurement; a medium MLP where compute dominates.
SIZES: Dict[str, dict] = {
    "tiny": dict(inp=32, hidden=64, depth=2, out=10, batch=64, n=64 * 128),
    "medium": dict(inp=256, hidden=512, depth=2, out=10, batch=64, n=64 * 64),
}


def make_model(size: str, seed: int = 0) -> torch.nn.Module:
    s = SIZES[size]
    torch.manual_seed(seed)
    layers = []
    width = s["inp"]
    for _ in range(s["depth"]):
        layers += [torch.nn.Linear(width, s["hidden"]), torch.nn.ReLU()]
        width = s["hidden"]
    layers.append(torch.nn.Linear(width, s["out"]))
    return torch.nn.Sequential(*layers)


def make_dataset(size: str, seed: int = 1) -> TensorDataset:
    s = SIZES[size]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s["n"], s["inp"], generator=g)
    y = torch.randint(0, s["out"], (s["n"],), generator=g)
    return TensorDataset(x, y)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def setup_raw(size: str, distributed: bool = False, model: torch.nn.Module = None) -> Callable[[], int]:
    model = copy.deepcopy(model) if model is not None else make_model(size)
    ds = make_dataset(size)
    batch = SIZES[size]["batch"]
    sampler = None
    if distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data.distributed import DistributedSampler

        sampler = DistributedSampler(ds, shuffle=True, seed=0)
        model = DDP(model)
        loader = DataLoader(ds, batch_size=batch, sampler=sampler)
    else:
        loader = DataLoader(ds, batch_size=batch, shuffle=True)
    opt = _optimizer(model)
    epoch = [0]

    def run_epoch():
        if sampler is not None:
            sampler.set_epoch(epoch[0])
        epoch[0] += 1
        steps = 0
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            steps += 1
            yield steps

    return run_epoch


def setup_anyaccel(size: str, distributed: bool = False, model: torch.nn.Module = None) -> Callable[[], int]:
    from anyaccel import Accelerator

    accelerator = Accelerator()
    model = copy.deepcopy(model) if model is not None else make_model(size)
    loader = DataLoader(make_dataset(size), batch_size=SIZES[size]["batch"], shuffle=True)
    model, opt, loader = accelerator.prepare(model, _optimizer(model), loader)
    backward = accelerator.backward

    def run_epoch():
        steps = 0
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            backward(loss)
            opt.step()
            opt.zero_grad()
            steps += 1
            yield steps

    return run_epoch


def setup_accelerate(size: str, distributed: bool = False, model: torch.nn.Module = None) -> Callable[[], int]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = copy.deepcopy(model) if model is not None else make_model(size)
    loader = DataLoader(make_dataset(size), batch_size=SIZES[size]["batch"], shuffle=True)
    model, opt, loader = accelerator.prepare(model, _optimizer(model), loader)
    if distributed and accelerator.num_processes < 2:
        raise RuntimeError(f"Accelerate saw {accelerator.num_processes} process(es), not a 2-process job")
    backward = accelerator.backward
    epoch = [0]

    def run_epoch():
        loader.set_epoch(epoch[0])
        epoch[0] += 1
        steps = 0
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            backward(loss)
            opt.step()
            opt.zero_grad()
            steps += 1
            yield steps

    return run_epoch


def setup_fabric(size: str, distributed: bool = False, model: torch.nn.Module = None) -> Callable[[], int]:
    from lightning.fabric import Fabric

    if distributed:
        fabric = Fabric(accelerator="cpu", devices=torch.distributed.get_world_size(), strategy="ddp")
    else:
        fabric = Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    model = copy.deepcopy(model) if model is not None else make_model(size)
    opt = _optimizer(model)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(DataLoader(make_dataset(size), batch_size=SIZES[size]["batch"], shuffle=True))
    backward = fabric.backward
    sampler = getattr(loader, "sampler", None)
    epoch = [0]

    def run_epoch():
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch[0])
        epoch[0] += 1
        steps = 0
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            backward(loss)
            opt.step()
            opt.zero_grad()
            steps += 1
            yield steps

    return run_epoch


SETUPS = {
    "raw": setup_raw,
    "anyaccel": setup_anyaccel,
    "accelerate": setup_accelerate,
    "fabric": setup_fabric,
}
PEER_MODULES = {"accelerate": "accelerate", "fabric": "lightning.fabric"}
