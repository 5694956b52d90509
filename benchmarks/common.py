"""Shared helpers for the benchmarks: rounds that alternate contenders, medians, result rows,
the table printer and small process helpers.

Every benchmark module exposes ``run(quick: bool) -> list[dict]``; each dict is one *row*:

    {"bench": "overhead", "name": "tiny MLP step", "contender": "anyaccel",
     "value": 152.3, "unit": "us/step", "ratio": 1.01, "baseline": "raw",
     "target": "<= 1.02", "ok": True, "note": "..."}

``ratio`` is always "contender divided by baseline" in the direction the row's unit reads
(times: >1 is slower; throughputs: <1 is slower); ``target`` says which way is good.
Nothing in here is imported by the ``anyaccel`` package; the benchmarks never run in the tests.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable

__all__ = [
    "REPO",
    "PYTHON",
    "have",
    "median",
    "interleaved",
    "row",
    "skip_row",
    "print_table",
    "markdown_table",
    "free_port",
    "torchrun_cmd",
    "run_torchrun_json",
    "bench_env",
    "versions",
]


def have(module: str) -> bool:
    """True when ``module`` can be imported in this interpreter (checked without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def interleaved(contenders: Dict[str, Callable[[], float]], rounds: int, warmup: int = 1,
                baseline: Optional[str] = None) -> Dict[str, Dict[str, Any]]:
    """Run each contender's measurement once per round, the order rotating every round
    (ABC, BCA, CAB, ...), after ``warmup`` unrecorded rounds.

    Each callable returns one measurement (e.g. seconds per step). Returns, per contender, its
    measurements, their median and -- when ``baseline`` is given -- the median of the *per-round*
    ratios to the baseline (pairing measurements taken seconds apart cancels slow drifts of a
    shared machine better than a ratio of medians).
    """
    names = list(contenders)
    samples: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        k = r % len(names)
        order = names[k:] + names[:k]
        if (r // len(names)) % 2:
            order = order[::-1]
        for name in order:
            gc.collect()
            value = contenders[name]()
            if r >= warmup:
                samples[name].append(value)
    out: Dict[str, Dict[str, Any]] = {}
    for n in names:
        out[n] = {"samples": samples[n], "median": median(samples[n])}
        if baseline is not None:
            ratios = [a / b for a, b in zip(samples[n], samples[baseline]) if b > 0]
            out[n]["ratio"] = median(ratios)
    return out


def row(bench: str, name: str, contender: str, value: Optional[float], unit: str, ratio: Optional[float] = None,
        baseline: Optional[str] = None, target: Optional[str] = None, note: str = "") -> Dict[str, Any]:
    """One result row; ``ok`` is computed from ``target`` (``"<= 1.02"``, ``">= 0.99"``, ``"<= +0.2 s"``,
    ``"<= 50 ms"``) against ``ratio`` (or against ``value`` for absolute targets)."""
    ok = None
    if target:
        op, _, rest = target.partition(" ")
        num = rest.replace("+", "").split(" ")[0]
        try:
            limit = float(num)
        except ValueError:
            limit = None
        absolute = rest.strip().endswith(("s", "ms", "us"))
        x = value if absolute else ratio
        if limit is not None and x is not None:
            ok = x <= limit if op == "<=" else x >= limit
    return {"bench": bench, "name": name, "contender": contender, "value": value, "unit": unit,
            "ratio": ratio, "baseline": baseline, "target": target, "ok": ok, "note": note}


def skip_row(bench: str, name: str, contender: str, why: str, target: Optional[str] = None) -> Dict[str, Any]:
    """A row for a contender that could not be measured (not installed, not available, failed)."""
    return {"bench": bench, "name": name, "contender": contender, "value": None, "unit": "",
            "ratio": None, "baseline": None, "target": target, "ok": None, "note": why}


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        if abs(x) >= 100:
            return f"{x:.1f}"
        return f"{x:.{digits}g}" if abs(x) < 10 else f"{x:.2f}"
    return str(x)


def _cells(r: Dict[str, Any]) -> List[str]:
    verdict = {True: "ok", False: "MISSED", None: ""}[r.get("ok")]
    value = "-" if r.get("value") is None else f"{_fmt(r['value'])} {r.get('unit', '')}".strip()
    ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.3f}"
    return [r["bench"], r["name"], r["contender"], value, ratio, r.get("baseline") or "",
            r.get("target") or "", verdict, r.get("note") or ""]


_HEAD = ["bench", "what", "contender", "median", "ratio", "vs", "target", "", "note"]


def print_table(rows: Sequence[Dict[str, Any]], file: Any = None) -> None:
    """Print ``rows`` as an aligned plain-text table."""
    file = file or sys.stdout
    cells = [_HEAD] + [_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(_HEAD) - 1)]
    for j, c in enumerate(cells):
        line = "  ".join(c[i].ljust(widths[i]) for i in range(len(widths))) + "  " + c[-1]
        print(line.rstrip(), file=file)
        if j == 0:
            print("  ".join("-" * w for w in widths), file=file)


def markdown_table(rows: Sequence[Dict[str, Any]]) -> str:
    """``rows`` as a GitHub-flavoured Markdown table (what benchmarks/README.md shows)."""
    lines = ["| " + " | ".join(h or "verdict" for h in _HEAD) + " |", "|" + "---|" * len(_HEAD)]
    for r in rows:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in _cells(r)) + " |")
    return "\n".join(lines)


def free_port() -> int:
    """A TCP port that was free a moment ago on localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_env(threads: int = 1, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment for child processes: the repository importable, thread counts pinned,
    no stray launcher variables from the parent."""
    env = dict(os.environ)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK"):
        env.pop(k, None)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if extra:
        env.update(extra)
    return env


def torchrun_cmd(script: str, args: Sequence[str] = (), nproc: int = 2) -> List[str]:
    """``python -m torch.distributed.run`` for ``nproc`` local processes on a free port."""
    return [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--nnodes", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--max-restarts", "0",
            script, *args]


def run_torchrun_json(script: str, args: Sequence[str], timeout: float = 900, nproc: int = 2) -> Any:
    """Run ``script`` under torchrun with ``--out FILE`` appended; rank 0 writes JSON there.
    Returns the parsed JSON. Raises RuntimeError with the tail of the output on failure."""
    tmp = tempfile.mkdtemp(prefix="anyaccel-bench-")
    out = os.path.join(tmp, "result.json")
    try:
        proc = subprocess.run(torchrun_cmd(script, [*args, "--out", out], nproc=nproc), cwd=REPO,
                              env=bench_env(), capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise RuntimeError(f"{os.path.basename(script)} {' '.join(args)} exited {proc.returncode}:\n{tail}")
        with open(out) as f:
            return json.load(f)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def versions() -> Dict[str, str]:
    """Versions of torch and of the peers that are installed (for the report header)."""
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for dist in ("torch", "anyaccel", "accelerate", "lightning"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    out["cpus"] = str(os.cpu_count())
    return out


def timer() -> float:
    return time.perf_counter()
