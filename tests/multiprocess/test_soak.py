"""The soak inside `make test` (issue 29): each canonical shape of a user's script as a fresh job,
SOAK_RUNS times (default 20), with 0 hangs, 0 failures and 0 processes left behind.

Three jobs cover the six shapes (tests/soak/soak.py ``CI``): ``canonical`` (FSDP2 with
``project_dir``/``resume()``/a checkpoint, then a second Accelerator under DDP that trains again,
DataLoader ``num_workers=2`` over 4 epochs, ``end_training()`` last in ``main()``), ``tpfsdp``
(TP x FSDP2 on 4 processes) and ``notebook`` (``notebook_launcher``). A fresh job costs ~10 s of
CPU before it trains (torch imported by the launcher and each worker, ~1.4 s more for the first
optimizer), so six separate jobs 20 times would take ~13 min of a 2-core machine; ``make soak``
runs the six separately, 200 times each.

The runner and what counts as a hang or a survivor: tests/soak/soak.py (``make soak`` runs it 200
times per shape). Jobs run two at a time; a hang costs the per-run bound (SOAK_BOUND, 90 s), not
the pytest timeout. One test per shape, so a failure names its shape and prints the first bad
runs' output (with py-spy stacks of a hang when py-spy is installed).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "soak"))
import soak  # noqa: E402

pytestmark = pytest.mark.slow

RUNS = int(os.environ.get("SOAK_RUNS", "20"))
BOUND = float(os.environ.get("SOAK_BOUND", "90"))


@pytest.mark.timeout(0)  # bounded per run instead (BOUND), whatever the load of the machine
@pytest.mark.parametrize("shape", soak.CI)
def test_the_canonical_shapes_end_every_time(shape):
    counts = soak.soak([shape], RUNS, parallel=2, bound=BOUND)[shape]
    summary = (f"{shape}: {counts.runs} runs, {counts.ok} ok, {counts.hangs} hangs, {counts.failures} failures, "
               f"{counts.survivors} survivors, slowest {counts.slowest:.1f} s")
    print(summary)
    assert counts.runs == RUNS
    assert counts.hangs == counts.failures == counts.survivors == 0, summary + "\n" + "\n".join(counts.details[:2])
