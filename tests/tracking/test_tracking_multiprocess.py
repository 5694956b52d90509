"""The multi-process tests (real launches, marked slow); the single-process ones are in tests/tracking/test_tracking.py.

Trackers: what ``Accelerator.log`` writes, read back from disk (CSV, TensorBoard, user trackers)."""

import json
import textwrap

import pytest

from conftest import warm_launch
from test_tracking import read_csv  # helpers shared with the unit tests


TWO_RANKS = textwrap.dedent("""
    import sys, torch
    from anyaccel import Accelerator
    acc = Accelerator(log_with="csv", project_dir=sys.argv[1])
    acc.init_trackers("job", config={"world": acc.num_processes})
    for step in range(3):
        # every rank calls log(); only rank 0 writes
        acc.log({"rank": acc.process_index, "loss": torch.tensor(float(step))}, step=step)
    acc.end_training()
""")


@pytest.mark.slow
def test_two_processes_only_rank0_writes(tmp_path):
    script = tmp_path / "log_two.py"
    script.write_text(TWO_RANKS)
    proc = warm_launch(2, script, tmp_path / "proj")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = read_csv(tmp_path / "proj" / "job" / "metrics.csv")
    assert [(r["step"], r["rank"], r["loss"]) for r in rows] == [("0", "0", "0.0"), ("1", "0", "1.0"), ("2", "0", "2.0")]
    assert json.loads((tmp_path / "proj" / "job" / "config.json").read_text()) == {"world": 2}
    assert sorted(p.name for p in (tmp_path / "proj" / "job").iterdir()) == ["config.json", "metrics.csv"]
