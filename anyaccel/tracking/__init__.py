"""Experiment trackers: where ``Accelerator.log`` writes metrics.

``Accelerator(log_with=..., project_dir=...)`` names the trackers; ``init_trackers(project_name,
config)`` starts them; ``log(values, step)`` records scalars; ``end_training()`` closes them.
Every rank may make these calls; only the main process (rank 0) writes anything — other ranks do
nothing and create no files. None of these calls communicates between processes, so starting the
trackers on the main process only (``if accelerator.is_main_process: accelerator.init_trackers(...)``)
while every rank calls ``log`` works, as in Accelerate.

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

Modules: :mod:`.base` (``GeneralTracker``, values), :mod:`.local` (csv, tensorboard),
:mod:`.services` (wandb, mlflow); this one names them and runs the set of an ``Accelerator``.
"""

from __future__ import annotations

import enum
import importlib.util
import os
import warnings
from typing import Any, Dict, Iterable, List, Optional

from .base import GeneralTracker, to_python
from .local import CSVTracker, TensorBoardTracker, _import_summary_writer, _tensorboard_available
from .services import MLflowTracker, WandBTracker, _import_optional

__all__ = ["GeneralTracker", "CSVTracker", "TensorBoardTracker", "WandBTracker", "MLflowTracker", "LoggerType",
           "TrackerSet", "available_trackers", "to_python"]


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
# Which trackers exist
# --------------------------------------------------------------------------------------------


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
        the previous call's step + 1 is used (0 for the first call), so steps always increase.

        Before ``init_trackers``: the main process raises (nothing would be recorded: certainly a
        mistake); another process returns at once, since the trackers may well have been started
        on the main process only (``if accelerator.is_main_process: accelerator.init_trackers(...)``,
        as diffusers' scripts do) — as Accelerate, which loops over no trackers there."""
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
            if not self.is_main_process:
                return  # other ranks: trackers started on the main process only (diffusers' scripts) log nothing here
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
        process that does not log, a no-op stand-in, so rank-independent code keeps working (also
        before ``init_trackers`` there: it may have run on the main process only). A name
        ``log_with`` did not request raises ``ValueError`` everywhere; the main process asking
        before ``init_trackers`` raises ``RuntimeError``."""
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        requested = [t if isinstance(t, str) else t.name for t in self._requested]
        if name in requested and not self._started and self.is_main_process:
            raise RuntimeError(f"get_tracker({name!r}) before init_trackers(project_name): start the trackers first")
        if name in requested:
            return _NoOpTracker(name)  # requested, but this process does not log (or started none: main-only init)
        raise ValueError(f"no tracker named {name!r}; log_with requested {requested}")

    def finish(self) -> None:
        """Close every started tracker. Safe to call twice."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        self._started = False

    def __iter__(self) -> Iterable[GeneralTracker]:
        return iter(self.trackers)
