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
import platform
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
    "median_ci",
    "ci_text",
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
    "python_calls",
    "cuda_available",
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


def median_ci(values: Iterable[float], z: float = 1.96):
    """Distribution-free ~95% confidence interval of the median (order statistics, normal
    approximation of the binomial); ``(nan, nan)`` for fewer than 6 values."""
    xs = sorted(values)
    n = len(xs)
    if n < 6:
        return float("nan"), float("nan")
    k = max(0, int((n - z * n ** 0.5) / 2))
    return xs[k], xs[n - 1 - k]


def interleaved(contenders: Dict[str, Callable[[], Any]], rounds: int, warmup: int = 1,
                baseline: Optional[str] = None) -> Dict[str, Dict[str, Any]]:
    """Run each contender's measurement once per round, the order rotating every round
    (ABC, BCA, CAB, then reversed), after ``warmup`` unrecorded rounds.

    Each callable returns one measurement: a float, or a dict of named floats (e.g.
    ``{"cpu": ..., "wall": ...}``). Returns, per contender and per metric (``"value"`` for plain
    floats), the samples, their median and -- when ``baseline`` is given -- ``ratio``, the median
    of the *per-round* ratios to the baseline: pairing measurements taken moments apart cancels
    the slow drifts of a shared machine better than a ratio of medians.
    """
    names = list(contenders)
    samples: Dict[str, List[Dict[str, float]]] = {n: [] for n in names}
    # One full collection, then freeze what survives: later automatic collections only scan new
    # objects (a full collection with torch + peers imported costs ~0.1 s; never time one).
    gc.collect()
    gc.freeze()
    for r in range(warmup + rounds):
        k = r % len(names)
        order = names[k:] + names[:k]
        if (r // len(names)) % 2:
            order = order[::-1]
        for name in order:
            value = contenders[name]()
            if r >= warmup:
                samples[name].append(value if isinstance(value, dict) else {"value": float(value)})
    out: Dict[str, Dict[str, Any]] = {}
    for n in names:
        out[n] = {}
        for metric in (samples[n][0] if samples[n] else {}):
            xs = [s[metric] for s in samples[n]]
            entry = {"samples": xs, "median": median(xs)}
            if baseline is not None and baseline in samples:
                base = [s[metric] for s in samples[baseline]]
                ratios = [a / b for a, b in zip(xs, base) if b > 0]
                entry["ratio"] = median(ratios)
                entry["ratio_ci"] = median_ci(ratios)
            out[n][metric] = entry
        if set(out[n]) == {"value"}:  # plain floats: flatten
            out[n] = out[n]["value"]
    return out


def ci_text(ci) -> str:
    """``"95% CI 0.991-1.012"`` (empty when there were too few rounds)."""
    lo, hi = ci
    return "" if lo != lo else f"95% CI {lo:.3f}-{hi:.3f}"


def row(bench: str, name: str, contender: str, value: Optional[float], unit: str, ratio: Optional[float] = None,
        baseline: Optional[str] = None, target: Optional[str] = None, note: str = "",
        judged: Optional[float] = None) -> Dict[str, Any]:
    """One result row; ``ok`` is computed from ``target`` (``"<= 1.02"``, ``">= 0.99"``, ``"<= +0.2 s"``,
    ``"<= 50 ms"``) against ``judged`` when given, else ``ratio`` (or ``value`` for targets with a unit)."""
    ok = None
    if target:
        op, _, rest = target.partition(" ")
        num = rest.replace("+", "").split(" ")[0]
        try:
            limit = float(num)
        except ValueError:
            limit = None
        absolute = rest.strip().endswith(("s", "ms", "us"))
        x = judged if judged is not None else (value if absolute else ratio)
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


PYCACHE = os.path.join(tempfile.gettempdir(), "anyaccel-bench-pycache")


def bench_env(threads: int = 1, extra: Optional[Dict[str, str]] = None, bytecode: bool = True) -> Dict[str, str]:
    """Environment for child processes: the repository importable, thread counts pinned,
    no stray launcher variables from the parent.

    ``bytecode``: give every child a bytecode cache outside the repository (``PYTHONPYCACHEPREFIX``),
    even where ``PYTHONDONTWRITEBYTECODE`` is set (as on the machine these numbers come from).
    Without it an editable install of anyaccel recompiles its sources on every import while
    pip-installed torch/peers load ``.pyc`` files -- not what a user installing a wheel sees.
    """
    env = dict(os.environ)
    if bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = PYCACHE
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


def run_torchrun_json(script: str, args: Sequence[str], timeout: float = 900, nproc: int = 2,
                      env: Optional[Dict[str, str]] = None) -> Any:
    """Run ``script`` under torchrun with ``--out FILE`` appended; rank 0 writes JSON there.
    ``env`` adds variables to the benchmark environment. Returns the parsed JSON. Raises
    RuntimeError with the tail of the output on failure."""
    tmp = tempfile.mkdtemp(prefix="anyaccel-bench-")
    out = os.path.join(tmp, "result.json")
    try:
        proc = subprocess.run(torchrun_cmd(script, [*args, "--out", out], nproc=nproc), cwd=REPO,
                              env=bench_env(extra=env), capture_output=True, text=True, timeout=timeout)
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


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (names the results file ``-gpu`` instead of ``-cpu``)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def python_calls(steps: Any, n: int, enabled: bool = True) -> float:
    """Python function calls (incl. builtins) per item of the iterator ``steps``, counted by
    cProfile over ``n`` items: a deterministic measure of framework overhead that no other job
    on the machine can disturb. With ``enabled=False`` the items are consumed uncounted (other
    ranks of a collective loop must keep in step)."""
    import cProfile
    import itertools
    import pstats

    if not enabled:
        for _ in itertools.islice(steps, n):
            pass
        return float("nan")
    prof = cProfile.Profile()
    prof.enable()
    for _ in itertools.islice(steps, n):
        pass
    prof.disable()
    total = sum(nc for (_, nc, _, _, _) in pstats.Stats(prof).stats.values())
    return total / n


# ---- a step against its hand-written equivalent (the ``*_worker.py`` jobs and their row makers) ----------
def timed_collective(fn: Callable[[], Any], steps: int, device: Any = "cpu",
                     sync: Optional[Callable[[], None]] = None) -> Dict[str, float]:
    """Per step of ``fn`` (which runs ``steps`` steps): ``wall``, the job's (the slowest rank's,
    after a barrier), and ``cpu``, the CPU time of all ranks together (process time: every thread,
    gloo's included), the clock other jobs on a shared machine disturb least. ``sync`` waits for
    ``device`` (a GPU) before the clocks are read. Collective: every rank calls it, each gets both."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    if sync is not None:
        sync()
    wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64, device=device)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
    return {"wall": float(wall.item()) / steps, "cpu": float(cpu.item()) / steps}


def step_summary(res: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Dict[str, Any]]]:
    """:func:`interleaved`'s result of :func:`timed_collective` clocks as a worker writes it:
    ``{contender: {"wall"|"cpu": {"median", "ratio", "ci"}}}``."""
    return {n: {clock: {"median": m["median"], "ratio": m.get("ratio"), "ci": m.get("ratio_ci")}
                for clock, m in r.items()} for n, r in res.items()}


def first_loss_note(losses: Dict[str, float], baseline: str, contender: str) -> str:
    """``first loss X (equal to the hand-written loop's)``: the proof that both computed the same
    step (to 1e-5 relative), or ``DIFFERENT FROM`` when they did not."""
    same = abs(losses[baseline] - losses[contender]) <= 1e-5 * abs(losses[baseline])
    return f"first loss {losses[contender]:.6f} ({'equal to' if same else 'DIFFERENT FROM'} the hand-written loop's)"


def wall_rows(bench: str, name: str, step: Dict[str, Dict[str, Any]], baseline: str, contender: str,
              notes: Optional[Dict[str, str]] = None, target: Optional[str] = "<= 1.02",
              floor: str = "noise floor") -> List[Dict[str, Any]]:
    """One ``ms/step`` row per contender of ``step`` (:func:`step_summary`'s), the ratio to
    ``baseline``: the baseline's note ``notes[baseline]``; ``contender``'s (the one judged by
    ``target``) its CI, then its note; any other (a second copy of the baseline) ``floor``, its CI,
    its note."""
    notes, rows = notes or {}, []
    for who, clocks in step.items():
        wall, base = clocks["wall"], who == baseline
        parts = [] if base else ([] if who == contender else [floor]) + [ci_text(wall["ci"])]
        note = "; ".join(p for p in parts + [notes.get(who, "")] if p)
        rows.append(row(bench, name, who, wall["median"] * 1e3, "ms/step", ratio=None if base else wall["ratio"],
                        baseline=None if base else baseline, target=target if who == contender else None, note=note))
    return rows


def cpu_rows(bench: str, name: str, step: Dict[str, Dict[str, Any]], calls: Dict[str, float],
             baseline: str) -> List[Dict[str, Any]]:
    """The same step's ``CPU ms/step`` rows (all ranks' CPU time, ratio to ``baseline``), each
    noting the Python calls per step on rank 0 (and the difference to the baseline's)."""
    rows = []
    for who, clocks in step.items():
        cpu, base = clocks["cpu"], who == baseline
        note = f"{calls[who]:,.0f} Python calls per step" + ("" if base else f" ({calls[who] - calls[baseline]:+,.0f})")
        if not base and ci_text(cpu["ci"]):
            note += f"; {ci_text(cpu['ci'])}"
        rows.append(row(bench, name, who, cpu["median"] * 1e3, "CPU ms/step", ratio=None if base else cpu["ratio"],
                        baseline=None if base else baseline, note=note))
    return rows


def timer() -> float:
    return time.perf_counter()


def cpu_model() -> str:
    """This machine's CPU model as /proc/cpuinfo names it (else what ``platform`` knows), for the
    header of a results file (``python -m benchmarks``, the cluster's fault figures)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
