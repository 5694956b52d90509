"""One job of the soak test (tests/soak/soak.py): the canonical shapes of a user's script, each
written as users write them (everything inside ``main()``, ``end_training()`` last, then ``main()``
returns and the interpreter exits), small enough that the run is mostly start-up and exit — where
the bugs it hunts live.

    anyaccel launch --num_processes 2 --cpu soak_job.py SHAPE WORKDIR   # ddp, fsdp, workers, twice
    anyaccel launch --num_processes 4 --cpu soak_job.py tpfsdp WORKDIR     # 2 x 2 mesh
    anyaccel launch --num_processes 2 --cpu soak_job.py canonical WORKDIR  # what make test soaks
    python soak_job.py notebook WORKDIR                                   # notebook_launcher, 2 processes
    anyaccel launch --fault_tolerance on --max_restarts 1 --num_processes 2 --cpu soak_job.py ftkill WORKDIR

Shapes: ``ddp`` (Sequential with dropout, AdamW, StepLR, ``project_dir`` + ``resume()``, a
checkpoint, metrics gathered), ``fsdp`` (the same under FSDP2), ``tpfsdp`` (tensor parallel x
FSDP2 on 4 processes), ``workers`` (DDP with ``DataLoader(num_workers=2)`` over 4 epochs: a
forked worker per epoch while the rank's threads run), ``twice`` (``end_training()``, then a
second ``Accelerator`` that trains again in the same process), ``notebook`` (``notebook_launcher``
forks 2 workers from this process; each creates its Accelerator inside the function), and
``canonical`` (``fsdp``, ``tpfsdp``, ``workers``, ``twice`` and ``ddp`` in one job of 2 processes:
what ``make test`` soaks, because every fresh process costs seconds of CPU in imports alone; its
tensor-parallel fold is TP over both processes, a 1 x 2 mesh, while ``make soak``'s ``tpfsdp``
keeps the 2 x 2 one), and ``ftkill`` (per-step fault tolerance: 2 replica groups, one SIGKILLed
mid-epoch, restarted, healed from the other, both ending with bitwise equal weights; needs torchft,
the ``ft`` extra).

Every rank prints ``soak-ok SHAPE rank R`` when ``main()`` is about to return; the soak runner
counts those lines, the exit status, the wall time and the processes left behind.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))  # tiny_models


def _data(n: int = 48, features: int = 6) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, features, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


class _Noisy(Dataset):
    """A map-style dataset whose items draw from torch's RNG in the worker (as augmentations do)."""

    def __init__(self, n: int = 32):
        self.x = torch.randn(n, 6, generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i] + 0.01 * torch.randn(6)
        return x, x.sum(0, keepdim=True)


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))


def _train(acc, loader, model, opt, sched=None, epochs: int = 2) -> float:
    last = 0.0
    for _ in range(epochs):
        model.train()
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            acc.backward(loss)
            opt.step()
            if sched is not None:
                sched.step()
            opt.zero_grad()
            last = float(acc.gather_for_metrics(loss.detach()[None]).mean())
    return last


def _ok(shape: str, acc) -> None:
    print(f"soak-ok {shape} rank {acc.process_index}", flush=True)


def ddp(workdir: str, strategy=None, shape: str = "ddp") -> None:
    from anyaccel import Accelerator, ProjectConfiguration, set_seed

    acc = Accelerator(strategy=strategy, project_config=ProjectConfiguration(
        project_dir=os.path.join(workdir, "project"), automatic_checkpoint_naming=True))
    set_seed(0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    loader = DataLoader(_data(), batch_size=4, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    acc.resume()
    _train(acc, loader, model, opt, sched)
    acc.save_state()
    _ok(shape, acc)
    acc.end_training()


def fsdp(workdir: str) -> None:
    ddp(workdir, strategy="fsdp", shape="fsdp")


def tpfsdp(workdir: str, shape: Optional[str] = "tpfsdp") -> None:
    """Tensor parallel over 2 processes, times FSDP2 over the rest (2 x 2 on 4 processes; on 2, as
    inside ``canonical`` in ``make test``, the mesh is 1 x 2: TP only, its DTensors and groups)."""
    import tiny_models

    from anyaccel import Accelerator, ParallelismConfig, set_seed

    plan = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}
    shard = int(os.environ.get("WORLD_SIZE", "4")) // 2
    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=shard, tp_size=2, tp_plan=plan))
    set_seed(0)
    model = tiny_models.Net(width=8, blocks=1, hidden=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    model, opt, loader = acc.prepare(model, opt, loader)
    if not any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise RuntimeError("tpfsdp: no parameter of the prepared model is a DTensor: tensor parallel did not apply")
    _train(acc, loader, model, opt, epochs=1)
    if shape:
        _ok(shape, acc)
    acc.end_training()


def workers(workdir: str) -> None:
    from anyaccel import Accelerator, set_seed

    acc = Accelerator()
    set_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    loader = DataLoader(_Noisy(), batch_size=4, shuffle=True, num_workers=2)
    model, opt, loader = acc.prepare(model, opt, loader)
    _train(acc, loader, model, opt, epochs=4)
    _ok("workers", acc)
    acc.end_training()


def twice(workdir: str) -> None:
    from anyaccel import Accelerator, set_seed

    for fold in range(2):  # a cross-validation loop: a fresh Accelerator per fold
        acc = Accelerator()
        set_seed(fold)
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = DataLoader(_data(), batch_size=4, shuffle=True)
        model, opt, loader = acc.prepare(model, opt, loader)
        loss = _train(acc, loader, model, opt, epochs=1)
        if not loss == loss:
            raise RuntimeError(f"fold {fold} trained to a NaN loss")
        if fold == 1:
            _ok("twice", acc)
        acc.end_training()


def canonical(workdir: str) -> None:
    """``fsdp``, ``tpfsdp``, ``workers``, ``twice`` and ``ddp`` in one job of 2 processes (what
    ``make test`` soaks: every fresh process costs seconds of CPU in imports alone — torch, then
    DTensor for FSDP2 (~2 CPU-s) and Dynamo for the first optimizer — so one job of 2 costs about
    half the job of 4 it replaced: 23 against 43 CPU-s a run): an Accelerator under FSDP2 with
    ``project_dir`` + ``resume()`` trains over a DataLoader with 2 forked workers for 2 epochs,
    saves and ends; a second one, tensor parallel (TP x FSDP2 on a 1 x 2 mesh when launched on 2
    processes, 2 x 2 on 4), trains an epoch and ends; a third, under DDP, trains for 2 more epochs with
    forked workers (4 forks of workers per rank in all; the earlier models — their FSDP and
    DTensor state — are dropped while the script runs), and its ``end_training()`` is the last
    line of ``main()``: the process exits under DDP. A ``ThreadPoolExecutor`` kept in a global
    (a metrics writer, say) is still alive at exit: its threads stop only when the interpreter's
    threading-exit callbacks tell them to."""
    import concurrent.futures

    from anyaccel import Accelerator, ProjectConfiguration, set_seed

    global _WRITER
    _WRITER = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    _WRITER.submit(time.sleep, 0.01).result()
    for fold, strategy in enumerate(("fsdp", "tpfsdp", None)):
        if strategy == "tpfsdp":
            tpfsdp(workdir, shape=None)
            continue
        config = ProjectConfiguration(project_dir=os.path.join(workdir, "project"), automatic_checkpoint_naming=True)
        acc = Accelerator(strategy=strategy, project_config=config if fold == 0 else None)
        set_seed(fold)
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        loader = DataLoader(_Noisy(), batch_size=4, shuffle=True, num_workers=2)
        model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
        if fold == 0:
            acc.resume()
        loss = _train(acc, loader, model, opt, sched, epochs=2)
        if not loss == loss:
            raise RuntimeError(f"fold {fold} trained to a NaN loss")
        if fold == 0:
            acc.save_state()
        else:
            _ok("canonical", acc)
        acc.end_training()


def notebook(workdir: str) -> None:
    from anyaccel import notebook_launcher

    def training_function(folder):  # defined inside, as in a notebook cell: the workers are forked
        from anyaccel import Accelerator, set_seed

        acc = Accelerator()
        set_seed(0)
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = DataLoader(_data(), batch_size=4, shuffle=True)
        model, opt, loader = acc.prepare(model, opt, loader)
        _train(acc, loader, model, opt)
        _ok("notebook", acc)
        acc.end_training()

    notebook_launcher(training_function, (workdir,), num_processes=2)


def _weights_sha(model: torch.nn.Module) -> str:
    import hashlib

    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def ftkill(workdir: str) -> None:
    """Per-step fault tolerance, killed and healed (issue 41): 2 replica groups of 1 process
    (``anyaccel launch --fault_tolerance on --max_restarts 1 --num_processes 2``). Once the groups
    have taken 3 steps together, group 1 SIGKILLs itself (every process of the group); group 0
    goes on alone (sleeping ``ALONE_SLEEP_S`` a step, so that the restart of group 1 — a new
    interpreter importing torch — comes back before it ends; a group that starts before the other
    sleeps alike until it comes: without, the first could take its 200 epochs alone first); group 1's agent starts it again and
    it heals from group 0 in ``resume()``. Both stop after the first whole epoch they then take
    together (a rule both compute alike: every step of the epoch seen, every one with 2 groups),
    at the same step. Each group then writes its weights' SHA-256 and its committed step, and the
    second to write compares them (bitwise; a difference ends the run with an error). ``soak-ok
    ftkill rank G`` is printed by group G: group 0 only if it never restarted, group 1 only if it
    restarted and healed."""
    import json
    import signal

    from anyaccel import Accelerator, set_seed

    acc = Accelerator()
    replica = acc._replica
    group, restarted = replica.settings.group, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    set_seed(0)  # the same seed in every group: the same initial weights and shuffle order
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    loader = DataLoader(_data(), batch_size=4, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    start = acc.resume()
    together, after_kill, finished = 0, restarted, False
    for _ in range(start.epoch, 200):
        seen, whole = 0, True
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            seen += 1
            both = replica.participants == 2
            together += both
            whole = whole and both
            if both and together == 3 and group == 1 and not restarted:
                os.kill(os.getpid(), signal.SIGKILL)  # every process of group 1, mid-epoch
            if not both:  # alone: the other group killed, or not started yet (its interpreter still
                after_kill = after_kill or bool(together)  # importing torch): give it time to come
                time.sleep(ALONE_SLEEP_S)
        if after_kill and whole and seen == len(loader):
            finished = True
            break
    if not finished:
        raise RuntimeError(f"group {group}: 200 epochs without a whole epoch of both groups after the kill")
    mine = {"sha": _weights_sha(model), "committed": replica.step}
    with open(os.path.join(workdir, f"group_{group}.tmp"), "w") as fh:
        json.dump(mine, fh)
    os.replace(os.path.join(workdir, f"group_{group}.tmp"), os.path.join(workdir, f"group_{group}.json"))
    other = os.path.join(workdir, f"group_{1 - group}.json")
    if os.path.exists(other):  # the second group to finish compares (at least one of them sees both)
        with open(other) as fh:
            theirs = json.load(fh)
        if theirs != mine:
            raise RuntimeError(f"the groups ended with different weights or steps: group {group} {mine}, "
                               f"group {1 - group} {theirs}")
    if (group == 0 and not restarted) or (group == 1 and restarted and replica.heals):
        print(f"soak-ok ftkill rank {group}", flush=True)
    acc.end_training()


#: seconds a fault-tolerant group sleeps per step it takes without the other (ftkill)
ALONE_SLEEP_S = 0.5

_WRITER = None  # canonical's executor, kept in a global on purpose

SHAPES = {"ddp": ddp, "fsdp": fsdp, "tpfsdp": tpfsdp, "workers": workers, "twice": twice, "notebook": notebook,
          "canonical": canonical, "ftkill": ftkill}


def main() -> None:
    shape, workdir = sys.argv[1], sys.argv[2]
    SHAPES[shape](workdir)


if __name__ == "__main__":
    main()
