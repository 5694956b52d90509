"""``python -m benchmarks --plot DIR``: charts from saved results (needs matplotlib, the ``bench`` extra)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, clean_env

TABLE = """
| bench | what | contender | median | ratio | vs | target | verdict | note |
|---|---|---|---|---|---|---|---|---|
| overhead | tiny MLP step | raw | 591.8 us/step (CPU) | - |  |  |  |  |
| overhead | tiny MLP step | raw' | 595.5 us/step (CPU) | 1.004 | raw |  |  | noise floor (raw vs raw); 95% CI 1.001-1.007 |
| overhead | tiny MLP step | anyaccel | 598.9 us/step (CPU) | 1.014 | raw | <= 1.02 | ok | 95% CI 1.009-1.017 |
| import | from lightning.fabric import Fabric (after import torch) | lightning | 2,057 ms | - |  |  |  | +1994 modules |
"""


def test_markdown_rows_keep_values_ratios_and_intervals(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.plot import ci_of, rows_from_markdown

    rows = rows_from_markdown(TABLE)
    assert [r["contender"] for r in rows] == ["raw", "raw'", "anyaccel", "lightning"]
    assert rows[2]["value"] == 598.9 and rows[2]["unit"] == "us/step (CPU)" and rows[2]["ratio"] == 1.014
    assert rows[2]["ok"] is True and rows[0]["ratio"] is None
    assert ci_of(rows[2]) == (1.009, 1.017) and ci_of(rows[0]) is None
    assert rows[3]["value"] == 2057.0 and rows[3]["unit"] == "ms"


def test_plot_writes_a_png_per_benchmark_from_saved_results(tmp_path):
    """`--plot DIR --results FILE`: every chart the file's rows allow."""
    pytest.importorskip("matplotlib")
    results = ROOT / "benchmarks" / "results" / "2026-11-21-cpu.json"
    assert json.loads(results.read_text())["rows"]
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--plot", str(tmp_path / "charts"), "--results",
                           str(results)], capture_output=True, text=True, timeout=120, env=clean_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in (tmp_path / "charts").iterdir())
    # the registered charts that file has rows for, and a generic chart of each other benchmark with ratios
    assert names == ["data.png", "ddp.png", "gather.png", "gfm.png", "import.png", "launch.png", "notebook.png",
                     "overhead.png"]
    for name in names:
        data = (tmp_path / "charts" / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000


def test_a_chart_names_the_results_file_it_was_drawn_from(tmp_path, monkeypatch):
    """What tests/project/test_docs_figures.py reads back to tie a chart to the figures beside it."""
    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import figures, plot

    source = figures.load(str(ROOT / "benchmarks" / "results" / "2026-11-23-cpu.json"))
    path = plot.draw("launch", source, str(tmp_path))
    meta = plot.png_text(path)
    assert meta["Source"] == "benchmarks/results/2026-11-23-cpu.json" and meta["Creation Time"] == source.date
    with pytest.raises(ValueError, match="no rows to draw the bigmodel chart"):
        plot.draw("bigmodel", source, str(tmp_path))
