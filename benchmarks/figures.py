"""Every performance figure in the README and the docs, from one dated results file.

A page quotes benchmark figures only inside a *figures block*, which ``python -m benchmarks``
writes (never a person)::

    <!-- figures VIEW [bench=NAME] [chart=no] -->
    ... generated: a date line naming the machine and the results file, a table, a chart ...
    <!-- /figures -->

* **Results files** (``benchmarks/results/*.json``) are written by ``python -m benchmarks`` at the
  end of every run that is not ``--quick`` (``{"header": {...}, "rows": [...]}``, rows as
  :func:`benchmarks.common.row` makes them); the two-host cluster tests write ``*-cluster.json``
  the same way. They are never edited.
* **A block's source** is the newest results file that holds rows of every benchmark the block
  shows (``VIEWS[view].benches``, or ``bench=``): one file, so one date per table, the machine named
  in the block's first line. A later ``--only overhead`` run refreshes the blocks about ``overhead``
  and leaves the others on the run that measured them.
* **Charts** embedded in a block are drawn (:mod:`benchmarks.plot`) from the block's source file in
  the same run; each PNG names that file in its metadata (``Source``).
* ``python -m benchmarks --publish`` redraws the charts and rewrites every block from the saved
  results without running anything. ``tests/project/test_docs_figures.py`` re-renders every block and
  compares it with the page, and compares each embedded chart's ``Source`` with the block's file.

**A new benchmark** (a ``BENCHMARKS`` entry in ``benchmarks/__main__.py``) needs nothing here: its
rows land in the results file, and ``<!-- figures table bench=NAME -->`` on a page shows them
(with a chart of its ratios, when it has any). A dedicated layout is a function in ``VIEWS``.
Nothing here imports torch or the benchmarks themselves; plotting needs matplotlib.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO, "benchmarks", "results")
CHARTS_DIR = os.path.join(REPO, "benchmarks", "charts")

#: Where pages with blocks live (every Markdown file under these, plus the README).
PAGE_ROOTS = ("README.md", "docs", "benchmarks/README.md")

BEGIN = re.compile(r"^<!-- figures (?P<spec>[^>]*?) -->[ \t]*$", re.M)
END = "<!-- /figures -->"
NOTICE = "<!-- written by `python -m benchmarks` from the results file named below; do not edit -->"
NOISE_FLOOR = ("raw′ is raw PyTorch timed a second time, as its own contender, in the same rounds: how far apart "
               "two identical loops land on this machine (the noise floor)")


# --------------------------------------------------------------------------------------------
# Results files
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Results:
    """One results file: where it is, its header, its rows."""

    path: str
    header: Dict[str, Any]
    rows: Tuple[Dict[str, Any], ...]

    @property
    def benches(self) -> List[str]:
        return list(dict.fromkeys(r["bench"] for r in self.rows))

    @property
    def date(self) -> str:
        return str(self.header.get("date", "?"))

    def relpath(self) -> str:
        return os.path.relpath(self.path, REPO).replace(os.sep, "/")


def load(path: str) -> Results:
    """A results file written by ``python -m benchmarks`` (or ``gpu_bench.py``'s ``gpu_bench.json``)."""
    with open(path) as f:
        data = json.load(f)
    if "rows" not in data:
        raise ValueError(f"{path} has no 'rows': not a file written by `python -m benchmarks`")
    header = data.get("header") or {k: v for k, v in data.items() if k != "rows"}
    return Results(os.path.abspath(path), dict(header), tuple(data["rows"]))


def all_results(directory: str = RESULTS_DIR) -> List[Results]:
    """Every results file in ``directory`` that is not a ``--quick`` run, oldest first (by the date
    in its header, then by name)."""
    found = [load(p) for p in glob.glob(os.path.join(directory, "*.json"))]
    found = [r for r in found if not r.header.get("quick")]
    return sorted(found, key=lambda r: (r.date, os.path.basename(r.path)))


def newest_with(benches: Sequence[str], results: Sequence[Results]) -> Optional[Results]:
    """The newest of ``results`` with rows of every benchmark in ``benches`` (None if none has)."""
    for r in reversed(results):
        have = set(r.benches)
        if all(b in have for b in benches):
            return r
    return None


def results_name(header: Dict[str, Any], kind: str) -> str:
    """The file name of a new results file: ``<date>-<HHMM>-<kind>.json``."""
    return re.sub(r"[^0-9A-Za-z-]", "", header["date"].replace(" ", "-").replace(":", "")) + f"-{kind}.json"


def write_results(header: Dict[str, Any], rows: Sequence[Dict[str, Any]], seconds: Dict[str, float],
                  kind: str = "cpu", directory: str = RESULTS_DIR) -> str:
    """Write a new results file into ``directory``; return its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, results_name(header, kind))
    with open(path, "w") as f:
        json.dump({"header": header, "seconds": seconds, "rows": list(rows)}, f, indent=1)
        f.write("\n")
    return path


# --------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------


def number(x: Optional[float], unit: str = "") -> str:
    """``1,274``, ``19.8``, ``9.2``, ``0.312`` (+ unit): three significant digits, none after the point
    from 100 on."""
    if x is None:
        return "—"
    text = f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"
    return f"{text} {unit}".strip()


def ratio(r: Optional[Dict[str, Any]], bold: bool = False, ci: bool = True) -> str:
    """A row's ratio as ``0.999×`` (with its 95 % CI when the row has one)."""
    if r is None:
        return "—"
    if r.get("ratio") is None:
        return _missing(r)
    text = f"{r['ratio']:.3f}×"
    text = f"**{text}**" if bold else text
    m = re.search(r"95% CI (\d+(?:\.\d+)?)-(\d+(?:\.\d+)?)", r.get("note") or "")
    return f"{text} (CI {m.group(1)}–{m.group(2)})" if (ci and m) else text


def value(r: Optional[Dict[str, Any]], bold: bool = False) -> str:
    if r is None:
        return "—"
    if r.get("value") is None:
        return _missing(r)
    unit = r.get("unit") or ""
    if unit == "s" and abs(r["value"]) < 1:  # 0.0308 s reads better as 31 ms
        text = number(r["value"] * 1e3, "ms")
    else:
        text = number(r["value"], _short_unit(unit))
    return f"**{text}**" if bold else text


def _short_unit(unit: str) -> str:
    return unit.replace("us/", "µs/").replace("us ", "µs ")


def _missing(r: Dict[str, Any]) -> str:
    note = (r.get("note") or "").strip()
    if "not installed" in note:
        return "not installed"
    return f"not measured ({note[:80]})" if note else "not measured"


def cell(text: Any) -> str:
    """Text for one Markdown table cell; command-line flags as code (a site would make ``--`` a dash)."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    return re.sub(r"(?<![`\w])(--[a-z][\w-]*(?: \d+)?)", r"`\1`", text)


def contender_label(name: str) -> str:
    return {"raw'": "raw′", "accelerate": "Accelerate", "fabric": "Lightning Fabric",
            "lightning": "Lightning Fabric"}.get(name, name)


def find(rows: Iterable[Dict[str, Any]], bench: str, name: Optional[str] = None, contender: Optional[str] = None,
         name_starts: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """The first row of ``bench`` matching the given name / contender (None if none)."""
    for r in rows:
        if r["bench"] != bench:
            continue
        if name is not None and r["name"] != name:
            continue
        if name_starts is not None and not r["name"].startswith(name_starts):
            continue
        if contender is not None and r["contender"] != contender:
            continue
        return r
    return None


def date_line(source: Results, page: str) -> str:
    """The one date of a block: when, on what machine, which file."""
    h = {**(source.header.get("versions") or {}), **source.header}  # gpu_bench.json nests the versions
    machine, _, load = str(h.get("machine") or h.get("gpu") or h.get("host") or "machine not recorded").partition(";")
    versions = [f"torch {h['torch']}" if h.get("torch") else ""]
    for key, label in (("accelerate", "Accelerate"), ("lightning", "Lightning")):
        if h.get(key):
            versions.append(f"{label} {h[key]}")
    link = os.path.relpath(source.path, os.path.dirname(os.path.join(REPO, page))).replace(os.sep, "/")
    converted = " (converted from a table printed by that run; its JSON was not kept)" if h.get("source") else ""
    parts = [f"Measured **{source.date}** on {machine.strip()}"]
    if load.strip():
        parts.append(f"({load.strip()})")
    versions = [v for v in versions if v]
    return (" ".join(parts) + (f"; {', '.join(versions)}" if versions else "") + f". Results file: "
            f"[`{source.relpath()}`]({link}){converted}.")


# --------------------------------------------------------------------------------------------
# Views: how a block shows its rows
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class View:
    """A block layout: the benchmarks it needs (all from one file), how it renders, its chart."""

    benches: Tuple[str, ...]
    render: Callable[[Results, Dict[str, str]], List[str]]
    chart: Optional[str] = None  # a chart name of benchmarks.plot.CHARTS, embedded below the table


def _summary(src: Results, opts: Dict[str, str]) -> List[str]:
    rows = src.rows
    out = ["| | anyaccel | Accelerate | Lightning Fabric |", "|---|---|---|---|"]
    for label, name in (("tiny (64-wide) MLP", "tiny MLP step"), ("medium MLP", "medium MLP step")):
        floor = find(rows, "overhead", name, "raw'")
        out.append(f"| step time, {label}, 1 process (raw PyTorch = 1; raw′ = {ratio(floor, ci=False)}) "
                   f"| {ratio(find(rows, 'overhead', name, 'anyaccel'), bold=True, ci=False)} "
                   f"| {ratio(find(rows, 'overhead', name, 'accelerate'), ci=False)} "
                   f"| {ratio(find(rows, 'overhead', name, 'fabric'), ci=False)} |")
    facade = find(rows, "import", "from anyaccel import Accelerator (after import torch)")
    out.append(f"| import on top of `import torch` "
               f"| {value(find(rows, 'import', 'import anyaccel (after import torch)'), bold=True)} "
               f"(`from anyaccel import Accelerator`: {value(facade)}) "
               f"| {value(find(rows, 'import', 'import accelerate (after import torch)'))} "
               f"| {value(find(rows, 'import', name_starts='from lightning.fabric import Fabric'))} |")
    torchrun = find(rows, "launch", contender="torchrun")
    cpu = find(rows, "launch", contender="accelerate launch --cpu")
    accel = find(rows, "launch", contender="accelerate launch --multi_gpu")
    accel_text = value(accel) + (" (`--multi_gpu`; `--cpu` starts one process)"
                                 if cpu is not None and "ONE process" in (cpu.get("note") or "") else "")
    out.append(f"| 2 CPU processes, launcher start to first collective (torchrun: {value(torchrun)}) "
               f"| {value(find(rows, 'launch', contender='anyaccel launch (torch probe)'), bold=True)} "
               f"| {accel_text} | {value(find(rows, 'launch', contender='fabric run'))} |")
    base = find(rows, "notebook", contender="torch.multiprocessing")
    out.append(f"| `notebook_launcher`, 2 CPU processes, call to first collective (torch.multiprocessing: "
               f"{value(base)}) | {value(find(rows, 'notebook', contender='anyaccel'), bold=True)} "
               f"| {value(find(rows, 'notebook', contender='accelerate'))} "
               f"| {value(find(rows, 'notebook', contender='fabric'))} |")
    name = "2-proc DDP train, tiny MLP"
    floor = find(rows, "ddp", name, "raw'")
    out.append(f"| 2-process DDP throughput, tiny MLP (raw DDP = 1; raw′ = {ratio(floor, ci=False)}; higher is better) "
               f"| {ratio(find(rows, 'ddp', name, 'anyaccel'), bold=True, ci=False)} "
               f"| {ratio(find(rows, 'ddp', name, 'accelerate'), ci=False)} "
               f"| {ratio(find(rows, 'ddp', name, 'fabric'), ci=False)} |")
    out.append(f"| `gather_for_metrics` over an evaluation epoch (a raw all_gather loop = 1) "
               f"| {ratio(find(rows, 'gfm', contender='anyaccel'), bold=True, ci=False)} "
               f"| {ratio(find(rows, 'gfm', contender='accelerate'), ci=False)} | — |")
    out += ["", "Ratios are anyaccel (or a peer) over raw PyTorch doing the same work in the same run; times "
            "are medians over rounds in which the contenders alternate. " + NOISE_FLOOR + "."]
    return out


def _steps(src: Results, opts: Dict[str, str]) -> List[str]:
    rows = [r for r in src.rows if r["bench"] in ("overhead", "training")]
    names = list(dict.fromkeys(r["name"] for r in rows if "Python calls" not in r["name"]))
    peers = [c for c in ("accelerate", "fabric") if any(r["contender"] == c for r in rows)]
    out = ["| step (1 process) | raw PyTorch | raw′ | anyaccel | " + " | ".join(contender_label(p) for p in peers) + " |",
           "|" + "---|" * (4 + len(peers))]
    for name in names:
        bench = _bench(rows, name)
        cells = [cell(name), value(find(rows, bench, name, "raw")), ratio(find(rows, bench, name, "raw'"), ci=False),
                 ratio(find(rows, bench, name, "anyaccel"), bold=True)]
        cells += [ratio(find(rows, bench, name, p), ci=False) if find(rows, bench, name, p) else "—" for p in peers]
        out.append("| " + " | ".join(cells) + " |")
    calls = [r for r in rows if "Python calls" in r["name"] and r.get("ratio") is not None]
    if calls:
        first = calls[0]["name"]
        parts = [f"{contender_label(r['contender'])} {(r.get('note') or '').split(' calls')[0]}"
                 for r in calls if r["name"] == first]
        out += ["", f"Python function calls per step against the raw loop ({cell(first.split(':')[0])}; cProfile, "
                "deterministic, so no other job on the machine can move it): " + ", ".join(parts) + "."]
    out += ["", "CPU time per step over raw PyTorch's (< 1 is faster); 95 % confidence interval of the median "
            "per-round ratio in brackets. " + NOISE_FLOOR + "."]
    return out


def _bench(rows: Sequence[Dict[str, Any]], name: str) -> str:
    return next(r["bench"] for r in rows if r["name"] == name)


def _table(src: Results, opts: Dict[str, str]) -> List[str]:
    benches = _benches_of("table", opts)
    rows = [r for r in src.rows if r["bench"] in benches]
    out = ["| what | contender | median | ratio | vs | target |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append("| " + " | ".join(cell(c) for c in (
            r["name"], contender_label(r["contender"]), value(r),
            "" if r.get("ratio") is None else f"{r['ratio']:.3f}", contender_label(r.get("baseline") or ""),
            _target(r))) + " |")
    return out + _notes(rows)


def _target(r: Optional[Dict[str, Any]]) -> str:
    if r is None or not r.get("target"):
        return ""
    return r["target"] + {True: " (met)", False: " (**missed**)"}.get(r.get("ok"), "")


def _notes(rows: Sequence[Dict[str, Any]], label: Callable[[Dict[str, Any]], str] = None) -> List[str]:
    """The rows' notes as a list under the table (long text in a cell squeezes the numbers)."""
    label = label or (lambda r: f"{r['name']}, {contender_label(r['contender'])}")
    notes = [f"- {cell(label(r))}: {cell(r['note'])}" for r in rows if (r.get("note") or "").strip()]
    return ["", "Notes of the rows (as the benchmark wrote them):", ""] + notes if notes else []


def _async_checkpoint(src: Results, opts: Dict[str, str]) -> List[str]:
    rows = [r for r in src.rows if r["bench"] == "async_checkpoint"]
    out = ["| 2 processes | synchronous `save_state` stall | asynchronous stall | ratio | target |",
           "|---|---|---|---|---|"]
    shown = []
    for name in dict.fromkeys(r["name"] for r in rows):
        sync = find(rows, "async_checkpoint", name, "sync save_state")
        a = find(rows, "async_checkpoint", name, "save_state(async_save=True)")
        out.append(f"| {cell(_strategy(name))} | {value(sync)} | {value(a, bold=True)} | {ratio(a, ci=False)} "
                   f"| {cell(_target(a))} |")
        shown += [r for r in (a, sync) if r is not None]
    out += ["", "Stall: how long `save_state` holds the training loop on the slower process, median of the rounds."]
    return out + _notes(shown, lambda r: f"{_strategy(r['name'])}, {r['contender']}")


def _strategy(name: str) -> str:
    """``DDP (full state, main process writes)`` out of an async_checkpoint row's name."""
    return name.split(" + Adam, ")[-1].split(", x2")[0]


def _bigmodel(src: Results, opts: Dict[str, str]) -> List[str]:
    rows = [r for r in src.rows if r["bench"] == "bigmodel"]
    methods = list(dict.fromkeys(r["contender"] for r in rows))
    label = {"raw": "raw PyTorch (every process reads the file)", "accelerate": "Accelerate (rank 0 reads)",
             "anyaccel-broadcast": "anyaccel, rank 0 broadcasts", "anyaccel": "anyaccel, each rank reads its rows"}
    out = ["| processes | " + " | ".join(label.get(m, m) for m in methods) + " | anyaccel's bound: S/N + largest "
           "tensor + 64 MiB |", "|---" * (len(methods) + 2) + "|"]
    for name in dict.fromkeys(r["name"] for r in rows):
        m = re.search(r"(\d+) CPU procs", name)
        cells = [m.group(1) if m else cell(name)]
        bound = ""
        for method in methods:
            r = find(rows, "bigmodel", name, method)
            text = value(r, bold=method.startswith("anyaccel")).replace(" peak RSS over baseline (max rank)", "")
            if r is not None and r.get("ratio") is not None:
                text += f" ({r['ratio']:.2f}× raw)"
            cells.append(text)
            b = re.search(r"bound S/N\+largest\+64MiB = (\d+) MiB: (met|NOT met)", (r or {}).get("note") or "")
            if b and method == "anyaccel":
                bound = f"{b.group(1)} MiB: {b.group(2)}"
        out.append("| " + " | ".join(cells + [bound]) + " |")
    first = next((r for r in rows if r.get("value") is not None), None)
    size = re.search(r"load (\d+) MiB", first["name"]).group(1) if first else "?"
    out += ["", f"Peak resident memory per process (the largest rank) over what it held before loading a {size} MiB "
            "safetensors checkpoint into FSDP2 shards. Each row's note in the results file has the proof (the bytes "
            "of shards each rank holds, every shard compared with the file) and the time to the first step."]
    return out


def _faults(src: Results, opts: Dict[str, str]) -> List[str]:
    rows = [r for r in src.rows if r["bench"] == "cluster_faults"]
    out = ["| fault | outcome | time (measured) | steps lost |", "|---|---|---|---|"]
    for r in rows:
        time = value(r, bold=True) if r.get("value") is not None else "(set by the test)"
        out.append(f"| {cell(r['name'])} | {cell(r['contender'])} | {time} | {cell(r.get('steps_lost', ''))} |")
    return out + ["", "What each test saw:", ""] + [f"- {cell(r['name'].split(')')[0] + ')')} {cell(r['note'])}"
                                                     for r in rows if r.get("note")]


def _benches_of(view: str, opts: Dict[str, str]) -> Tuple[str, ...]:
    if opts.get("bench"):
        return tuple(b.strip() for b in opts["bench"].split(",") if b.strip())
    return VIEWS[view].benches


VIEWS: Dict[str, View] = {
    "summary": View(("overhead", "import", "launch", "notebook", "ddp", "gfm"), _summary),
    "steps": View(("overhead", "training"), _steps, chart="overhead"),
    "table": View((), _table),  # bench=NAME[,NAME]: any benchmark's rows, as they are
    "async_checkpoint": View(("async_checkpoint",), _async_checkpoint, chart="async_checkpoint"),
    "bigmodel": View(("bigmodel",), _bigmodel, chart="bigmodel"),
    "faults": View(("cluster_faults",), _faults, chart="faults"),
}


def chart_for(view: str, opts: Dict[str, str], source: Optional[Results]) -> Optional[str]:
    """The chart a block embeds (a name in benchmarks.plot's registry), or None."""
    if opts.get("chart") == "no" or source is None:
        return None
    if opts.get("chart"):
        return opts["chart"]
    if VIEWS[view].chart:
        return VIEWS[view].chart
    from benchmarks import plot

    benches = _benches_of(view, opts)
    if len(benches) == 1:
        return plot.chart_name(benches[0], [r for r in source.rows if r["bench"] == benches[0]])
    return None


# --------------------------------------------------------------------------------------------
# Blocks in pages
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    spec: str
    start: int  # offsets of the text between the BEGIN line and END
    end: int
    text: str

    @property
    def view(self) -> str:
        return self.spec.split()[0]

    @property
    def opts(self) -> Dict[str, str]:
        return dict(p.split("=", 1) for p in self.spec.split()[1:] if "=" in p)


def pages(root: str = REPO) -> List[str]:
    """Every Markdown page that may hold blocks (relative paths)."""
    found = []
    for entry in PAGE_ROOTS:
        path = os.path.join(root, entry)
        if os.path.isfile(path):
            found.append(entry)
        for p in sorted(glob.glob(os.path.join(path, "**", "*.md"), recursive=True)):
            rel = os.path.relpath(p, root).replace(os.sep, "/")
            if "/_build/" not in rel and "/generated/" not in rel:
                found.append(rel)
    return found


def blocks(page: str, text: str) -> List[Block]:
    """The figures blocks of one page's ``text``."""
    found = []
    for m in BEGIN.finditer(text):
        end = text.find(END, m.end())
        if end < 0:
            raise ValueError(f"{page}: `<!-- figures {m.group('spec')} -->` has no `{END}` after it")
        spec = m.group("spec").strip()
        if not spec or spec.split()[0] not in VIEWS:
            raise ValueError(f"{page}: unknown figures view {spec!r}; views: {', '.join(VIEWS)} "
                             f"(benchmarks/figures.py)")
        found.append(Block(page, spec, m.end(), end, text[m.end():end]))
    return found


def source_of(block: Block, results: Sequence[Results]) -> Optional[Results]:
    return newest_with(_benches_of(block.view, block.opts), results)


def render(block: Block, results: Sequence[Results]) -> str:
    """The text between a block's two marker lines, from its source file."""
    benches = _benches_of(block.view, block.opts)
    if not benches:
        raise ValueError(f"{block.page}: `<!-- figures {block.spec} -->` needs bench=NAME")
    src = newest_with(benches, results)
    lines = [NOTICE, ""]
    if src is None:
        lines.append(f"*Not measured yet: no results file in `benchmarks/results/` has rows of "
                     f"{', '.join(f'`{b}`' for b in benches)}; `python -m benchmarks --only {','.join(benches)}` "
                     f"writes one.*")
        return "\n" + "\n".join(lines) + "\n\n"
    lines += [date_line(src, block.page), ""]
    body = VIEWS[block.view].render(src, block.opts)
    if block.page.startswith("docs/"):  # the site (MyST attrs_block) gets table.figures: cells keep their words
        body = [("{.figures}\n" + line) if line.startswith("| ") and (i == 0 or not body[i - 1].startswith("|"))
                else line for i, line in enumerate(body)]
    lines += body
    chart = chart_for(block.view, block.opts, src)
    if chart:
        link = os.path.relpath(os.path.join(CHARTS_DIR, chart + ".png"),
                               os.path.dirname(os.path.join(REPO, block.page))).replace(os.sep, "/")
        lines += ["", f"![{chart} chart, drawn from the same results file]({link})"]
    return "\n" + "\n".join(lines) + "\n\n"


def charts_needed(results: Sequence[Results], root: str = REPO) -> Dict[str, Results]:
    """{chart name: the results file it is drawn from} for every chart a block embeds."""
    needed: Dict[str, Results] = {}
    for page in pages(root):
        with open(os.path.join(root, page)) as f:
            text = f.read()
        for block in blocks(page, text):
            src = source_of(block, results)
            chart = chart_for(block.view, block.opts, src)
            if chart and src is not None:
                other = needed.setdefault(chart, src)
                if other.path != src.path:
                    raise ValueError(f"chart {chart}.png is embedded by blocks whose sources differ "
                                     f"({other.relpath()} and {src.relpath()}, in {page}); give them the same benches")
    return needed


def conflicts(results: Optional[Sequence[Results]] = None, root: str = REPO) -> List[str]:
    """One line per benchmark that blocks quote from different results files (a later ``--only``
    run refreshed a single-benchmark block while a block showing several still quotes the run
    before): the same figure would differ between pages. A run of the benchmarks of every block
    involved (or a full run) settles it."""
    results = all_results() if results is None else results
    sources: Dict[str, Dict[str, List[str]]] = {}
    for page in pages(root):
        with open(os.path.join(root, page)) as f:
            text = f.read()
        for block in blocks(page, text):
            src = source_of(block, results)
            if src is None:
                continue
            for bench in _benches_of(block.view, block.opts):
                sources.setdefault(bench, {}).setdefault(src.relpath(), []).append(f"{page} ({block.spec})")
    out = []
    for bench, by_file in sources.items():
        if len(by_file) > 1:
            where = "; ".join(f"{path}: {', '.join(blocks_)}" for path, blocks_ in sorted(by_file.items()))
            needed = sorted({b for bs in by_file.values() for x in bs for b in _spec_benches(x)} | {bench})
            out.append(f"`{bench}` is quoted from {len(by_file)} results files ({where}); "
                       f"`python -m benchmarks --only {','.join(needed)}` (or a full run) puts them on one")
    return out


def _spec_benches(where: str) -> Tuple[str, ...]:
    spec = where[where.index("(") + 1:-1]
    view, opts = spec.split()[0], dict(p.split("=", 1) for p in spec.split()[1:] if "=" in p)
    return _benches_of(view, opts)


def publish(results: Optional[Sequence[Results]] = None, root: str = REPO, draw: bool = True) -> List[str]:
    """Rewrite every block of every page from ``results`` (default: all saved results files) and,
    with ``draw``, redraw the charts they embed from the same files. Returns what changed."""
    results = all_results() if results is None else results
    changed = []
    if draw:
        from benchmarks import plot

        for chart, src in charts_needed(results, root).items():
            changed.append(plot.draw(chart, src, CHARTS_DIR))
    for page in pages(root):
        path = os.path.join(root, page)
        with open(path) as f:
            text = f.read()
        new, pos = [], 0
        for block in blocks(page, text):
            new += [text[pos:block.start], render(block, results)]
            pos = block.end
        new.append(text[pos:])
        updated = "".join(new)
        if updated != text:
            with open(path, "w") as f:
                f.write(updated)
            changed.append(page)
    return changed


def stale(results: Optional[Sequence[Results]] = None, root: str = REPO) -> List[str]:
    """One line per block whose text differs from what its results file gives (empty: all current)."""
    results = all_results() if results is None else results
    out = []
    for page in pages(root):
        with open(os.path.join(root, page)) as f:
            text = f.read()
        for block in blocks(page, text):
            if block.text != render(block, results):
                out.append(f"{page}: the block `<!-- figures {block.spec} -->` differs from its results file")
    return out
