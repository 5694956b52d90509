"""Trackers: what ``Accelerator.log`` writes, read back from disk (CSV, TensorBoard, user trackers)."""

import csv
import json
import sys

import pytest
import torch

from anyaccel.tracking import GeneralTracker, TrackerSet, available_trackers


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


def test_trackers_started_on_the_main_process_only_and_log_on_every_rank(tmp_path):
    """diffusers' shape: `if accelerator.is_main_process: accelerator.init_trackers(...)`, then
    `accelerator.log(...)` on every rank. The other ranks never started anything: their log,
    get_tracker, trackers and finish do nothing (as Accelerate's empty tracker list); only the
    main process, where a call before init_trackers is certainly a mistake, raises."""
    other = TrackerSet(["csv", "tensorboard"], str(tmp_path / "proj"), is_main_process=False)
    other.log({"loss": 1.0}, step=0)  # no init_trackers here
    other.get("tensorboard", unwrap=True).add_images("x", torch.zeros(1, 3, 2, 2), 0)
    assert other.trackers == []
    other.finish()
    with pytest.raises(ValueError, match="no tracker named 'wandb'"):  # a name log_with never asked for
        other.get("wandb")
    main = TrackerSet(["csv", "tensorboard"], str(tmp_path / "proj"), is_main_process=True)
    with pytest.raises(RuntimeError, match="before init_trackers"):
        main.log({"loss": 1.0}, step=0)
    with pytest.raises(RuntimeError, match=r"get_tracker\('csv'\) before init_trackers"):
        main.get("csv")
    main.init("run")
    main.log({"loss": 1.0}, step=0)
    assert [t.name for t in main.trackers] == ["csv", "tensorboard"]
    main.finish()
    assert [r["loss"] for r in read_csv(tmp_path / "proj" / "run" / "metrics.csv")] == ["1.0"]


def test_bad_values_and_names_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="'neptune' is not a known tracker"):
        TrackerSet("neptune", str(tmp_path), True)
    with pytest.raises(ValueError, match="no built-in comet_ml tracker.*GeneralTracker"):
        TrackerSet("comet_ml", str(tmp_path), True)
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
    monkeypatch.setitem(tracking._BUILTIN, "wandb", (tracking.WandBTracker, lambda: False))
    monkeypatch.setitem(tracking._BUILTIN, "mlflow", (tracking.MLflowTracker, lambda: False))
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install anyaccel\[wandb\]"):
        TrackerSet("wandb", str(tmp_path), True)
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

    ts = TrackerSet(["csv", "tensorboard"], str(tmp_path), is_main_process=True)
    assert "tensorboard" in available_trackers()
    ts.init("run", config={"lr": 0.01, "opt": "sgd"})
    for step in range(3):
        ts.log({"train/loss": torch.tensor(1.0 / (step + 1)), "note": f"step {step}"}, step=step)
    writer = ts.get("tensorboard", unwrap=True)
    assert type(writer).__name__ == "SummaryWriter"
    assert ts.get("tensorboard").add_images.__self__ is writer  # diffusers without Accelerate installed
    ts.finish()

    acc = EventAccumulator(str(tmp_path / "run"))
    acc.Reload()
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == [0, 1, 2]
    assert [round(e.value, 4) for e in events] == [1.0, 0.5, 0.3333]
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"lr": 0.01, "opt": "sgd"}
    assert (tmp_path / "run" / "metrics.csv").exists()


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


def _wandb_records(run_dir):
    """The records of an offline wandb run, read from its ``run-*.wandb`` file (a LevelDB-style
    log of protobuf records: a 7-byte header, then 32 KiB blocks of chunks with 7-byte headers)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    data, pos, chunk, records = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def test_wandb_offline_run_read_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb not installed (pip install anyaccel[wandb])")
    from anyaccel import Accelerator
    from anyaccel.tracking import LoggerType

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    acc = Accelerator(log_with=LoggerType.WANDB, project_dir=str(tmp_path), cpu=True)
    acc.init_trackers("wb_project", config={"lr": 0.1, "opt": "sgd"})
    for step in range(3):
        acc.log({"loss": torch.tensor(1.0 / (step + 1))}, step=step)
    assert type(acc.get_tracker("wandb", unwrap=True)).__name__ == "Run"
    acc.end_training()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    import time

    # wandb's service process writes the file; under CI load its last blocks landed after finish()
    # returned (seen once: no run record yet), so read until the run record is there (30 s at most)
    deadline = time.monotonic() + 30
    while True:
        records = _wandb_records(run_dir)
        if any(r.WhichOneof("record_type") == "run" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "wb_project"
    config = {i.key: json.loads(i.value_json) for r in records if r.WhichOneof("record_type") == "config"
              for i in r.config.update}
    assert config["lr"] == 0.1 and config["opt"] == "sgd"
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item} for r in records
               if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], round(h["loss"], 4)) for h in history] == [(0, 1.0), (1, 0.5), (2, 0.3333)]


def test_mlflow_local_store_read_back(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow not installed (pip install anyaccel[mlflow])")
    from mlflow.tracking import MlflowClient

    from anyaccel import Accelerator

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow-skinny: a plain local file store
    acc = Accelerator(log_with="mlflow", project_dir=str(tmp_path / "artifacts"), cpu=True)
    acc.init_trackers("ml_experiment", config={"lr": 0.1, "opt": "sgd"},
                      init_kwargs={"mlflow": {"run_name": "first"}})
    for step in range(3):
        acc.log({"loss": torch.tensor(1.0 / (step + 1))}, step=step)
    with pytest.warns(UserWarning, match="'note'.*not a number"):
        acc.log({"note": "text", "acc": 0.5}, step=3)
    run_id = acc.get_tracker("mlflow", unwrap=True).info.run_id
    acc.end_training()
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.run_name == "first" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "ml_experiment"
    assert run.data.params == {"lr": "0.1", "opt": "sgd"}
    assert [(m.step, round(m.value, 4)) for m in client.get_metric_history(run_id, "loss")] == \
        [(0, 1.0), (1, 0.5), (2, 0.3333)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "acc")] == [(3, 0.5)]


def test_logger_type_names_are_accelerates(tmp_path):
    from anyaccel import LoggerType

    assert LoggerType.WANDB == "wandb" and LoggerType.MLFLOW.value == "mlflow" and LoggerType("tensorboard")
    assert {m.name for m in LoggerType} >= {"ALL", "TENSORBOARD", "WANDB", "MLFLOW", "COMETML", "AIM"}
    ts = TrackerSet([LoggerType.CSV, LoggerType.TENSORBOARD], str(tmp_path), is_main_process=True)
    ts.init("run")
    assert [t.name for t in ts.trackers] == ["csv", "tensorboard"]
    ts.finish()
