"""The N-D family (the ``nd`` strategy): replicas x FSDP2 shards x tensor, sequence and pipeline
parallelism on one mesh, configured by :class:`~.options.ParallelismConfig`.

=====================  ============================================================================
``options.py``         :class:`ParallelismConfig` (no torch: the launcher checks it)
``strategy.py``        :class:`NDStrategy`: the order, written once (rank 0's weights -> pipeline
                       cut -> tensor parallel -> sequence hooks -> activation checkpointing ->
                       compile per block -> FSDP2), on FSDP's sharding (:mod:`anyaccel.strategies.fsdp`)
``tensor_parallel.py`` plans (``tp_plan``, the model's own, ``parallelize_fn``) on the ``tp`` sub-mesh
``pipeline/``          stages cut at block boundaries, torch's schedules, ties across stages, the
                       :class:`~anyaccel.strategies.capabilities.Pipelined` mixin
``sequence/``          Ulysses: the all-to-all around attention, the transformers hooks, the
                       loader's slices (:class:`~anyaccel.strategies.capabilities.SequenceParallel`)
``expert/``            expert parallelism's place (issue 39): MoE dispatch on an ``ep`` dimension
=====================  ============================================================================

Every rank and group is the job's :class:`~anyaccel.strategies.mesh.ProcessMesh`'s. Inside the
family the strategy is above its pieces, which do not import each other, above the options
(an import-linter contract in pyproject.toml). The names below load on first use (importing the
package imports no torch).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["NDStrategy", "ParallelismConfig", "tp_styles", "check_tp_divisibility"]

_HOMES = {"NDStrategy": "strategy", "ParallelismConfig": "options", "tp_styles": "tensor_parallel",
          "check_tp_divisibility": "tensor_parallel"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
