"""The multi-process tests (real launches, marked slow); the single-process ones are in tests/strategies/test_registry.py.

The strategy registry drives every choice of a strategy, and strategies own their options and
capabilities (issue 21, item 3).

A strategy from outside anyaccel (tests/tiny_strategy/step_average.py) is registered in-process
with ``register_strategy`` and, in fresh processes, through an ``anyaccel.strategies`` entry point
of a throwaway distribution on ``sys.path``; each way it must be accepted by
``Accelerator(strategy=...)``, the config file, ``anyaccel launch --strategy`` and the
``anyaccel config`` question. The capability methods are checked for single/ddp/fsdp/xla.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest


from conftest import CONSOLE_SCRIPT
from test_registry import _distribution, _path_env  # helpers shared with the unit tests


_TRAIN = textwrap.dedent("""
    import json, sys
    import torch
    from anyaccel import Accelerator
    acc = Accelerator()  # the strategy comes from `anyaccel launch --strategy stepavg`
    torch.manual_seed(acc.process_index)  # different initial weights: wrapping must make them agree
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    x = torch.full((4, 3), float(acc.process_index + 1))  # different data on each rank
    acc.backward(model(x).pow(2).mean())
    opt.step()
    weights = [float(v) for v in model.weight.flatten()]
    with open(f"{sys.argv[1]}/rank{acc.process_index}.json", "w") as fh:
        json.dump({"strategy": acc.strategy.name, "weights": weights}, fh)
    acc.end_training()
""")


@pytest.mark.slow
def test_anyaccel_launch_runs_an_entry_point_strategy(tmp_path):
    """The launcher never imports the script: --strategy is checked against the entry points,
    and each worker's plain Accelerator() builds the strategy from them."""
    site = _distribution(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    proc = subprocess.run([sys.executable, "-c", CONSOLE_SCRIPT, "launch", "--num_processes", "2", "--cpu",
                           "--strategy", "stepavg", str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=240, env=_path_env(site))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["strategy"] == r1["strategy"] == "stepavg"
    assert r0["weights"] == r1["weights"]  # same start (broadcast) + averaged gradients = same step
