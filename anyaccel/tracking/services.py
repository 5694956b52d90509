"""Trackers that report to an experiment service, under Accelerate's names and behaviour:
``wandb`` and ``mlflow`` (each package imported when its tracker starts). Main process only;
local (the services do their own I/O)."""

from __future__ import annotations

import importlib
import json
import os
import warnings
from typing import Any, Dict, Optional

from .base import GeneralTracker

__all__ = ["WandBTracker", "MLflowTracker"]


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
