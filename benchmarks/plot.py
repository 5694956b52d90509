"""Charts of saved benchmark results: ``python -m benchmarks --plot DIR [--results PATH]``.

Reads the JSON that ``python -m benchmarks --json PATH`` writes (``{"header", "seconds",
"rows"}``; each row as :func:`benchmarks.common.row` makes it) — by default the newest file in
``benchmarks/results/`` — and writes one PNG per benchmark into ``DIR``:

* ``overhead.png``  1-process step time / raw PyTorch (tiny and medium MLP, bf16, accumulation);
* ``ddp.png``       2-process DDP throughput / raw DDP;
* ``gfm.png``       ``gather_for_metrics`` epoch time / a raw ``all_gather`` loop;
* ``import.png``    import time on top of ``import torch`` (log scale, the 50 ms budget drawn);
* ``launch.png``    launcher start to first collective, seconds, against torchrun;
* ``gpu.png``       from ``gpu_bench.json`` (``OUT=DIR python benchmarks/gpu_bench.py``): images or
                    tokens per second / raw PyTorch.

Ratios are drawn with their 95 % confidence intervals (parsed from the rows' notes, where the
benchmark computed one); the ``raw'`` control (raw PyTorch measured against itself in the same
run) is drawn as a grey band: the noise floor, what "no difference" looked like in that run.
Targets are dashed lines. Needs matplotlib (``pip install -e ".[bench]"``); nothing else of the
benchmarks is imported, so plotting works on a machine that cannot run them.

:func:`rows_from_markdown` reads a table printed by ``--markdown`` back into rows (how the
2026-11-21 run recorded in ``benchmarks/README.md`` became ``results/2026-11-21-cpu.json``).
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["load_results", "rows_from_markdown", "plot_all", "RESULTS_DIR"]

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_CI = re.compile(r"95% CI (\d+(?:\.\d+)?)-(\d+(?:\.\d+)?)")
COLORS = {"anyaccel": "#1f77b4", "accelerate": "#ff7f0e", "fabric": "#7b3fa0", "lightning": "#7b3fa0", "raw'": "#888888",
          "proposal": "#7fb2d9", "torchrun": "#555555", "other": "#2ca02c"}


# --------------------------------------------------------------------------------------------
# Reading results
# --------------------------------------------------------------------------------------------


def newest_results(directory: str = RESULTS_DIR) -> Optional[str]:
    """The most recently named ``*.json`` in ``directory`` (names start with the date), or None."""
    found = sorted(glob.glob(os.path.join(directory, "*.json")))
    return found[-1] if found else None


def load_results(path: str) -> Dict[str, Any]:
    """``{"header": {...}, "rows": [...]}`` from a ``--json`` file, or from a Markdown file
    holding the table ``--markdown`` prints (header then empty)."""
    if path.endswith(".md"):
        with open(path) as f:
            return {"header": {"source": path}, "rows": rows_from_markdown(f.read())}
    with open(path) as f:
        data = json.load(f)
    if "rows" not in data:
        raise ValueError(f"{path} has no 'rows': not a file written by `python -m benchmarks --json`")
    if "header" not in data:  # gpu_bench.json: the header's fields at the top level
        data = {"header": {k: v for k, v in data.items() if k != "rows"}, "rows": data["rows"]}
    return data


def _number(text: str) -> Tuple[Optional[float], str]:
    m = re.match(r"^\s*([-+]?[\d,]*\.?\d+(?:e[-+]?\d+)?)\s*(.*)$", text)
    if not m:
        return None, text.strip()
    return float(m.group(1).replace(",", "")), m.group(2).strip()


def rows_from_markdown(text: str) -> List[Dict[str, Any]]:
    """The rows of the results table(s) in Markdown ``text`` (columns bench | what | contender |
    median | ratio | vs | target | verdict | note), in :func:`benchmarks.common.row`'s format."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 9 or cells[0] in ("bench", "") or set(cells[0]) <= {"-"}:
            continue
        bench, name, contender, median, ratio, vs, target, verdict, note = cells
        value, unit = _number(median) if median != "-" else (None, "")
        rows.append({"bench": bench, "name": name, "contender": contender, "value": value, "unit": unit,
                     "ratio": None if ratio in ("-", "") else float(ratio), "baseline": vs or None,
                     "target": target or None, "ok": {"ok": True, "MISSED": False}.get(verdict), "note": note})
    return rows


def ci_of(row: Dict[str, Any]) -> Optional[Tuple[float, float]]:
    """The 95 % confidence interval of the row's ratio, from its note (None when not measured)."""
    m = _CI.search(row.get("note") or "")
    return (float(m.group(1)), float(m.group(2))) if m else None


def _color(contender: str) -> str:
    for key, color in COLORS.items():
        if contender.startswith(key):
            return color
    return COLORS["anyaccel"] if contender.startswith("anyaccel") or contender.startswith("gather(") else COLORS["other"]


def _limit(target: Optional[str]) -> Optional[float]:
    m = re.match(r"^[<>]=\s*\+?(\d+(?:\.\d+)?)$", (target or "").strip())
    return float(m.group(1)) if m else None


# --------------------------------------------------------------------------------------------
# Charts
# --------------------------------------------------------------------------------------------


def _ratio_chart(plt: Any, rows: Sequence[Dict[str, Any]], names: Sequence[str], title: str, xlabel: str,
                 path: str, better: str) -> Optional[str]:
    """Horizontal bars of ratios (one group per benchmark ``name``) with CI whiskers, the raw'
    noise floor as a grey band per group, targets as dashed lines."""
    groups = [(n, [r for r in rows if r["name"] == n and r.get("ratio") is not None]) for n in names]
    groups = [(n, g) for n, g in groups if g]
    if not groups:
        return None
    height = sum(len(g) for _, g in groups) * 0.42 + len(groups) * 0.55 + 1.9
    fig, ax = plt.subplots(figsize=(9.5, height))
    y, ticks, labels, lo_all, hi_all, targets, floors = 0.0, [], [], [1.0], [1.0], [], []
    for name, group in groups:
        top = y
        floor = next((r for r in group if r["contender"] == "raw'"), None)
        for r in group:
            ci = ci_of(r)
            err = None
            if ci:
                err = [[max(0.0, r["ratio"] - ci[0])], [max(0.0, ci[1] - r["ratio"])]]
                lo_all.append(ci[0])
                hi_all.append(ci[1])
            lo_all.append(r["ratio"])
            hi_all.append(r["ratio"])
            ax.barh(y, r["ratio"] - 1.0, left=1.0, height=0.62, color=_color(r["contender"]),
                    xerr=err, error_kw={"ecolor": "black", "capsize": 3, "lw": 1})
            edge = max(r["ratio"], ci[1] if ci else r["ratio"])
            ax.text(edge, y, f"  {r['ratio']:.3f}" + (f"  [{ci[0]:.3f}–{ci[1]:.3f}]" if ci else ""),
                    va="center", fontsize=8.5)
            ticks.append(y)
            labels.append(r["contender"])
            y += 1
        bottom = y - 1
        if floor is not None:
            band = ci_of(floor) or (min(1.0, floor["ratio"]), max(1.0, floor["ratio"]))
            ax.fill_betweenx([top - 0.45, bottom + 0.45], band[0], band[1], color="#bbbbbb", alpha=0.45, lw=0,
                             zorder=0, label=None if floors else "noise floor: raw' vs raw (its 95% CI, else 1.0 to its ratio)")
            floors.append(band)
        limit = _limit(next((r.get("target") for r in group if r.get("target")), None))
        if limit is not None:
            ax.plot([limit, limit], [top - 0.5, bottom + 0.5], ls="--", color="#d62728", lw=1.2,
                    label=None if targets else "target")
            targets.append(limit)
        ax.text(0.005, top - 0.72, name, transform=ax.get_yaxis_transform(), fontsize=9.5, fontweight="bold",
                va="bottom")
        y += 1.3
    ax.axvline(1.0, color="black", lw=1)
    span = max(hi_all) - min(lo_all)
    ax.set_xlim(min(lo_all) - 0.06 * span - 0.005, max(hi_all) + 0.32 * span + 0.01)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=9)
    ax.set_ylim(y - 1.0, -1.2)  # inverted: first group on top, room for its name
    ax.set_xlabel(f"{xlabel}   ({better})")
    ax.grid(axis="x", alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    if handles:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.09 * 8 / height), ncol=2, fontsize=8, frameon=False)
    _finish(fig, title, path)
    return path


def _finish(fig: Any, title: str, path: str) -> None:
    """Title across the figure's top-left (long y labels must not push it off the edge), save."""
    fig.suptitle(title, x=0.01, y=0.995, ha="left", va="top", fontsize=10.5)
    fig.tight_layout()  # makes room for the suptitle
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)


def _fmt(value: float, unit: str) -> str:
    return (f"{value:,.0f}" if value >= 100 else f"{value:.3g}") + unit


def _absolute_chart(plt: Any, items: Sequence[Tuple[str, float, str]], title: str, xlabel: str, path: str,
                    limit: Optional[Tuple[float, str]] = None, log: bool = False, unit: str = "") -> Optional[str]:
    """Horizontal bars of absolute values ``(label, value, contender)``; ``limit`` = (x, text)."""
    if not items:
        return None
    fig, ax = plt.subplots(figsize=(9.5, 0.45 * len(items) + 1.8))
    for i, (label, value, contender) in enumerate(items):
        ax.barh(i, value, height=0.62, color=_color(contender))
        ax.text(value, i, "  " + _fmt(value, unit), va="center", fontsize=8.5)
    if limit is not None:
        ax.axvline(limit[0], ls="--", color="#d62728", lw=1.2, label=limit[1])
        ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
    ax.set_yticks(range(len(items)))
    ax.set_yticklabels([label for label, _, _ in items], fontsize=9)
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
    hi = max(v for _, v, _ in items)
    ax.set_xlim(right=hi * (6 if log else 1.25))
    ax.set_xlabel(xlabel)
    ax.grid(axis="x", alpha=0.3, which="both" if log else "major")
    _finish(fig, title, path)
    return path


def _subtitle(header: Dict[str, Any]) -> str:
    when = header.get("date", "?")
    torch = header.get("torch") or (header.get("versions") or {}).get("torch", "")
    machine = header.get("gpu") or (header.get("machine") or "").split(";")[0]
    return f"{when} · torch {torch} · {machine}".strip(" ·")


def plot_all(results: Dict[str, Any], out_dir: str) -> List[str]:
    """Write every chart the rows allow into ``out_dir``; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    rows, sub = results["rows"], _subtitle(results.get("header", {}))
    of = lambda bench: [r for r in rows if r["bench"] == bench and "Python calls" not in r["name"]]  # noqa: E731
    written = []

    steps = of("overhead") + of("training")
    written.append(_ratio_chart(
        plt, steps, list(dict.fromkeys(r["name"] for r in steps)),
        f"Step time, 1 process, relative to raw PyTorch (CPU time per step)\n{sub}",
        "step time / raw PyTorch", os.path.join(out_dir, "overhead.png"), "lower is better; 1.0 = raw"))
    ddp = of("ddp")
    written.append(_ratio_chart(
        plt, ddp, list(dict.fromkeys(r["name"] for r in ddp)),
        f"2-process CPU DDP training throughput, relative to raw DDP\n{sub}",
        "samples/s / raw DDP", os.path.join(out_dir, "ddp.png"), "higher is better; 1.0 = raw"))
    gfm = of("gfm")
    written.append(_ratio_chart(
        plt, gfm, list(dict.fromkeys(r["name"] for r in gfm)),
        f"gather_for_metrics over an evaluation epoch, relative to a raw all_gather loop\n"
        f"(no raw' control in this benchmark) {sub}",
        "epoch time / raw loop", os.path.join(out_dir, "gfm.png"), "lower is better; 1.0 = raw"))

    gpu = [r for r in of("gpu") if "/s" in (r.get("unit") or "")]
    written.append(_ratio_chart(
        plt, gpu, list(dict.fromkeys(r["name"] for r in gpu)),
        f"GPU training throughput (benchmarks/gpu_bench.py), relative to raw PyTorch\n{sub}",
        "items/s / raw PyTorch", os.path.join(out_dir, "gpu.png"), "higher is better; 1.0 = raw"))

    sequence = [r for r in rows if r["bench"] == "sequence" and r.get("ratio") is not None]  # calls rows too: CPU time
    written.append(_ratio_chart(
        plt, sequence, list(dict.fromkeys(r["name"] for r in sequence)),
        f"Sequence parallelism (Ulysses, sp 2, 2 CPU processes): step vs a hand-written loop; activation memory per "
        f"rank vs one process\n{sub}", "ratio to the baseline of each group", os.path.join(out_dir, "sequence.png"),
        "step: lower is better, 1.0 = hand-written; memory: 0.5 would be a perfect split"))

    imports = [(r["name"].replace(" (after import torch)", ""), r["value"], r["contender"]) for r in of("import")
               if r.get("value") is not None and r.get("unit") == "ms"]
    written.append(_absolute_chart(
        plt, imports, f"Import time on top of `import torch` (fresh interpreters)\n{sub}", "milliseconds (log scale)",
        os.path.join(out_dir, "import.png"), limit=(50.0, "budget 50 ms"), log=True, unit=" ms"))

    launch = [r for r in of("launch") if r.get("value") is not None]
    base = next((r["value"] for r in launch if r["contender"] == "torchrun"), None)
    written.append(_absolute_chart(
        plt, [(r["contender"] + (" (1 process only)" if "ONE process" in (r.get("note") or "") else ""),
               r["value"], r["contender"]) for r in launch],
        f"Launcher: start to first collective, 2 CPU processes (median of rounds)\n{sub}", "seconds",
        os.path.join(out_dir, "launch.png"),
        limit=(base + 0.2, "target: torchrun + 0.2 s") if base else None, unit=" s"))
    return [p for p in written if p]
