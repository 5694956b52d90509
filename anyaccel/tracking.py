"""Experiment trackers: where ``Accelerator.log`` writes metrics.

``Accelerator(log_with=..., project_dir=...)`` names the trackers; ``init_trackers(project_name,
config)`` starts them; ``log(values, step)`` records scalars; ``end_training()`` closes them.
Every rank makes these calls; only the main process (rank 0) writes anything — other ranks do
nothing and create no files. None of these calls communicates between processes.

Built-in trackers (``log_with`` takes a name, a list of names, ``"all"``, or tracker objects):

``"csv"`` (no dependency)
    ``<project_dir>/<project_name>/metrics.csv``: one row per ``log`` call, wide format — a
    ``step`` column and one column per metric name; a cell is empty when that call did not log
    that metric. When a new metric name appears the file is rewritten once with the extra column,
    so ``pandas.read_csv(path)`` (or :class:`csv.DictReader`) always reads the whole history. A
    resumed run appends to an existing file. Nested dicts become ``parent/child`` columns.
    ``config.json`` next to it holds the ``config`` given to ``init_trackers``.
``"tensorboard"`` (``pip install anyaccel[tensorboard]``)
    ``torch.utils.tensorboard.SummaryWriter`` writing event files to
    ``<project_dir>/<project_name>/``; numbers → ``add_scalar``, strings → ``add_text``, dicts →
    ``add_scalars``; ``config`` → hyper-parameters (``add_hparams``) and ``config.json``. View with
    ``tensorboard --logdir <project_dir>``.
``"wandb"`` (``pip install anyaccel[wandb]``)
    Weights & Biases, as Accelerate's tracker: ``wandb.init(project=<project_name>, **init_kwargs)``
    (``init_kwargs={"wandb": {...}}``), ``config`` → ``wandb.config``, ``log`` → ``run.log``.
    Where it writes follows wandb's own settings (``WANDB_DIR``, ``WANDB_MODE=offline``, ...).
``"mlflow"`` (``pip install anyaccel[mlflow]``, which installs ``mlflow-skinny``)
    MLflow, as Accelerate's tracker: experiment ``<project_name>`` (artifact location
    ``<project_dir>``), one run; ``config`` → ``log_params`` (in batches of 100, over-long values
    dropped with a warning), numbers → ``log_metrics`` (other values dropped with a warning). The
    store is mlflow's ``MLFLOW_TRACKING_URI``; ``init_kwargs={"mlflow": {...}}`` takes ``run_id``,
    ``tags``, ``nested_run``, ``run_name``, ``description``.
``"all"``
    Every built-in tracker whose dependency is installed (wandb and mlflow included, as in
    Accelerate).

:class:`LoggerType` names them as Accelerate's enum does (``LoggerType.WANDB``, ...); Accelerate's
other trackers (aim, comet_ml, clearml, dvclive, swanlab, trackio) are refused with a message
that says to wrap them in a :class:`GeneralTracker`.

Your own tracker: subclass :class:`GeneralTracker` (``name``, ``log``, optionally
``store_init_configuration``, ``finish`` and ``tracker``) and pass the instance in ``log_with``.

Values: Python numbers, strings, 1-element tensors and NumPy scalars (converted with
``.item()``) and dicts of these. Anything else raises ``TypeError`` naming the key.
"""

from __future__ import annotations

import csv
import enum
import importlib.util
import json
import numbers
import os
import warnings
from typing import Any, Dict, Iterable, List, Optional

__all__ = ["GeneralTracker", "CSVTracker", "TensorBoardTracker", "WandBTracker", "MLflowTracker", "LoggerType",
           "TrackerSet", "available_trackers"]


class LoggerType(str, enum.Enum):
    """Tracker names, as Hugging Face Accelerate's ``LoggerType`` (plus ``CSV``). Members compare
    equal to their strings: ``log_with=LoggerType.WANDB`` and ``log_with="wandb"`` are the same."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    CSV = "csv"

    def __str__(self) -> str:
        return self.value


# --------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------


def to_python(key: str, value: Any) -> Any:
    """Turn one logged value into a Python number/str/bool (dicts recursively). Local."""
    if isinstance(value, dict):
        return {k: to_python(f"{key}/{k}", v) for k, v in value.items()}
    if isinstance(value, (bool, str)) or value is None:
        return value
    if isinstance(value, numbers.Number):
        return value
    if hasattr(value, "item") and hasattr(value, "shape"):  # torch tensor / numpy array or scalar
        size = 1
        for dim in tuple(value.shape):
            size *= int(dim)
        if size != 1:
            raise TypeError(f"log(): value for {key!r} is an array of shape {tuple(value.shape)}; log scalars "
                            "(e.g. loss.mean()) or log one value per key")
        return value.item()
    raise TypeError(f"log(): value for {key!r} is a {type(value).__name__}; log numbers, strings, "
                    "1-element tensors or dicts of them")


def _flatten(values: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in values.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, prefix=name + "/"))
        else:
            out[name] = v
    return out


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item") and hasattr(obj, "shape") and len(tuple(obj.shape)) == 0:
        return obj.item()
    return str(obj)


def _write_json(path: str, data: Any) -> None:
    from .fileio import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True, default=_json_default))


# --------------------------------------------------------------------------------------------
# Trackers
# --------------------------------------------------------------------------------------------


class GeneralTracker:
    """Base class for trackers (same shape as Hugging Face Accelerate's).

    Subclasses set ``name`` and implement :meth:`log`; the rest is optional. ``main_process_only``
    (default True) means the tracker is used on rank 0 only; set it False to be called on every
    rank (your tracker then decides what each rank does).
    """

    name: str = "general"
    requires_logging_directory: bool = False
    main_process_only: bool = True

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        """Record the run's hyper-parameters (called by ``init_trackers(..., config=...)``)."""

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Record the scalar ``values`` at ``step``."""
        raise NotImplementedError(f"{type(self).__name__}.log(values, step) is not implemented")

    def finish(self) -> None:
        """Flush and close (called by ``end_training``)."""

    @property
    def tracker(self) -> Any:
        """The underlying object (``get_tracker(name, unwrap=True)``); the tracker itself by default."""
        return self


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


class WandBTracker(GeneralTracker):
    """A Weights & Biases run (``wandb.init(project=run_name, **kwargs)``), as Accelerate's
    ``WandBTracker``. Main process only; ``logging_dir`` is unused (wandb's ``WANDB_DIR`` or
    ``dir=`` in ``init_kwargs`` decide where it writes)."""

    name = "wandb"
    requires_logging_directory = False

    def __init__(self, run_name: str, logging_dir: Optional[str] = None, **kwargs: Any):
        wandb = _import_optional("wandb", "wandb")
        self.run_name = run_name
        self.run = wandb.init(project=run_name, **kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class MLflowTracker(GeneralTracker):
    """An MLflow run in experiment ``experiment_name`` (created with ``artifact_location=
    logging_dir`` when new), as Accelerate's ``MLflowTracker``; the environment variables
    ``MLFLOW_EXPERIMENT_NAME``, ``MLFLOW_RUN_ID``, ``MLFLOW_TAGS``, ``MLFLOW_NESTED_RUN`` take
    precedence as there. Main process only."""

    name = "mlflow"
    requires_logging_directory = False

    def __init__(self, experiment_name: Optional[str] = None, logging_dir: Optional[str] = None,
                 run_id: Optional[str] = None, tags: Any = None, nested_run: Any = False,
                 run_name: Optional[str] = None, description: Optional[str] = None):
        mlflow = _import_optional("mlflow", "mlflow")
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        run_id = os.environ.get("MLFLOW_RUN_ID", run_id)
        tags = os.environ.get("MLFLOW_TAGS", tags)
        if isinstance(tags, str):
            tags = json.loads(tags)
        nested_run = os.environ.get("MLFLOW_NESTED_RUN", nested_run)
        if isinstance(nested_run, str):
            nested_run = nested_run.strip().lower() in ("1", "true", "yes", "on")
        found = mlflow.search_experiments(filter_string=f"name = '{experiment_name}'")
        if found:
            experiment_id = found[0].experiment_id
        else:
            experiment_id = mlflow.create_experiment(name=experiment_name, artifact_location=logging_dir, tags=tags)
        self.active_run = mlflow.start_run(run_id=run_id, experiment_id=experiment_id, run_name=run_name,
                                           nested=bool(nested_run), tags=tags, description=description)
        self._mlflow = mlflow

    @property
    def tracker(self) -> Any:
        return self.active_run

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        kept = {}
        for key, value in values.items():
            if len(str(value)) > MAX_PARAM_VAL_LENGTH:
                warnings.warn(f"mlflow: the config value of {key!r} is longer than {MAX_PARAM_VAL_LENGTH} characters "
                              "(mlflow's limit for a parameter) and is not stored", stacklevel=3)
            else:
                kept[key] = value
        items = list(kept.items())
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self._mlflow.log_params(dict(items[i : i + MAX_PARAMS_TAGS_PER_BATCH]))

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        metrics = {}
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics[key] = value
            else:
                warnings.warn(f"mlflow: {key!r} = {value!r} is not a number; mlflow's metrics are numbers, so it is "
                              "not logged there", stacklevel=3)
        self._mlflow.log_metrics(metrics, step=step, **kwargs)

    def finish(self) -> None:
        self._mlflow.end_run()


def _import_optional(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"log_with={extra!r} needs the {module} package ({exc}); install it with `pip install anyaccel[{extra}]`, "
            "or use log_with='csv'"
        ) from exc


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


def _installed(module: str):
    return lambda: importlib.util.find_spec(module) is not None


_BUILTIN = {"csv": (CSVTracker, lambda: True), "tensorboard": (TensorBoardTracker, _tensorboard_available),
            "wandb": (WandBTracker, _installed("wandb")), "mlflow": (MLflowTracker, _installed("mlflow"))}
_INSTALL = {"tensorboard": _import_summary_writer, "wandb": lambda: _import_optional("wandb", "wandb"),
            "mlflow": lambda: _import_optional("mlflow", "mlflow")}
# Accelerate's other trackers: not built in; a GeneralTracker subclass can wrap any of them.
_NOT_BUILT_IN = ("aim", "comet_ml", "clearml", "dvclive", "swanlab", "trackio")


def available_trackers() -> List[str]:
    """Names of the built-in trackers whose dependencies are installed. Local."""
    return [name for name, (_, ok) in _BUILTIN.items() if ok()]


def _normalise(log_with: Any) -> List[Any]:
    """``log_with`` → list of built-in names and tracker objects; raises on unknown names or a
    missing dependency (identically on every rank, so no rank is left waiting)."""
    if log_with is None:
        return []
    items = list(log_with) if isinstance(log_with, (list, tuple, set)) else [log_with]
    out: List[Any] = []
    for item in items:
        if isinstance(item, GeneralTracker):
            out.append(item)
            continue
        name = getattr(item, "value", item)  # enum members such as Accelerate's LoggerType
        if not isinstance(name, str):
            raise TypeError(f"log_with accepts tracker names ({', '.join(_BUILTIN)}, 'all') or GeneralTracker "
                            f"instances; got a {type(item).__name__}")
        name = name.lower()
        if name == "all":
            out += [n for n in available_trackers() if n not in out]
        elif name in _BUILTIN:
            if not _BUILTIN[name][1]():
                _INSTALL[name]()  # raises the ImportError with the install hint
            if name not in out:
                out.append(name)
        elif name in _NOT_BUILT_IN:
            raise ValueError(f"log_with={name!r}: anyaccel has no built-in {name} tracker (built in: "
                             f"{', '.join(_BUILTIN)}); wrap it in a GeneralTracker subclass and pass the instance "
                             "in log_with")
        else:
            raise ValueError(f"log_with={name!r} is not a known tracker; choose from {', '.join(_BUILTIN)}, 'all', "
                             "or pass a GeneralTracker instance")
    return out


class _NoOpTracker:
    """What ``get_tracker`` returns on processes that do not log: every attribute is a no-op."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return lambda *args, **kwargs: None

    def __repr__(self) -> str:
        return f"<no-op tracker {self.name!r} (this process does not log)>"


class TrackerSet:
    """The trackers of one ``Accelerator``.

    Built on every rank with the same ``log_with``; holds live trackers on the main process only
    (plus user trackers with ``main_process_only = False`` on every rank). Nothing here
    communicates between processes.
    """

    def __init__(self, log_with: Any, project_dir: str, is_main_process: bool):
        self._requested = _normalise(log_with)
        self.project_dir = project_dir
        self.is_main_process = bool(is_main_process)
        self.trackers: List[GeneralTracker] = []
        self._started = False
        self._last_step: Optional[int] = None
        self._warned = False

    def _runs_here(self, tracker: Any) -> bool:
        return self.is_main_process or not getattr(tracker, "main_process_only", True)

    def init(self, project_name: str, config: Optional[Dict[str, Any]] = None,
             init_kwargs: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
        """Start every requested tracker for run ``project_name`` and store ``config``.
        ``init_kwargs`` maps a tracker name to extra constructor arguments, e.g.
        ``{"tensorboard": {"flush_secs": 10}}``. Writes on the main process only."""
        if not project_name or os.path.isabs(str(project_name)):
            raise ValueError(f"init_trackers needs a project name such as 'my_run'; got {project_name!r}")
        init_kwargs = dict(init_kwargs or {})
        unknown = set(init_kwargs) - {t if isinstance(t, str) else t.name for t in self._requested}
        if unknown:
            raise ValueError(f"init_kwargs has entries for {sorted(unknown)} but log_with requested "
                             f"{[t if isinstance(t, str) else t.name for t in self._requested]}")
        self.finish()
        self.trackers = []
        for item in self._requested:
            if isinstance(item, str):
                if not self.is_main_process:
                    continue
                cls = _BUILTIN[item][0]
                tracker = cls(str(project_name), self.project_dir, **init_kwargs.get(item, {}))
            else:
                if not self._runs_here(item):
                    continue
                tracker = item
            self.trackers.append(tracker)
        if config is not None:
            for tracker in self.trackers:
                tracker.store_init_configuration(dict(config))
        self._started = True

    def log(self, values: Dict[str, Any], step: Optional[int] = None,
            log_kwargs: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
        """Record ``values`` at ``step`` in every tracker (main process only). Without ``step``,
        the previous call's step + 1 is used (0 for the first call), so steps always increase."""
        if step is None:
            step = 0 if self._last_step is None else self._last_step + 1
        self._last_step = int(step)
        if not self._requested:
            if not self._warned and self.is_main_process:
                warnings.warn("Accelerator.log() does nothing: no tracker was requested. Pass log_with='csv' "
                              "(or 'tensorboard', 'all') to Accelerator to record metrics.", stacklevel=3)
                self._warned = True
            return
        if not self._started:
            raise RuntimeError("log() was called before init_trackers(project_name): start the trackers named "
                               f"by log_with={[t if isinstance(t, str) else t.name for t in self._requested]} first")
        if not self.trackers:
            return
        clean = {str(k): to_python(str(k), v) for k, v in values.items()}
        log_kwargs = log_kwargs or {}
        for tracker in self.trackers:
            tracker.log(clean, step=step, **log_kwargs.get(tracker.name, {}))

    def get(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called ``name`` (its underlying writer with ``unwrap=True``). On a
        process that does not log, a no-op stand-in, so rank-independent code keeps working."""
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        requested = [t if isinstance(t, str) else t.name for t in self._requested]
        if name in requested and not self._started:
            raise RuntimeError(f"get_tracker({name!r}) before init_trackers(project_name): start the trackers first")
        if name in requested:
            return _NoOpTracker(name)  # requested, but this process does not log
        raise ValueError(f"no tracker named {name!r}; log_with requested {requested}")

    def finish(self) -> None:
        """Close every started tracker. Safe to call twice."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        self._started = False

    def __iter__(self) -> Iterable[GeneralTracker]:
        return iter(self.trackers)
