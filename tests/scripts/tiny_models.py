"""The small residual MLP that the multi-process check scripts shard (fsdp_checks.py, nd_checks.py).

One definition, imported by those scripts as a sibling module (each puts its own directory first
on ``sys.path``, as train_common.py's users do). The class names are part of what the checks use:
FSDP wraps ``Block`` by name (``transformer_cls_names_to_wrap=["Block"]``), and the N-D plan
addresses ``blocks.*.fc1`` / ``blocks.*.fc2``.
"""

from __future__ import annotations

import torch


class Block(torch.nn.Module):
    """``x + fc2(tanh(fc1(x)))``; ``hidden`` (default ``width``) is fc1's output width."""

    def __init__(self, width: int, hidden: int | None = None):
        super().__init__()
        hidden = hidden or width
        self.fc1 = torch.nn.Linear(width, hidden)
        self.fc2 = torch.nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(torch.nn.Module):
    """8 features in, ``blocks`` :class:`Block` of ``width``, 1 out (parameters inp, blocks.i.fc1/fc2, out)."""

    def __init__(self, width: int, blocks: int, hidden: int | None = None):
        super().__init__()
        self.inp = torch.nn.Linear(8, width)
        self.blocks = torch.nn.ModuleList(Block(width, hidden) for _ in range(blocks))
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)
