"""Configuration keys that select a strategy: ``parallelism_config`` (the N-D sizes, in
Accelerate's spelling) selects ``nd``, ``fsdp_config`` alone selects ``fsdp``. One home for the rule
used by the schema's checks, the wizard and ``anyaccel launch``'s planner; the strategies'
own option classes (:mod:`anyaccel.strategies.options`) say what the values mean."""

from __future__ import annotations

import warnings
from typing import Any, Dict, Mapping, Optional

from ..errors import ConfigError
from ..strategies import choose_strategy
from ..strategies.options import FSDPOptions, ParallelismConfig

__all__ = ["PARALLELISM_KEYS", "check_parallelism", "effective_strategy", "parallelism_problem", "parallelism_sizes"]

#: the ``parallelism_config`` keys: Accelerate's config-file spelling, one per ParallelismConfig size
PARALLELISM_KEYS = tuple(f"parallelism_config_{f}" for f in ("dp_replicate_size", "dp_shard_size", "tp_size",
                                                             "cp_size"))
#: Accelerate's context/sequence-parallel settings, meaningless while their size is 1 (an
#: Accelerate config writes them with cp_size 1): ignored then, with a warning; refused otherwise
_OFF_WHEN_SIZE_1 = {f"parallelism_config_{k}": f"parallelism_config_{size}" for k, size in (
    ("cp_backend", "cp_size"), ("cp_comm_strategy", "cp_size"), ("sp_size", "sp_size"), ("sp_backend", "sp_size"),
    ("sp_seq_length", "sp_size"), ("sp_seq_length_is_variable", "sp_size"), ("sp_attn_implementation", "sp_size"))}
ALLOWED = f"a mapping of {', '.join(PARALLELISM_KEYS)} to integers >= 1"


def check_parallelism(value: Any, source: Optional[str]) -> Dict[str, int]:
    """``parallelism_config``: Accelerate's keys (the ``parallelism_config_`` prefix may be left
    out), each an integer >= 1; returned with Accelerate's spelling."""
    def bad(problem: str) -> ConfigError:
        return ConfigError(f"key 'parallelism_config' {problem}; allowed: {ALLOWED}",
                           source=source, key="parallelism_config")

    if not isinstance(value, Mapping):
        raise bad(f"is a {type(value).__name__} ({value!r})")
    out: Dict[str, int] = {}
    full_keys = {(k if str(k).startswith("parallelism_config_") else f"parallelism_config_{k}"): k for k in value}
    unused = [k for k in full_keys if k in _OFF_WHEN_SIZE_1]
    for full in unused:
        size = value.get(full_keys.get(_OFF_WHEN_SIZE_1[full], ""), 1)
        if size not in (None, 1):
            said = "" if _OFF_WHEN_SIZE_1[full] == full else f" with {_OFF_WHEN_SIZE_1[full]} {size}"
            raise bad(f"has the key {full_keys[full]!r}{said}, which anyaccel does not implement (no context-parallel "
                      "or sequence-parallel options)")
    if unused:
        warnings.warn(f"parallelism_config: {', '.join(full_keys[k] for k in unused)} ignored (Accelerate's "
                      "context/sequence-parallel settings; their size is 1 here, so they have no effect)", stacklevel=3)
    for key, size in value.items():
        full = key if str(key).startswith("parallelism_config_") else f"parallelism_config_{key}"
        if full in _OFF_WHEN_SIZE_1:
            continue
        if full not in PARALLELISM_KEYS:
            raise bad(f"has the key {key!r}, which anyaccel does not implement (no sequence parallelism or "
                      "context-parallel options)")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise bad(f"has {key}: {size!r}, which is not an integer >= 1")
        out[full] = size
    return out


def parallelism_sizes(cfg: Any) -> Optional[Dict[str, int]]:
    """``cfg.parallelism_config`` as ``ParallelismConfig`` keyword arguments (every size, 1 where
    not given), or None when the key is not set."""
    if cfg.parallelism_config is None:
        return None
    return {k[len("parallelism_config_"):]: cfg.parallelism_config.get(k, 1) for k in PARALLELISM_KEYS}


def effective_strategy(cfg: Any) -> Optional[str]:
    """The strategy ``cfg`` asks for, with the registry's rule for options that select their
    strategy: ``parallelism_config`` selects ``nd`` (whose data-parallel sharding ``fsdp_config``
    then configures), ``fsdp_config`` alone selects ``fsdp``. None: decided at run time. Raises
    ``ValueError`` for a contradiction. Local; used by the schema's rules and ``anyaccel launch``."""
    strategy = choose_strategy(cfg.strategy, ParallelismConfig.strategy if cfg.parallelism_config is not None
                               else None, options_source="key 'parallelism_config'")
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
