"""Strategy options as frozen dataclasses (FSDP2's ``_fsdp_api.py`` style): the base class every
strategy's options derive from, the shared checks, and the DDP strategy's :class:`DDPOptions`.

One class per strategy, validated once in ``__post_init__``: a bad value (a wrong type included) is a
``ValueError`` naming the field, the value and what is allowed, raised where the options are built
— before any process group or model exists. Each class names the strategy it configures
(:attr:`StrategyOptions.strategy`), so options given alone can select their strategy
(:func:`anyaccel.strategies.choose_strategy`).

The options of the strategies that are packages live in their package, each importable without
torch (``anyaccel launch`` and the configuration file validate them in the launcher, which never
imports torch): :class:`~anyaccel.strategies.fsdp.options.FSDPOptions`,
:class:`~anyaccel.strategies.nd.options.ParallelismConfig`,
:class:`~anyaccel.strategies.deepspeed.config.DeepSpeedOptions`. This module stays the one place
users import every built-in option class from (``from anyaccel.strategies.options import
FSDPOptions, ParallelismConfig``, as before the packages): :data:`_MOVED` names each one's home,
read on first use. A strategy added outside anyaccel keeps its options in its own file.

Accelerate's spellings are converted into these by
:class:`~anyaccel.kwargs.DistributedDataParallelKwargs` (``to_options()``) and
:class:`~anyaccel.plugins.FullyShardedDataParallelPlugin` (``to_options()``; the config file's
``fsdp_config`` goes through it too). Local values; nothing here communicates.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from typing import Any, ClassVar, Dict, Mapping, Optional, Tuple, Union

__all__ = ["StrategyOptions", "DDPOptions", "DDP_COMM_HOOKS", "DDP_COMM_WRAPPERS"]

# keyword-only fields where Python has them (3.10+); every field has a default, so the order is free (3.10+); every field has a default, so the order is free

#: DDP communication hooks by Accelerate's names (``DDPCommunicationHookType`` values); torch ships
#: them in ``torch.distributed.algorithms.ddp_comm_hooks``
DDP_COMM_HOOKS = ("no", "fp16", "bf16", "power_sgd", "batched_power_sgd")
#: the hooks that can wrap another (compress what the wrapped hook sends)
DDP_COMM_WRAPPERS = ("no", "fp16", "bf16")
#: ``PowerSGDState``'s keyword arguments (``comm_state_option``), torch 2.9 to 2.13
_POWER_SGD_STATE_OPTIONS = ("matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
                            "use_error_feedback", "warm_start", "orthogonalization_epsilon", "random_seed",
                            "compression_stats_logging_frequency", "batch_tensors_with_same_shape")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StrategyOptions:
    """The base of every strategy's options: :attr:`strategy` names the strategy they configure."""

    #: the registered name of the strategy these options configure
    strategy: ClassVar[str] = ""


def _check_bool(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}({name}={value!r}): must be True or False, not {type(value).__name__}")


def _coerce_bool(options: Any, owner: str, name: str) -> None:
    """Accept the ints 0 and 1 (what YAML and argparse give) for a bool field of frozen
    ``options``; refuse every other non-bool."""
    value = getattr(options, name)
    if type(value) is int and value in (0, 1):
        object.__setattr__(options, name, bool(value))
    else:
        _check_bool(owner, name, value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DDPOptions(StrategyOptions):
    """``torch.nn.parallel.DistributedDataParallel``'s options (its own names and defaults).

    ``bucket_cap_mb``: gradient bucket size in MiB (> 0; None: torch's default). The bool fields
    accept 0 and 1 too (as YAML and argparse give them). ``find_unused_parameters``: look for
    parameters that got no gradient (costs a graph walk per step). ``static_graph``: the graph is
    the same every step (lets DDP skip work). The others are DDP's, passed as they are.

    Communication hooks (Accelerate's ``comm_hook``/``comm_wrapper``/``comm_state_option``,
    registered with ``register_comm_hook`` on the wrapped model, not passed to DDP's constructor):
    ``comm_hook`` one of :data:`DDP_COMM_HOOKS` — ``"fp16"``/``"bf16"`` send gradients in half
    precision, ``"power_sgd"``/``"batched_power_sgd"`` send a low-rank approximation (PowerSGD);
    ``comm_wrapper`` one of :data:`DDP_COMM_WRAPPERS` compresses what a PowerSGD hook sends;
    ``comm_state_option`` are ``PowerSGDState``'s keyword arguments (e.g.
    ``{"matrix_approximation_rank": 2}``; PowerSGD hooks only). Enum members
    (``DDPCommunicationHookType.FP16``) are accepted and stored as their values."""

    strategy: ClassVar[str] = "ddp"

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: Optional[Union[int, float]] = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: str = "no"
    comm_wrapper: str = "no"
    comm_state_option: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)  # a dict: left out of hash()

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise ValueError(f"DDPOptions(dim={self.dim!r}): must be an integer (the batch dimension)")
        if self.bucket_cap_mb is not None and (isinstance(self.bucket_cap_mb, bool)
                                               or not isinstance(self.bucket_cap_mb, (int, float))
                                               or self.bucket_cap_mb <= 0):
            raise ValueError(f"DDPOptions(bucket_cap_mb={self.bucket_cap_mb!r}): must be a number of MiB > 0, or "
                             "None (torch's default, 25 MiB)")
        for name in ("broadcast_buffers", "find_unused_parameters", "check_reduction", "gradient_as_bucket_view",
                     "static_graph"):
            _coerce_bool(self, "DDPOptions", name)
        self._check_comm_hook()

    def _check_comm_hook(self) -> None:
        for name, choices in (("comm_hook", DDP_COMM_HOOKS), ("comm_wrapper", DDP_COMM_WRAPPERS)):
            value = getattr(self, name)
            value = getattr(value, "value", value)  # DDPCommunicationHookType.FP16 -> "fp16"
            value = value.lower() if isinstance(value, str) else value
            if value not in choices:
                raise ValueError(f"DDPOptions({name}={getattr(self, name)!r}): choose one of {', '.join(choices)} "
                                 "(Accelerate's DDPCommunicationHookType values)")
            object.__setattr__(self, name, value)
        options = self.comm_state_option
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise ValueError(f"DDPOptions(comm_state_option={options!r}): must be a dict of PowerSGDState's keyword "
                             f"arguments, e.g. {{'matrix_approximation_rank': 2}}")
        unknown = [k for k in options if k not in _POWER_SGD_STATE_OPTIONS]
        if unknown:
            raise ValueError(f"DDPOptions(comm_state_option=...): unknown PowerSGDState option(s) {unknown}; known: "
                             f"{', '.join(_POWER_SGD_STATE_OPTIONS)}")
        # Accelerate ignores these two silently; they stay accepted (the script starts) and say so
        if options and self.comm_hook not in ("power_sgd", "batched_power_sgd"):
            warnings.warn(f"DDPOptions(comm_state_option={dict(options)!r}) configures PowerSGD, but "
                          f"comm_hook={self.comm_hook!r}: it has no effect (use comm_hook='power_sgd' or "
                          "'batched_power_sgd')", stacklevel=4)
        if self.comm_wrapper != "no" and self.comm_hook == "no":
            warnings.warn(f"DDPOptions(comm_wrapper={self.comm_wrapper!r}) wraps a communication hook, but "
                          f"comm_hook='no': it has no effect (set comm_hook, e.g. 'power_sgd', or use "
                          f"comm_hook={self.comm_wrapper!r} alone to compress the plain all-reduce)", stacklevel=4)
        object.__setattr__(self, "comm_state_option", dict(options))

    def ddp_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments for ``DistributedDataParallel``: only the values that differ from its
        defaults (so names torch deprecates are not passed needlessly); the communication hook is
        not one of them (see :meth:`comm_hook_spec`)."""
        default = type(self)()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in _COMM_FIELDS and getattr(self, f.name) != getattr(default, f.name)}

    def comm_hook_spec(self) -> Optional[Tuple[str, str, Dict[str, Any]]]:
        """``(comm_hook, comm_wrapper, comm_state_option)`` when a hook is asked for, else None."""
        if self.comm_hook == "no":
            return None
        return self.comm_hook, self.comm_wrapper, dict(self.comm_state_option)


_COMM_FIELDS = ("comm_hook", "comm_wrapper", "comm_state_option")


#: the option classes (and their constants) whose home is a strategy's package, by public name
_MOVED = {name: "anyaccel.strategies.fsdp.options" for name in (
    "FSDPOptions", "FSDP_WRAP_POLICIES", "MIXED_PRECISION_POLICY_FIELDS")}
_MOVED.update({name: "anyaccel.strategies.nd.options" for name in (
    "ParallelismConfig", "TP_STYLES", "PP_SCHEDULES", "MESH_DIM_NAMES", "SP_BACKENDS", "SP_HANDLER_FIELDS",
    "SP_ATTENTION")})
_MOVED.update({name: "anyaccel.strategies.deepspeed.config" for name in ("DeepSpeedOptions", "OFFLOAD_DEVICES")})


def __getattr__(name: str) -> Any:
    """The option classes whose home is a strategy's package, by their public name here. Local."""
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module 'anyaccel.strategies.options' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
