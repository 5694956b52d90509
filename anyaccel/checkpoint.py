"""Checkpoints: atomic single-file saves, model export, and full training state (save/load_state)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any, Optional

import torch

__all__ = ["ProjectConfiguration", "atomic_save"]


@dataclasses.dataclass
class ProjectConfiguration:
    """Where a project writes (``project_dir``), and automatic checkpoint naming:
    with ``automatic_checkpoint_naming=True`` :meth:`Accelerator.save_state` writes
    ``project_dir/checkpoints/checkpoint_<n>`` and keeps at most ``total_limit`` of them."""

    project_dir: Optional[str] = None
    logging_dir: Optional[str] = None
    automatic_checkpoint_naming: bool = False
    total_limit: Optional[int] = None
    iteration: int = 0


def atomic_save(obj: Any, path: Any, safe_serialization: bool = False) -> None:
    """Write ``obj`` to ``path`` through a temporary file in the same directory, fsync, rename.
    Local to the calling process."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            if safe_serialization:
                from safetensors.torch import save as st_save

                fh.write(st_save(obj))
            else:
                torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
