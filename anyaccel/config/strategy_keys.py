"""Configuration keys that select a strategy: ``parallelism_config`` (the N-D sizes, in
Accelerate's spelling) selects ``nd``, ``fsdp_config`` alone selects ``fsdp``,
``deepspeed_config`` selects ``deepspeed``. One home for the rule
used by the schema's checks, the wizard and ``anyaccel launch``'s planner; the strategies'
own option classes (:mod:`anyaccel.strategies.options` and each strategy package's ``options``) say what the values mean."""

from __future__ import annotations

from typing import Any, Dict, Optional

from .. import optionspec
from ..strategies import choose_strategy
from ..strategies.deepspeed.config import DeepSpeedOptions
from ..strategies.fsdp.options import FSDPOptions
from ..strategies.nd.options import ParallelismConfig

__all__ = ["PARALLELISM_KEYS", "effective_strategy", "parallelism_problem", "parallelism_sizes"]

#: the ``parallelism_config`` keys (Accelerate's config-file spelling), one per size row of the
#: option table (:func:`anyaccel.optionspec.section_rows`); the values are checked by its rows
PARALLELISM_KEYS = tuple(row.key for row in optionspec.section_rows("parallelism_config") if row.key)


def parallelism_sizes(cfg: Any) -> Optional[Dict[str, Any]]:
    """``cfg.parallelism_config`` as ``ParallelismConfig`` keyword arguments: every field of the
    section (every size, 1 where not given; another field, its default), or None when the key is
    not set."""
    if cfg.parallelism_config is None:
        return None
    out = {}
    for row in optionspec.section_rows("parallelism_config"):
        value = cfg.parallelism_config.get(row.key)
        out[row.name] = value if value is not None else (1 if row.name.endswith("_size") else row.default)
    return out


def effective_strategy(cfg: Any) -> Optional[str]:
    """The strategy ``cfg`` asks for, with the registry's rule for options that select their
    strategy: ``parallelism_config`` selects ``nd`` (whose data-parallel sharding ``fsdp_config``
    then configures), ``fsdp_config`` alone selects ``fsdp``, ``deepspeed_config`` selects
    ``deepspeed``. None: decided at run time. Raises ``ValueError`` for a contradiction. Local;
    used by the schema's rules and ``anyaccel launch``."""
    strategy = choose_strategy(cfg.strategy, ParallelismConfig.strategy if cfg.parallelism_config is not None
                               else None, options_source="key 'parallelism_config'")
    strategy = choose_strategy(strategy, DeepSpeedOptions.strategy if cfg.deepspeed_config is not None else None,
                               options_source="key 'deepspeed_config'")
    if cfg.fsdp_config is not None and strategy == ParallelismConfig.strategy:
        return strategy
    return choose_strategy(strategy, FSDPOptions.strategy if cfg.fsdp_config is not None else None,
                           options_source="key 'fsdp_config'")


def parallelism_problem(cfg: Any) -> str:
    """Why ``parallelism_config``'s sizes cannot make ``num_processes``, or cannot run on the
    device (ParallelismConfig's own rules), or ''."""
    sizes = parallelism_sizes(cfg)
    if sizes is None:
        return ""
    config = ParallelismConfig(**sizes)
    if cfg.num_processes is not None:
        try:
            config.for_world_size(cfg.num_processes)
        except ValueError as exc:
            return str(exc)
    return config.context_parallel_problem(cfg.device)
