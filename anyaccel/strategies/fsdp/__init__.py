"""FSDP2 sharding (the ``fsdp`` strategy): its options, its pieces and its checkpoint code.

=================  ==================================================================================
``options.py``     :class:`FSDPOptions` (no torch: the launcher checks ``fsdp_config`` with it)
``strategy.py``    :class:`ShardedStrategy` (what every DTensor-parameter strategy shares: optimizer
                   remapping, collective state dicts, sharded checkpoints) and :class:`FSDPStrategy`
``sharding.py``    :class:`~.sharding.FSDPSharding`: ``fully_shard`` over a mesh it is given
``ties.py``        tied parameters kept one parameter through tensor parallelism and sharding
=================  ==================================================================================

The mesh comes from the job's :class:`~anyaccel.strategies.mesh.ProcessMesh`; sharded checkpoints
are the format every strategy reads (:mod:`anyaccel.strategies.dcp`). The N-D family
(:mod:`anyaccel.strategies.nd`) builds on this package; nothing here imports it. The names below
load on first use (importing the package imports no torch).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["FSDPStrategy", "ShardedStrategy", "FSDPOptions"]

_HOMES = {"FSDPStrategy": "strategy", "ShardedStrategy": "strategy", "FSDPOptions": "options",
          "_broadcast_from_rank0": "strategy", "_fsdp": "sharding"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
