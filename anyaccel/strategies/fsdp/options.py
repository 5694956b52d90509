"""The ``fsdp`` strategy's options: :class:`FSDPOptions`, FSDP2's settings in FSDP2's terms (a frozen
dataclass validated once, where it is built). Imports no torch: ``anyaccel launch`` and the
configuration file check ``fsdp_config`` through it before anything starts. The ``nd`` strategy's
:class:`~anyaccel.strategies.nd.options.ParallelismConfig` reuses it for its shard dimension. Local
values; nothing here communicates.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Mapping, Optional, Tuple, Union

from ..options import StrategyOptions, _check_bool

__all__ = ["FSDPOptions", "FSDP_WRAP_POLICIES", "MIXED_PRECISION_POLICY_FIELDS"]

FSDP_WRAP_POLICIES = ("transformer_based_wrap", "size_based_wrap", "no_wrap")
#: the fields of ``torch.distributed.fsdp.MixedPrecisionPolicy``
MIXED_PRECISION_POLICY_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
_CHECKPOINT_FORMATS = ("sharded", "full")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FSDPOptions(StrategyOptions):
    """How FSDP2 (``torch.distributed.fsdp.fully_shard``) shards a model, in FSDP2's terms.

    Args:
        reshard_after_forward: ``True`` frees the gathered parameters after the forward (least
            memory), ``False`` keeps them for the backward (less communication), an int ``n`` > 1
            reshards to groups of ``n`` ranks (FSDP2's meaning). With ``True`` and blocks, the
            root unit (parameters outside every block: embeddings, head) keeps its parameters for
            the backward, as FSDP2 does by default: backward needs them first.
        auto_wrap_policy: which submodules become their own FSDP unit: one of
            :data:`FSDP_WRAP_POLICIES`, a callable ``module -> bool``, or ``None`` (class names if
            given, else size if ``min_num_params`` is given, else the model's
            ``_no_split_modules``, else the root only).
        transformer_cls_names_to_wrap: class names whose instances are units.
        min_num_params: the threshold of ``"size_based_wrap"`` (>= 1).
        mixed_precision_policy: ``None`` derives it from the accelerator's ``mixed_precision``
            (compute in bf16/fp16, reduce gradients in fp32); else a
            ``torch.distributed.fsdp.MixedPrecisionPolicy`` or a mapping of its fields (dtypes or
            their names, e.g. ``{"param_dtype": "bfloat16"}``).
        cpu_offload: keep shards, gradients and optimizer state in host memory (GPU jobs only).
        activation_checkpointing: recompute each unit's activations in backward.
        checkpoint_format: ``"sharded"`` (each rank writes its shard through
            torch.distributed.checkpoint) or ``"full"`` (rank 0 writes full files, as DDP does).
        sync_module_states: every rank starts from rank 0's weights before sharding.
    """

    strategy: ClassVar[str] = "fsdp"

    reshard_after_forward: Union[bool, int] = True
    auto_wrap_policy: Union[None, str, Callable[[Any], bool]] = None
    transformer_cls_names_to_wrap: Tuple[str, ...] = ()
    min_num_params: Optional[int] = None
    mixed_precision_policy: Any = None
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    checkpoint_format: str = "sharded"
    sync_module_states: bool = True

    def __post_init__(self) -> None:
        reshard = self.reshard_after_forward
        if not isinstance(reshard, (bool, int)) or (not isinstance(reshard, bool) and reshard < 2):
            raise ValueError(f"FSDPOptions(reshard_after_forward={reshard!r}): use True, False, or an int >= 2 "
                             "(the size of the groups parameters are resharded to)")
        policy = self.auto_wrap_policy
        if isinstance(policy, str):
            if policy not in FSDP_WRAP_POLICIES:
                raise ValueError(f"auto_wrap_policy={policy!r}; choose one of {', '.join(FSDP_WRAP_POLICIES)} "
                                 "or pass a callable module -> bool")
        elif policy is not None and not callable(policy):
            raise ValueError(f"auto_wrap_policy={policy!r} is neither a policy name nor a callable")
        names = self.transformer_cls_names_to_wrap
        if isinstance(names, str) or not all(isinstance(n, str) and n for n in names or ()):
            raise ValueError(f"FSDPOptions(transformer_cls_names_to_wrap={names!r}): must be a sequence of class "
                            "names such as ('TransformerEncoderLayer',)")
        object.__setattr__(self, "transformer_cls_names_to_wrap", tuple(names or ()))
        if self.min_num_params is not None and (isinstance(self.min_num_params, bool)
                                                or not isinstance(self.min_num_params, int) or self.min_num_params < 1):
            raise ValueError(f"min_num_params={self.min_num_params!r} must be an integer >= 1")
        _check_mixed_precision_policy(self.mixed_precision_policy)
        if self.checkpoint_format not in _CHECKPOINT_FORMATS:
            raise ValueError(f"FSDPOptions(checkpoint_format={self.checkpoint_format!r}): choose "
                             f"{' or '.join(_CHECKPOINT_FORMATS)}")
        for name in ("cpu_offload", "activation_checkpointing", "sync_module_states"):
            _check_bool("FSDPOptions", name, getattr(self, name))

    def wrap_policy(self) -> str:
        """The effective policy name (or ``"callable"``, or ``"default"``) before the model is seen."""
        if callable(self.auto_wrap_policy):
            return "callable"
        if self.auto_wrap_policy:
            return self.auto_wrap_policy
        if self.transformer_cls_names_to_wrap:
            return "transformer_based_wrap"
        if self.min_num_params:
            return "size_based_wrap"
        return "default"


def _check_mixed_precision_policy(policy: Any) -> None:
    """A MixedPrecisionPolicy, a mapping of its fields, or None (dtype names are resolved, and
    checked, by the strategy, which imports torch)."""
    if policy is None:
        return
    if isinstance(policy, Mapping):
        unknown = [k for k in policy if k not in MIXED_PRECISION_POLICY_FIELDS]
        if unknown:
            raise ValueError(f"mixed_precision_policy has unknown field(s) {unknown}; "
                             f"known: {', '.join(MIXED_PRECISION_POLICY_FIELDS)}")
        return
    if all(hasattr(policy, name) for name in MIXED_PRECISION_POLICY_FIELDS):
        return  # torch.distributed.fsdp.MixedPrecisionPolicy (or the same fields)
    raise ValueError(f"mixed_precision_policy={policy!r}; pass a MixedPrecisionPolicy, a dict of its fields, "
                     "or None (derived from mixed_precision)")
