"""Every benchmark figure in the README and the docs is the one in its results file (issue 33).

Pages quote figures only inside figures blocks (``<!-- figures VIEW ... -->``), which
``python -m benchmarks`` writes from the newest results file holding the block's benchmarks
(benchmarks/figures.py); the charts a block embeds are drawn from the same file and say so in their
PNG metadata. These tests re-render every block and compare; they need neither Sphinx nor matplotlib.
"""

from __future__ import annotations

import json
import re
import shutil
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.skipif(not (ROOT / "benchmarks" / "figures.py").exists(), reason="no benchmarks/")
if str(ROOT) not in sys.path:  # the benchmarks package lives beside anyaccel, not inside it
    sys.path.insert(0, str(ROOT))
from benchmarks import figures, plot  # noqa: E402

RATIO = re.compile(r"\b\d\.\d{2,3}\s?[×x](?![\w-])")
HISTORY = "docs/status/history.md"  # figures of earlier runs, kept as they were written


def _outside_blocks(text: str) -> str:
    """``text`` with every figures block cut out."""
    return re.sub(r"<!-- figures [^>]*-->.*?<!-- /figures -->", "", text, flags=re.S)


def test_every_figures_block_is_what_its_results_file_gives():
    stale = figures.stale()
    assert not stale, ("pages differ from the results files they quote; run `python -m benchmarks --publish` "
                       "(no run) and commit what it changed:\n" + "\n".join(stale))


def test_no_benchmark_is_quoted_from_two_results_files():
    """The issue's README-vs-benchmarks-page disagreement: after an `--only` run, a block of several
    benchmarks may still quote the previous run while a block of one quotes the new one."""
    found = figures.conflicts()
    assert not found, "\n".join(found)


def test_the_conflict_check_can_fail(tmp_path):
    newest = figures.newest_with(["overhead"], figures.all_results())
    later = figures.Results(str(tmp_path / "later.json"), {**newest.header, "date": "2099-01-01 00:00"},
                            tuple(r for r in newest.rows if r["bench"] == "overhead"))
    root = _site(tmp_path, "<!-- figures summary -->\n<!-- /figures -->\n<!-- figures table bench=overhead -->\n"
                           "<!-- /figures -->\n")
    found = figures.conflicts(figures.all_results() + [later], root)
    assert len(found) == 1 and found[0].startswith("`overhead` is quoted from 2 results files"), found
    assert "--only ddp,gfm,import,launch,notebook,overhead`" in found[0]


def test_the_main_pages_have_their_blocks():
    for page, view in (("README.md", "summary"), ("docs/status/benchmarks.md", "steps"),
                       ("docs/guides/checkpoints.md", "async_checkpoint"), ("docs/guides/big-models.md", "bigmodel"),
                       ("docs/guides/cluster.md", "faults")):
        views = [b.view for b in figures.blocks(page, (ROOT / page).read_text())]
        assert view in views, f"{page} has lost its `<!-- figures {view} -->` block"


def test_every_chart_a_block_embeds_was_drawn_from_that_blocks_file():
    needed = figures.charts_needed(figures.all_results())
    assert {"overhead"} <= set(needed), needed
    for chart, source in needed.items():
        path = ROOT / "benchmarks" / "charts" / f"{chart}.png"
        assert path.exists(), f"{path.relative_to(ROOT)} is missing: run `python -m benchmarks --publish`"
        meta = plot.png_text(str(path))
        assert (meta.get("Source"), meta.get("Creation Time")) == (source.relpath(), source.date), (
            f"{path.relative_to(ROOT)} was drawn from {meta.get('Source')} ({meta.get('Creation Time')}), but the "
            f"blocks embedding it quote {source.relpath()} ({source.date}): run `python -m benchmarks --publish`")


def test_no_ratio_is_typed_into_a_page_outside_a_block():
    typed = []
    for page in figures.pages():
        if page == HISTORY:
            continue
        text = _outside_blocks((ROOT / page).read_text())
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # code and command output may show any number
        for m in RATIO.finditer(text):
            line = text[:m.start()].count("\n") + 1
            typed.append(f"{page}: {m.group(0)!r} near {text[max(0, m.start() - 60):m.end() + 20]!r} (line ~{line})")
    assert not typed, ("benchmark ratios typed by hand (quote them through a figures block, "
                       "benchmarks/figures.py, or link to docs/status/benchmarks.md):\n" + "\n".join(typed))


def test_one_date_per_block():
    for page in figures.pages():
        for block in figures.blocks(page, (ROOT / page).read_text()):
            dates = set(re.findall(r"\b20\d\d-\d\d-\d\d\b", block.text))
            assert len(dates) <= 1, f"{page}: the block `{block.spec}` shows {sorted(dates)}"


def _site(tmp_path, page_text: str):
    """A repository root with one page and the real results files."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(page_text)
    return str(tmp_path)


def test_the_check_finds_a_figure_changed_by_hand(tmp_path):
    results = figures.all_results()
    root = _site(tmp_path, "# x\n\n<!-- figures summary -->\n<!-- /figures -->\n")
    assert figures.stale(results, root) and figures.publish(results, root, draw=False) == ["README.md"]
    assert figures.stale(results, root) == []
    page = tmp_path / "README.md"
    text = page.read_text()
    number = re.search(r"\*\*(\d\.\d{3})×\*\*", text).group(1)
    page.write_text(text.replace(f"**{number}×**", "**0.500×**", 1))
    assert figures.stale(results, root) == ["README.md: the block `<!-- figures summary -->` differs from its results file"]


def test_a_new_benchmark_reaches_a_page_through_the_generic_view(tmp_path):
    """A suite added to BENCHMARKS (benchmarks/ring_attention.py, say) needs no change here: its rows are
    in the next results file, and `<!-- figures table bench=NAME -->` shows them with a chart."""
    rows = [{"bench": "ring_attention", "name": "1F1B step, 2 stages", "contender": "raw", "value": 412.0,
             "unit": "ms/step", "ratio": None, "baseline": None, "target": None, "ok": None, "note": ""},
            {"bench": "ring_attention", "name": "1F1B step, 2 stages", "contender": "anyaccel", "value": 415.5,
             "unit": "ms/step", "ratio": 1.0085, "baseline": "raw", "target": "<= 1.02", "ok": True,
             "note": "95% CI 0.990-1.020"}]
    results_dir = tmp_path / "results"
    path = figures.write_results({"date": "2031-01-02 03:04", "machine": "a test box; load average 1.0 at start",
                                  "torch": "9.9"}, rows, {}, directory=str(results_dir))
    assert path.endswith("2031-01-02-0304-cpu.json") and json.loads(open(path).read())["rows"] == rows
    results = figures.all_results(str(results_dir)) + figures.all_results()
    (tmp_path / "site").mkdir()
    root = _site(tmp_path / "site", "<!-- figures table bench=ring_attention -->\n<!-- /figures -->\n")
    figures.publish(results, root, draw=False)
    text = (tmp_path / "site" / "README.md").read_text()
    assert "Measured **2031-01-02 03:04** on a test box (load average 1.0 at start)" in text
    assert "| 1F1B step, 2 stages | anyaccel | 416 ms/step | 1.008 | raw | <= 1.02 (met) |" in text
    assert "![ring_attention chart" in text  # a generic chart of its ratios (plot.chart_name)
    assert figures.newest_with(["ring_attention"], results).path == path


def test_a_block_without_results_says_how_to_get_them(tmp_path):
    root = _site(tmp_path, "<!-- figures table bench=no_such_bench -->\n<!-- /figures -->\n")
    figures.publish(figures.all_results(), root, draw=False)
    assert "`python -m benchmarks --only no_such_bench` writes one" in (tmp_path / "README.md").read_text()


def test_quick_runs_are_never_quoted(tmp_path):
    src = sorted((ROOT / "benchmarks" / "results").glob("*-cpu.json"))[-1]
    data = json.loads(src.read_text())
    data["header"] = {**data["header"], "date": "2099-01-01 00:00", "quick": True}
    shutil.copy(src, tmp_path / "a.json")
    (tmp_path / "b.json").write_text(json.dumps(data))
    assert [r.date for r in figures.all_results(str(tmp_path))] == [json.loads(src.read_text())["header"]["date"]]
