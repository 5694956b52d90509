"""Trackers that write files under the project directory: ``csv`` (no dependency) and
``tensorboard`` (the tensorboard package, imported when the tracker starts). Main process only;
local."""

from __future__ import annotations

import csv
import importlib.util
import os
from typing import Any, Dict, List, Optional

from .base import GeneralTracker, _flatten, _write_json

__all__ = ["CSVTracker", "TensorBoardTracker"]


class CSVTracker(GeneralTracker):
    """Metrics in ``<project_dir>/<run_name>/metrics.csv`` (wide: ``step`` + one column per metric)."""

    name = "csv"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str, filename: str = "metrics.csv"):
        self.run_dir = os.path.join(logging_dir, run_name)
        os.makedirs(self.run_dir, exist_ok=True)
        self.path = os.path.join(self.run_dir, filename)
        self.columns: List[str] = ["step"]
        self._fh = None
        if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            with open(self.path, newline="") as fh:
                header = next(csv.reader(fh), None)
            if header:
                self.columns = list(header)
        else:
            with open(self.path, "w", newline="") as fh:
                csv.writer(fh).writerow(self.columns)
        self._fh = open(self.path, "a", newline="")

    @property
    def tracker(self) -> Any:
        return self.path

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        _write_json(os.path.join(self.run_dir, "config.json"), values)

    def _add_columns(self, new: List[str]) -> None:
        """Rewrite the file once with the extra columns (old rows get empty cells)."""
        self._fh.close()
        with open(self.path, newline="") as fh:
            rows = list(csv.DictReader(fh))
        self.columns += new
        tmp = self.path + ".tmp"
        with open(tmp, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=self.columns, restval="")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)
        self._fh = open(self.path, "a", newline="")

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        if self._fh is None:
            raise RuntimeError(f"the csv tracker for {self.path} is finished; call init_trackers again to log")
        flat = _flatten(values)
        new = [k for k in flat if k not in self.columns]
        if new:
            self._add_columns(new)
        row = {"step": "" if step is None else step, **flat}
        csv.DictWriter(self._fh, fieldnames=self.columns, restval="").writerow(row)
        self._fh.flush()

    def finish(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class TensorBoardTracker(GeneralTracker):
    """TensorBoard event files in ``<project_dir>/<run_name>/`` through
    ``torch.utils.tensorboard.SummaryWriter`` (extra ``init_kwargs`` go to the writer)."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str, **kwargs: Any):
        SummaryWriter = _import_summary_writer()
        self.run_dir = os.path.join(logging_dir, run_name)
        os.makedirs(self.run_dir, exist_ok=True)
        self.writer = SummaryWriter(log_dir=self.run_dir, **kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    def __getattr__(self, name: str) -> Any:
        """The writer's methods on the tracker itself (``get_tracker("tensorboard").add_images(...)``):
        diffusers' scripts call them so when they find no Accelerate 0.17 installed, whose
        ``get_tracker`` returned the writer."""
        writer = self.__dict__.get("writer")
        if writer is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(writer, name)

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        hparams = {k: (v if isinstance(v, (bool, int, float, str)) else str(v)) for k, v in _flatten(values).items()}
        # run_name="." keeps the hparams next to the scalars instead of in a timestamped sub-folder
        self.writer.add_hparams(hparams, metric_dict={}, run_name=".")
        _write_json(os.path.join(self.run_dir, "config.json"), values)
        self.writer.flush()

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        for key, value in values.items():
            if isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, _flatten(value), global_step=step, **kwargs)
            elif value is not None:
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


def _import_summary_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(
            f"log_with='tensorboard' needs the tensorboard package ({exc}); install it with "
            "`pip install anyaccel[tensorboard]` (or `pip install tensorboard`), or use log_with='csv'"
        ) from exc
    return SummaryWriter


def _tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None
