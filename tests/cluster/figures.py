"""What each fault cost, as a results file the docs quote (benchmarks/figures.py, view ``faults``).

Each fault test calls :func:`record` next to its ``FIGURE`` line. When asked to
(``WRITE_CLUSTER_FIGURES=1 make test-cluster``: CI's ``make test-cluster`` must leave the
checkout as it was, or the ``make docs`` after it finds pages older than the newest results file)
and a session has recorded every fault of :data:`FAULTS` (a whole ``make test-cluster``, or
``pytest -m cluster tests/cluster/test_faults.py``), ``pytest_sessionfinish`` (conftest.py) writes ``benchmarks/results/<date>-<HHMM>-cluster.json`` with
one row per fault (``bench`` ``cluster_faults``, the seconds from the fault to its outcome); a
session that ran only some of them writes nothing and says so. ``python -m benchmarks --publish``
then rewrites the fault table and chart of docs/guides/cluster.md from the newest such file.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path
from typing import Dict, Optional

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

#: key -> the row's name, in the order of the table
FAULTS: Dict[str, str] = {
    "a": "(a) the link to host 1 goes down",
    "b": "(b) slow link to host 1 (16 Mbit/s, 50 ms)",
    "c-restart": "(c) host 1 killed, its launcher restarted (--max_restarts 2)",
    "c-no-restart": "(c) host 1 killed, no restarts",
    "d": "(d) machine 0 (the store's host) killed",
    "e": "(e) SIGTERM to machine 1's launcher",
    "f": "(f) checkpoint filesystem full (time from the job's start)",
    "g": "(g) a worker stopped 8 s (SIGSTOP), then continued",
    "h": "(h) the link to host 1 goes down under --fault_tolerance (torchft), host 1 restarted",
}
#: how a fault ended: the chart colours by it
OUTCOMES = ("clear end", "recovered", "finished")

_rows: Dict[str, dict] = {}
_load_at_start = os.getloadavg()


def record(key: str, outcome: str, seconds: Optional[float], steps_lost: str, note: str,
           extra: Optional[dict] = None) -> None:
    """One fault's figure: ``seconds`` from the fault to ``outcome`` (one of :data:`OUTCOMES`;
    None when the test imposes the time itself), the steps lost, what the test saw; ``extra``:
    more figures of the row, kept in the results file (fault h's heal: seconds, bytes)."""
    if key not in FAULTS or outcome not in OUTCOMES:
        raise ValueError(f"unknown fault {key!r} or outcome {outcome!r}")
    _rows[key] = {"bench": "cluster_faults", "name": FAULTS[key], "contender": outcome,
                  "value": None if seconds is None else round(float(seconds), 1), "unit": "s", "ratio": None,
                  "baseline": None, "target": None, "ok": None, "note": note, "steps_lost": steps_lost,
                  **(extra or {})}


def write(directory: Path = RESULTS) -> Optional[str]:
    """Write the results file when every fault was recorded; return its path, or a sentence why not."""
    missing = [k for k in FAULTS if k not in _rows]
    if not _rows:
        return None
    if not os.environ.get("WRITE_CLUSTER_FIGURES"):
        return "not written (set WRITE_CLUSTER_FIGURES=1 to write a results file from this session)"
    if missing:
        return f"not written: faults {', '.join(missing)} were not recorded in this session"
    import torch

    now = datetime.datetime.now()
    header = {
        "date": now.strftime("%Y-%m-%d %H:%M"),
        "machine": (f"two hosts of network namespaces on one box: {_cpu_model()}, {os.cpu_count()} CPU(s) shared, "
                    f"{platform.system()} {platform.release()}; load average {_load_at_start[0]:.1f} at the start, "
                    f"{os.getloadavg()[0]:.1f} at the end"),
        "python": platform.python_version(), "torch": torch.__version__,
        "command": "make test-cluster (pytest -m cluster tests/cluster); one process per host, --hang_timeout 5",
        "benches": ["cluster_faults"],
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{now:%Y-%m-%d-%H%M}-cluster.json"
    path.write_text(json.dumps({"header": header, "rows": [_rows[k] for k in FAULTS]}, indent=1) + "\n")
    return str(path)


def _cpu_model() -> str:
    import sys

    if str(ROOT) not in sys.path:  # the benchmarks package lives beside anyaccel, not inside it
        sys.path.insert(0, str(ROOT))
    from benchmarks.common import cpu_model

    return cpu_model()
