"""Charts of benchmark results: drawn by ``python -m benchmarks`` (after a run, or ``--publish``)
for the pages' figures blocks (benchmarks/figures.py), or by hand with
``python -m benchmarks --plot DIR [--results PATH]``.

Reads the JSON that ``python -m benchmarks`` writes into ``benchmarks/results/`` (``{"header",
"seconds", "rows"}``; each row as :func:`benchmarks.common.row` makes it). One function per chart,
registered in ``CHARTS`` with the benchmarks whose rows it draws:

* ``overhead``          1-process step time / raw PyTorch, against Accelerate and Fabric (tiny and
                        medium MLP, bf16, accumulation);
* ``ddp``               2-process DDP throughput / raw DDP;
* ``gfm``               ``gather_for_metrics`` epoch time / a raw ``all_gather`` loop;
* ``import``            import time on top of ``import torch`` (log scale, the 50 ms budget drawn);
* ``launch``            launcher start to first collective, seconds, against torchrun;
* ``async_checkpoint``  the training stall of ``save_state`` against ``save_state(async_save=True)``;
* ``bigmodel``          peak memory per process against the process count, per way of loading;
* ``faults``            seconds from each fault of the two-host cluster to a clear end or to recovery;
* ``sequence``          sequence parallelism: step time / a hand-written Ulysses loop, activation memory;
* ``pipeline``          pipeline parallelism: the bubble of each schedule, measured and in theory;
* ``deepspeed``         DeepSpeed: step time / the same engine by hand, peak memory per rank / DDP;
* ``gpu``               from ``gpu_bench.json``: images or tokens per second / raw PyTorch.

A benchmark no chart names gets a generic chart of its ratios, named after it (``chart_name``).
:func:`draw` writes the results file's path and date into the PNG (``Source``, ``Creation Time``),
which ``tests/project/test_docs_figures.py`` reads back with :func:`png_text`.

Ratios are drawn with their 95 % confidence intervals (parsed from the rows' notes, where the
benchmark computed one); the ``raw'`` control (raw PyTorch measured against itself in the same
run) is drawn as a grey band: the noise floor, what "no difference" looked like in that run.
Targets are dashed lines. Needs matplotlib (``pip install -e ".[bench]"``); nothing else of the
benchmarks is imported, so plotting works on a machine that cannot run them.

:func:`rows_from_markdown` reads a table printed by ``--markdown`` back into rows (how the
2026-11-21 run became ``results/2026-11-21-cpu.json``).
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["load_results", "rows_from_markdown", "plot_all", "draw", "chart_name", "png_text", "CHARTS", "RESULTS_DIR"]

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
    fig.savefig(path, dpi=110, metadata=dict(_META) or None)
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
    machine, _, rest = (header.get("machine") or header.get("gpu") or "").partition(";")
    load = re.search(r"load average ([\d.]+)", rest)
    machine += f" (load {float(load.group(1)):.1f} at start)" if load else ""
    import textwrap

    return textwrap.fill(f"{when} · torch {torch} · {machine}".strip(" ·"), width=110)  # a long machine wraps


# --------------------------------------------------------------------------------------------
# The charts: one function per chart, registered with the benchmarks whose rows it draws
# --------------------------------------------------------------------------------------------


def _of(rows: Sequence[Dict[str, Any]], *benches: str) -> List[Dict[str, Any]]:
    return [r for r in rows if r["bench"] in benches and "Python calls" not in r["name"]]


def _names(rows: Sequence[Dict[str, Any]]) -> List[str]:
    return list(dict.fromkeys(r["name"] for r in rows))


def _chart_overhead(plt: Any, rows: Sequence[Dict[str, Any]], sub: str, path: str) -> Optional[str]:
    steps = _of(rows, "overhead", "training")
    return _ratio_chart(plt, steps, _names(steps),
                        f"Step time, 1 process, relative to raw PyTorch (CPU time per step), against Accelerate and "
                        f"Fabric\n{sub}", "step time / raw PyTorch", path, "lower is better; 1.0 = raw")


def _chart_ddp(plt: Any, rows: Sequence[Dict[str, Any]], sub: str, path: str) -> Optional[str]:
    ddp = _of(rows, "ddp")
    return _ratio_chart(plt, ddp, _names(ddp), f"2-process CPU DDP training throughput, relative to raw DDP\n{sub}",
                        "samples/s / raw DDP", path, "higher is better; 1.0 = raw")


def _chart_gfm(plt: Any, rows: Sequence[Dict[str, Any]], sub: str, path: str) -> Optional[str]:
    gfm = _of(rows, "gfm")
    return _ratio_chart(plt, gfm, _names(gfm),
                        f"gather_for_metrics over an evaluation epoch, relative to a raw all_gather loop\n"
                        f"(no raw' control in this benchmark) {sub}", "epoch time / raw loop", path,
                        "lower is better; 1.0 = raw")


def _chart_gpu(plt: Any, rows: Sequence[Dict[str, Any]], sub: str, path: str) -> Optional[str]:
    gpu = [r for r in _of(rows, "gpu") if "/s" in (r.get("unit") or "")]
    return _ratio_chart(plt, gpu, _names(gpu),
                        f"GPU training throughput (benchmarks/gpu_bench.py), relative to raw PyTorch\n{sub}",
                        "items/s / raw PyTorch", path, "higher is better; 1.0 = raw")


def _chart_import(plt: Any, rows: Sequence[Dict[str, Any]], sub: str, path: str) -> Optional[str]:
    items = [(r["name"].replace(" (after import torch)", ""), r["value"], r["contender"]) for r in _of(rows, "import")
             if r.get("value") is not None and r.get("unit") == "ms"]
    return _absolute_chart(plt, items, f"Import time on top of `import torch` (fresh interpreters)\n{sub}",
                           "milliseconds (log scale)", path, limit=(50.0, "budget 50 ms"), log=True, unit=" ms")


def _chart_launch(plt: Any, rows: Sequence[Dict[str, Any]], sub: str, path: str) -> Optional[str]:
    launch = [r for r in _of(rows, "launch") if r.get("value") is not None]
    base = next((r["value"] for r in launch if r["contender"] == "torchrun"), None)
    return _absolute_chart(
        plt, [(r["contender"] + (" (1 process only)" if "ONE process" in (r.get("note") or "") else ""),
               r["value"], r["contender"]) for r in launch],
        f"Launcher: start to first collective, 2 CPU processes (median of rounds)\n{sub}", "seconds", path,
        limit=(base + 0.2, "target: torchrun + 0.2 s") if base else None, unit=" s")


def _chart_async(plt: Any, rows: Sequence[Dict[str, Any]], sub: str, path: str) -> Optional[str]:
    """Stall per checkpoint, synchronous against asynchronous, one pair of bars per strategy."""
    rows = [r for r in _of(rows, "async_checkpoint") if r.get("value") is not None]
    names = _names(rows)
    if not names:
        return None
    fig, ax = plt.subplots(figsize=(9.5, 1.1 * len(names) + 1.9))
    labels, y = [], 0
    for name in names:
        for r in (r for r in rows if r["name"] == name):
            is_async = "async" in r["contender"]
            ax.barh(y, r["value"], height=0.62, color=COLORS["anyaccel"] if is_async else "#bbbbbb")
            text = f"  {r['value']:,.0f} ms" + (f"  ({r['ratio']:.3f}× the synchronous stall)"
                                                 if r.get("ratio") is not None else "")
            ax.text(r["value"], y, text, va="center", fontsize=8.5)
            labels.append(f"{name.split(' MiB + Adam, ')[-1].split(', x2')[0].split(' (')[0]}: "
                          f"{'asynchronous' if is_async else 'synchronous'}")
            y += 1
        y += 0.4
    ticks = [i + 0.4 * (i // 2) for i in range(len(labels))]
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(right=max(r["value"] for r in rows) * 1.45)
    ax.set_xlabel("how long save_state holds the training loop, ms (slower of the 2 processes; lower is better)")
    ax.grid(axis="x", alpha=0.3)
    _finish(fig, f"Checkpoint stall: save_state() against save_state(async_save=True), 2 CPU processes\n{sub}", path)
    return path


def _chart_bigmodel(plt: Any, rows: Sequence[Dict[str, Any]], sub: str, path: str) -> Optional[str]:
    """Peak memory per process, grouped by process count: one bar per way of loading, anyaccel's
    bound drawn over its bars."""
    rows = [r for r in _of(rows, "bigmodel") if r.get("value") is not None]
    if not rows:
        return None
    procs = lambda r: int(re.search(r"(\d+) CPU procs", r["name"]).group(1))  # noqa: E731
    label = {"raw": "raw PyTorch (every process reads the whole file)", "accelerate": "Accelerate (rank 0 reads)",
             "anyaccel-broadcast": "anyaccel, rank 0 reads and broadcasts",
             "anyaccel": "anyaccel, each process reads its rows"}
    color = {"raw": "#555555", "accelerate": COLORS["accelerate"], "anyaccel-broadcast": COLORS["proposal"],
             "anyaccel": COLORS["anyaccel"]}
    methods = list(dict.fromkeys(r["contender"] for r in rows))
    counts = sorted({procs(r) for r in rows})
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(9.5, 4.8))
    for j, method in enumerate(methods):
        for i, n in enumerate(counts):
            r = next((r for r in rows if r["contender"] == method and procs(r) == n), None)
            if r is None:
                continue
            x = i + (j - (len(methods) - 1) / 2) * width
            ax.bar(x, r["value"], width=width * 0.92, color=color.get(method, COLORS["other"]),
                   label=label.get(method, method) if i == 0 else None)
            ax.text(x, r["value"], f"{r['value']:,.0f}", ha="center", va="bottom", fontsize=8)
    for i, n in enumerate(counts):
        m = next((re.search(r"bound S/N\+largest\+64MiB = (\d+) MiB", r.get("note") or "") for r in rows
                  if procs(r) == n and r["contender"].startswith("anyaccel")), None)
        if m:
            ax.plot([i - 0.45, i + 0.45], [float(m.group(1))] * 2, ls="--", color="#d62728", lw=1.2,
                    label="anyaccel's bound: S/N + largest tensor + 64 MiB" if i == 0 else None)
    ax.set_xticks(range(len(counts)))
    ax.set_xticklabels([f"{n} processes" for n in counts])
    ax.set_ylim(0, max(r["value"] for r in rows) * 1.18)
    ax.set_ylabel("peak RSS per process over baseline, MiB")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)
    size = re.search(r"load (\d+) MiB", rows[0]["name"])
    _finish(fig, f"Loading a {size.group(1) if size else '?'} MiB checkpoint into FSDP2 shards: peak memory per "
                 f"process (largest rank; lower is better)\n{sub}", path)
    return path


def _chart_faults(plt: Any, rows: Sequence[Dict[str, Any]], sub: str, path: str) -> Optional[str]:
    """Seconds from each fault to a clear end of the job or to its recovery."""
    rows = [r for r in _of(rows, "cluster_faults") if r.get("value") is not None]
    if not rows:
        return None
    kinds = {"clear end": "#d62728", "recovered": "#2ca02c", "finished": COLORS["anyaccel"]}
    fig, ax = plt.subplots(figsize=(9.5, 0.5 * len(rows) + 2.0))
    for i, r in enumerate(rows):
        ax.barh(i, r["value"], height=0.62, color=kinds.get(r["contender"], COLORS["other"]))
        ax.text(r["value"], i, f"  {r['value']:.1f} s: {r['contender']}", va="center", fontsize=8.5)
    for kind, color in kinds.items():
        ax.barh(0, 0, color=color, label=kind)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r["name"] for r in rows], fontsize=8.5)
    ax.invert_yaxis()
    ax.set_xlim(right=max(r["value"] for r in rows) * 1.45)
    ax.set_xlabel("seconds from the fault to the outcome (lower is better)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, frameon=False)
    _finish(fig, f"Faults on the two-host test cluster: time to a clear end or to recovery\n{sub}", path)
    return path


def _chart_sequence(plt: Any, rows: Sequence[Dict[str, Any]], sub: str, path: str) -> Optional[str]:
    """Sequence parallelism: step time against a hand-written Ulysses loop, activation memory per
    rank against one process (the calls rows too: CPU time)."""
    mine = [r for r in _of(rows, "sequence") if r.get("ratio") is not None]
    return _ratio_chart(plt, mine, _names(mine),
                        f"Sequence parallelism (Ulysses, sp 2, 2 CPU processes): step vs a hand-written loop; "
                        f"activation memory per rank vs one process\n{sub}", "ratio to the baseline of each group",
                        path, "step: lower is better, 1.0 = hand-written; memory: 0.5 would be a perfect split")


def _chart_pipeline(plt: Any, rows: Sequence[Dict[str, Any]], sub: str, path: str) -> Optional[str]:
    """Pipeline parallelism: the bubble (idle part of a step) of each schedule as measured, next to
    its theoretical ``(P-1)/(v*m+P-1)`` (the row's note); the step and bytes ratios are in the table."""
    theory = re.compile(r"theory (\d+(?:\.\d+)?)")
    items: List[Tuple[str, float, str]] = []
    for r in _of(rows, "pipeline"):
        if r.get("unit") != "fraction":
            continue
        schedule = r["contender"].replace("anyaccel ", "")
        items.append((f"{schedule}: measured", float(r["value"]), "anyaccel"))
        found = theory.search(r.get("note") or "")
        if found:
            items.append((f"{schedule}: theory", float(found.group(1)), "raw'"))
    return _absolute_chart(plt, items, f"Pipeline parallelism (pp 2, 4 micro-batches, 2 CPU processes): the bubble of "
                           f"each schedule,\nmeasured inside the schedule vs theory\n{sub}",
                           "idle fraction of a step (lower is better)", path)


def _chart_deepspeed(plt: Any, rows: Sequence[Dict[str, Any]], sub: str, path: str) -> Optional[str]:
    """DeepSpeed: anyaccel's step against the same engine driven by hand (ZeRO-2, ZeRO-3), and the
    peak memory per rank of ZeRO-1/2/3 against DDP."""
    mine = [r for r in _of(rows, "deepspeed") if r.get("ratio") is not None]
    return _ratio_chart(plt, mine, _names(mine),
                        f"DeepSpeed on 2 CPU processes: step vs deepspeed.initialize by hand; peak memory per rank vs "
                        f"DDP\n{sub}", "ratio to the baseline of each group", path,
                        "step: 1.0 = the engine by hand; memory: RSS high-water, lower is better")


def _chart_generic(bench: str) -> Callable[[Any, Sequence[Dict[str, Any]], str, str], Optional[str]]:
    def draw(plt: Any, rows: Sequence[Dict[str, Any]], sub: str, path: str) -> Optional[str]:
        mine = [r for r in _of(rows, bench) if r.get("ratio") is not None]
        return _ratio_chart(plt, mine, _names(mine), f"{bench}: ratios to the baseline of each row\n{sub}",
                            "contender / baseline", path, "see each row's target")

    return draw


#: chart name -> (the benchmarks whose rows it draws, how). A benchmark not named here gets a
#: generic chart of its ratios (``_chart_generic``), named after it.
CHARTS: Dict[str, Tuple[Tuple[str, ...], Callable[..., Optional[str]]]] = {
    "overhead": (("overhead", "training"), _chart_overhead),
    "ddp": (("ddp",), _chart_ddp),
    "gfm": (("gfm",), _chart_gfm),
    "gpu": (("gpu",), _chart_gpu),
    "import": (("import",), _chart_import),
    "launch": (("launch",), _chart_launch),
    "async_checkpoint": (("async_checkpoint",), _chart_async),
    "bigmodel": (("bigmodel",), _chart_bigmodel),
    "faults": (("cluster_faults",), _chart_faults),
    "sequence": (("sequence",), _chart_sequence),
    "pipeline": (("pipeline",), _chart_pipeline),
    "deepspeed": (("deepspeed",), _chart_deepspeed),
}


def chart_name(bench: str, rows: Sequence[Dict[str, Any]]) -> Optional[str]:
    """The chart that shows ``bench``: a registered one, else a generic one named after it when its
    rows have ratios, else None."""
    for name, (benches, _) in CHARTS.items():
        if bench in benches:
            return name
    return bench if any(r.get("ratio") is not None for r in rows if r["bench"] == bench) else None


def _draw(plt: Any, chart: str, rows: Sequence[Dict[str, Any]], header: Dict[str, Any], path: str) -> Optional[str]:
    draw = CHARTS[chart][1] if chart in CHARTS else _chart_generic(chart)
    return draw(plt, rows, _subtitle(header), path)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


_META: Dict[str, str] = {}  # PNG text chunks of the chart being saved (read back by the docs' figures test)


def draw(chart: str, results: Any, out_dir: str) -> str:
    """Draw one chart from a :class:`benchmarks.figures.Results` into ``out_dir/<chart>.png``; the
    PNG's ``Source`` names the results file and ``Creation Time`` its date. Returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{chart}.png")
    _META.clear()
    _META.update({"Source": results.relpath(), "Creation Time": results.date})
    try:
        written = _draw(_pyplot(), chart, results.rows, results.header, path)
    finally:
        _META.clear()
    if written is None:
        raise ValueError(f"{results.relpath()} has no rows to draw the {chart} chart from")
    return path


def png_text(path: str) -> Dict[str, str]:
    """The tEXt chunks of a PNG (no matplotlib needed): how a test reads a chart's ``Source``."""
    import struct

    out: Dict[str, str] = {}
    with open(path, "rb") as f:
        data = f.read()
    pos = 8
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"tEXt":
            key, _, val = data[pos + 8:pos + 8 + length].partition(b"\0")
            out[key.decode("latin-1")] = val.decode("latin-1")
        pos += 12 + length
    return out


def plot_all(results: Dict[str, Any], out_dir: str) -> List[str]:
    """Write every chart the rows allow into ``out_dir``; returns the paths written."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    rows, header = results["rows"], results.get("header", {})
    charts = list(CHARTS) + [b for b in dict.fromkeys(r["bench"] for r in rows)
                             if chart_name(b, rows) == b and b not in CHARTS]
    written = [_draw(plt, chart, rows, header, os.path.join(out_dir, f"{chart}.png")) for chart in charts]
    return [p for p in written if p]
