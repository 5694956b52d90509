"""Shared pieces of the training worker scripts (tests/scripts/train_*.py) and their tests.

``build`` makes the standard small training set-up: an MLP with dropout, Adam, StepLR and a
shuffled DataLoader over fixed synthetic data, prepared by ``acc``. The data never depends on
``seed`` (only the model initialisation does), so two runs differ only where they should.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset


class Progress:
    """Training progress kept in checkpoints through ``register_for_checkpointing``."""

    def __init__(self):
        self.epoch = 0
        self.step = 0

    def state_dict(self):
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state):
        self.epoch, self.step = int(state["epoch"]), int(state["step"])


def data(n: int = 60, features: int = 6):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, features, generator=g)
    y = x @ torch.randn(features, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def make_model(features: int = 6, dropout: float = 0.2) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(features, 16), torch.nn.ReLU(), torch.nn.Dropout(dropout),
                               torch.nn.Linear(16, 1))


def build(acc, seed: int, n: int = 60, batch_size: int = 4, lr: float = 0.01, dropout: float = 0.2,
          tp_plan=None):
    """Seed, build and prepare (model, optimizer, loader, scheduler). ``tp_plan``: the model's own
    tensor-parallel plan (as transformers models carry one), for a ``tp_size`` > 1 job."""
    from anyaccel import set_seed

    set_seed(seed)
    model = make_model(dropout=dropout)
    if tp_plan is not None:
        model._tp_plan = tp_plan
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    loader = DataLoader(data(n), batch_size=batch_size, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    return model, opt, loader, sched


def train_step(acc, model, opt, sched, batch):
    xb, yb = batch
    with acc.accumulate(model):
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
    return loss


def weights(acc, model):
    return {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}


def child_env() -> dict:
    """Environment for a single-process child: no launcher variables, the repository importable."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("SLURM_", "OMPI_", "PMI_", "ANYACCEL_"))}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env
