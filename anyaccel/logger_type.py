"""``LoggerType``: tracker names under Accelerate's enum (``Accelerator(log_with=LoggerType.CSV)``).

The values are the strings ``log_with`` accepts; anyaccel's trackers are those
:func:`anyaccel.tracking.available_trackers` lists. Members for trackers anyaccel lacks exist so
that scripts naming them import; ``log_with`` refuses them with a message naming what exists.
"""

from __future__ import annotations

import enum

__all__ = ["LoggerType"]


class LoggerType(str, enum.Enum):
    """Tracker names (values as ``log_with`` takes them)."""

    ALL = "all"
    CSV = "csv"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    MLFLOW = "mlflow"
    AIM = "aim"
    COMETML = "comet_ml"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    TRACKIO = "trackio"

    def __str__(self) -> str:
        return self.value
