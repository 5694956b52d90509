"""Trackers: what ``Accelerator.log`` writes, read back from disk (CSV, TensorBoard, user trackers)."""

import csv
import json
import sys
import textwrap

import pytest
import torch

from anyaccel.tracking import GeneralTracker, TrackerSet, available_trackers
from conftest import torchrun


def read_csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_csv_rows_grow_columns_and_convert_tensors(tmp_path):
    ts = TrackerSet("csv", str(tmp_path), is_main_process=True)
    ts.init("run", config={"lr": 0.1, "depth": 3, "device": torch.device("cpu")})
    ts.log({"loss": torch.tensor(2.5)}, step=0)
    ts.log({"loss": torch.tensor([1.5]), "acc": 0.25}, step=10)  # new column → file rewritten once
    ts.log({"eval": {"acc": 0.5}}, step=20)
    ts.finish()

    rows = read_csv(tmp_path / "run" / "metrics.csv")
    assert list(rows[0]) == ["step", "loss", "acc", "eval/acc"]
    assert [(r["step"], r["loss"], r["acc"], r["eval/acc"]) for r in rows] == [
        ("0", "2.5", "", ""), ("10", "1.5", "0.25", ""), ("20", "", "", "0.5")]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config == {"lr": 0.1, "depth": 3, "device": "cpu"}


def test_csv_resumed_run_appends_to_the_same_file(tmp_path):
    for start in (0, 2):
        ts = TrackerSet(["csv"], str(tmp_path), is_main_process=True)
        ts.init("run")
        ts.log({"loss": 1.0 + start}, step=start)
        ts.log({"loss": 2.0 + start})  # no step: previous step + 1
        ts.finish()
    rows = read_csv(tmp_path / "run" / "metrics.csv")
    assert [(r["step"], float(r["loss"])) for r in rows] == [("0", 1.0), ("1", 2.0), ("2", 3.0), ("3", 4.0)]


def test_non_main_process_writes_nothing(tmp_path):
    ts = TrackerSet(["csv", "all"], str(tmp_path / "proj"), is_main_process=False)
    ts.init("run", config={"a": 1})
    ts.log({"loss": 1.0}, step=0)
    assert ts.trackers == []
    # code written for rank 0 (get_tracker(...).something()) still runs on the other ranks
    ts.get("csv", unwrap=True).add_histogram("w", torch.zeros(3))
    ts.finish()
    assert not (tmp_path / "proj").exists()


def test_bad_values_and_names_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="'wandb' is not a known tracker"):
        TrackerSet("wandb", str(tmp_path), True)
    ts = TrackerSet("csv", str(tmp_path), True)
    with pytest.raises(RuntimeError, match="before init_trackers"):
        ts.log({"loss": 1.0})
    ts.init("run")
    with pytest.raises(TypeError, match="'w'.*shape \\(3,\\)"):
        ts.log({"w": torch.zeros(3)})
    with pytest.raises(ValueError, match="no tracker named 'tensorboard'"):
        ts.get("tensorboard")
    ts.finish()


def test_missing_tensorboard_names_the_extra(tmp_path, monkeypatch):
    import anyaccel.tracking as tracking

    monkeypatch.setitem(tracking._BUILTIN, "tensorboard", (tracking.TensorBoardTracker, lambda: False))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pip install anyaccel\[tensorboard\]"):
        TrackerSet("tensorboard", str(tmp_path), True)
    assert "tensorboard" not in tracking.available_trackers()
    ts = TrackerSet("all", str(tmp_path), True)  # "all" quietly means "all that are installed"
    ts.init("run")
    assert [t.name for t in ts.trackers] == ["csv"]
    ts.finish()


def test_tensorboard_scalars_read_back(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard not installed (pip install anyaccel[tensorboard])")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ts = TrackerSet("all", str(tmp_path), is_main_process=True)
    assert "tensorboard" in available_trackers()
    ts.init("run", config={"lr": 0.01, "opt": "sgd"})
    for step in range(3):
        ts.log({"train/loss": torch.tensor(1.0 / (step + 1)), "note": f"step {step}"}, step=step)
    writer = ts.get("tensorboard", unwrap=True)
    assert type(writer).__name__ == "SummaryWriter"
    ts.finish()

    acc = EventAccumulator(str(tmp_path / "run"))
    acc.Reload()
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == [0, 1, 2]
    assert [round(e.value, 4) for e in events] == [1.0, 0.5, 0.3333]
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"lr": 0.01, "opt": "sgd"}
    assert (tmp_path / "run" / "metrics.csv").exists()  # "all" also started the csv tracker


class Recorder(GeneralTracker):
    name = "recorder"

    def __init__(self):
        self.config, self.logged, self.finished = None, [], False

    def store_init_configuration(self, values):
        self.config = values

    def log(self, values, step=None, **kwargs):
        self.logged.append((step, values, kwargs))

    def finish(self):
        self.finished = True


def test_user_tracker_through_the_accelerator(tmp_path):
    from anyaccel import Accelerator

    rec = Recorder()
    acc = Accelerator(log_with=[rec, "csv"], project_dir=str(tmp_path), cpu=True)
    acc.init_trackers("exp", config={"bs": 8}, init_kwargs={"csv": {"filename": "m.csv"}})
    acc.log({"loss": torch.tensor(0.5)}, step=3, log_kwargs={"recorder": {"split": "train"}})
    assert acc.get_tracker("recorder") is rec
    assert acc.get_tracker("csv", unwrap=True).endswith("m.csv")
    assert [t.name for t in acc.trackers] == ["recorder", "csv"]
    acc.end_training()
    assert rec.config == {"bs": 8} and rec.finished
    assert rec.logged == [(3, {"loss": 0.5}, {"split": "train"})]
    assert read_csv(tmp_path / "exp" / "m.csv") == [{"step": "3", "loss": "0.5"}]


def test_log_without_trackers_warns_once(tmp_path):
    ts = TrackerSet(None, str(tmp_path), True)
    ts.init("run")
    with pytest.warns(UserWarning, match="log_with"):
        ts.log({"loss": 1.0})
    ts.log({"loss": 1.0})
    assert not (tmp_path / "run").exists()


def test_importing_anyaccel_does_not_import_tensorboard_or_tqdm():
    import subprocess

    code = ("import sys, anyaccel, anyaccel.tracking, anyaccel.logging; "
            "print([m for m in ('tensorboard', 'tqdm', 'torch.utils.tensorboard') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


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
    torchrun(script, tmp_path / "proj")
    rows = read_csv(tmp_path / "proj" / "job" / "metrics.csv")
    assert [(r["step"], r["rank"], r["loss"]) for r in rows] == [("0", "0", "0.0"), ("1", "0", "1.0"), ("2", "0", "2.0")]
    assert json.loads((tmp_path / "proj" / "job" / "config.json").read_text()) == {"world": 2}
    assert sorted(p.name for p in (tmp_path / "proj" / "job").iterdir()) == ["config.json", "metrics.csv"]
