"""Checkpoints moving between N-D layouts: TP2xDP2 -> FSDP2 over 4 -> one process -> TP2xDP2
(and a sharded TP2xDP2 checkpoint into DDP over 4), through save_state/resume; save_model of
a TP x FSDP model.

    anyaccel launch --num_processes 4 --cpu nd_ckpt_checks.py OUT first   # TP2xDP2 saves A; FSDP4 loads A, saves B
    python nd_ckpt_checks.py OUT one                                      # one process loads B, saves C
    anyaccel launch --num_processes 4 --cpu nd_ckpt_checks.py OUT back    # TP2xDP2 loads C; DDP4 loads A

Every phase writes, per rank, OUT/<phase>_rank<r>.json (losses, RNG digest, scheduler and loader
positions) and, on rank 0, OUT/<phase>.pt: the full model and optimizer state (gathered, keyed
by parameter names) right after loading (or, for ``save``, at the moment A was saved). Several
layouts run one after the other in the same processes, as separate Accelerators (one per
layout, each building the model afresh), so that one launch covers several moves; the process
group is left once, at the end (a worker that leaves it and creates another Accelerator waits
forever re-joining it under anyaccel launch today).
"""

import hashlib
import json
import os
import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.utils.data import DataLoader, TensorDataset

from anyaccel import Accelerator, ParallelismConfig, set_seed
import rank_results  # tests/scripts: on the job's PYTHONPATH (tests/conftest.py clean_env)

WIDTH, GLOBAL_BATCH, SAVE_AT, STEPS = 16, 8, 2, 3
PLAN = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = torch.nn.Dropout(0.2)  # on the replicated input of a colwise layer: TP peers must draw alike
        self.fc1 = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.drop(x))))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.out = torch.nn.Linear(WIDTH, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def accelerator_for(layout):
    kwargs = {"step_scheduler_per_process": False}  # one scheduler step per optimizer step in every layout
    if layout == "tp2dp2":
        return Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2, tp_plan=PLAN), **kwargs)
    return Accelerator(strategy={"fsdp4": "fsdp", "ddp4": "ddp", "one": None}[layout], **kwargs)


class Job:
    """A fresh job in ``layout``: the same model, AdamW, a scheduler and a shuffled loader whose
    global batch is GLOBAL_BATCH whatever the number of data-parallel ranks."""

    def __init__(self, layout):
        self.accelerator = accelerator = accelerator_for(layout)
        dp = accelerator.parallelism_config.data_parallel_size if layout == "tp2dp2" else accelerator.num_processes
        set_seed(0)
        model = Net()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
        loader = DataLoader(data, batch_size=GLOBAL_BATCH // dp, shuffle=True)
        self.model, self.optimizer, self.loader, self.scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        self.batches = None  # one pass over the loader, continued across train() calls

    def load(self, directory):
        self.accelerator.resume(directory)  # load_state, and the loader's position in its epoch
        self.batches = None  # the next pass continues the loaded epoch where it stood

    def train(self, steps, mode):
        """``steps`` optimizer steps (dropout on in ``train`` mode); the losses averaged over the job."""
        self.model.train(mode == "train")
        if self.batches is None:
            self.batches = iter(self.loader)
        losses = []
        for _ in range(steps):
            x, y = next(self.batches)
            loss = (self.model(x) - y).pow(2).mean()
            self.accelerator.backward(loss)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
            losses.append(self.accelerator.reduce(loss.detach(), "mean").item())
        return losses


def rng_digest():
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]


def record(out, job, phase, **extra):
    """Write what this phase holds: per rank a JSON; on rank 0 the full model and optimizer state."""
    accelerator, model, optimizer, loader, scheduler = (job.accelerator, job.model, job.optimizer, job.loader,
                                                        job.scheduler)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = accelerator.get_state_dict(model)  # collective; rank 0 receives the full dict
    optim = get_optimizer_state_dict(accelerator.unwrap_model(model), optimizer.optimizer, options=full)
    info = {"rng": rng_digest(), "state_keys": len(weights), "scheduler": scheduler.state_dict()["last_epoch"],
            "lr": optimizer.param_groups[0]["lr"], "loader": loader.state_dict()["position"], **extra}
    rank_results.write(out, phase, accelerator.process_index, info)
    if accelerator.is_main_process:
        torch.save({"model": weights, "optimizer": optim}, os.path.join(out, f"{phase}.pt"))


def loaded(out, layout, source, phase, save_as=None, mode="eval"):
    """A job in ``layout`` loads ``source`` and records what it holds (``phase``); saves it again
    unchanged as ``save_as``; trains STEPS steps in ``mode`` and records again."""
    job = Job(layout)
    job.load(os.path.join(out, source))
    record(out, job, phase)  # draws no random numbers: the RNG digest is the loaded state's
    if save_as:
        job.accelerator.save_state(os.path.join(out, save_as))
    record(out, job, phase + "_after", losses=job.train(STEPS, mode))
    return job


def main(out, stage):
    jobs = []
    if stage == "first":
        # TP2xDP2 trains SAVE_AT steps (dropout on) and saves A; the references: STEPS more steps
        # with dropout, and (after reloading A in place) STEPS steps without
        job = Job("tp2dp2")
        job.train(SAVE_AT, "train")
        record(out, job, "save")
        job.accelerator.save_state(os.path.join(out, "A"))
        record(out, job, "reference_train", losses=job.train(STEPS, "train"))
        job.load(os.path.join(out, "A"))
        record(out, job, "reference_eval", losses=job.train(STEPS, "eval"))
        jobs += [job, loaded(out, "fsdp4", "A", "fsdp4", save_as="B")]
    elif stage == "one":
        jobs.append(loaded(out, "one", "B", "one", save_as="C"))
    elif stage == "back":
        job = loaded(out, "tp2dp2", "C", "back", mode="train")
        accelerator, model = job.accelerator, job.model
        accelerator.save_model(model, os.path.join(out, "exported"))  # every rank calls it; rank 0 writes
        if accelerator.is_main_process:
            inner = accelerator.unwrap_model(model)
            with open(os.path.join(out, "unwrap.json"), "w") as f:
                json.dump({"is_net": isinstance(inner, Net), "same_object": inner is model,
                           "dtensors": sum(type(p).__name__ == "DTensor" for p in inner.parameters())}, f)
        jobs += [job, loaded(out, "ddp4", "A", "ddp4")]
    for job in reversed(jobs):  # one process group for the whole stage; the last Accelerator leaves it
        job.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
