"""The options of the built-in strategies, as frozen dataclasses (FSDP2's ``_fsdp_api.py`` style).

One class per strategy, validated once in ``__post_init__``: a bad value (a wrong type included) is a
``ValueError`` naming the field, the value and what is allowed, raised where the options are built — before any process group or model exists. Each class names the strategy it
configures (:attr:`StrategyOptions.strategy`), so options given alone can select their strategy
(:func:`anyaccel.strategies.choose_strategy`).

Why the built-in options live here and not beside their strategies: ``anyaccel launch`` and the
configuration file validate them in the launcher, which never imports torch; ``ddp.py`` and
``fsdp.py`` do. A strategy added outside anyaccel keeps its options in its own file.

Accelerate's spellings are converted into these by
:class:`~anyaccel.kwargs.DistributedDataParallelKwargs` (``to_options()``) and
:class:`~anyaccel.plugins.FullyShardedDataParallelPlugin` (``to_options()``; the config file's
``fsdp_config`` goes through it too). Local values; nothing here communicates.

Why this module is longer than ~450 lines: it holds the options of every built-in strategy
(DDP, FSDP2, N-D with its pipeline and sequence fields) in one place the launcher can import
without torch; each class is short, and they share the validation helpers above them.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable, ClassVar, Dict, Mapping, Optional, Tuple, Union

__all__ = ["StrategyOptions", "DDPOptions", "FSDPOptions", "ParallelismConfig", "TP_STYLES",
           "FSDP_WRAP_POLICIES", "MIXED_PRECISION_POLICY_FIELDS", "DDP_COMM_HOOKS", "DDP_COMM_WRAPPERS", "SP_BACKENDS",
           "SP_HANDLER_FIELDS", "PP_SCHEDULES"]

# keyword-only fields where Python has them (3.10+); every field has a default, so the order is free

FSDP_WRAP_POLICIES = ("transformer_based_wrap", "size_based_wrap", "no_wrap")
#: the fields of ``torch.distributed.fsdp.MixedPrecisionPolicy``
MIXED_PRECISION_POLICY_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
_CHECKPOINT_FORMATS = ("sharded", "full")
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


#: the tensor-parallel styles a plan may name as strings (transformers' ``tp_plan`` values)
TP_STYLES = ("colwise", "rowwise", "colwise_rep", "rowwise_rep", "colwise_gather_output", "embedding_rowwise",
             "sequence_parallel", "replicate")
#: the pipeline schedules (``torch.distributed.pipelining``'s names, matched case-insensitively) and how
#: each lays stages on the ``pp`` ranks: "single" (one stage per rank), "looped" (stage i on rank
#: i % pp_size, several per rank), "v" (two per rank, rank r holding r and 2*pp_size-1-r)
PP_SCHEDULES = {"1F1B": "single", "GPipe": "single", "Interleaved1F1B": "looped", "LoopedBFS": "looped",
                "InterleavedZeroBubble": "looped", "ZBVZeroBubble": "v", "DualPipeV": "v"}
#: the mesh dimensions, outermost first (pipeline stages and replicas across machines, tensor
#: parallel within one; sequence parallel beside context parallel)
MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "sp", "tp")


@dataclasses.dataclass(frozen=True)
class ParallelismConfig(StrategyOptions):
    """N-D parallelism (the ``nd`` strategy): Accelerate 1.15's ``ParallelismConfig`` names and
    defaults, plus anyaccel's tensor-parallel sources. Giving one to ``Accelerator(parallelism_config=...)``
    selects the ``nd`` strategy.

    Args:
        dp_replicate_size: full copies of the model (replicas; outermost mesh dimension, across
            machines). With ``dp_shard_size`` > 1 too: HSDP.
        dp_shard_size: processes each replica is sharded over by FSDP2.
        tp_size: tensor-parallel processes (innermost mesh dimension, within a machine).
        cp_size: context-parallel processes (needs CUDA SDPA; refused for now).
        pp_size: pipeline-parallel processes (outermost mesh dimension): the model is cut into
            stages at block boundaries and trained through a schedule with
            ``accelerator.pipeline_step`` (docs/guides/pipeline.md).
        sp_size: sequence-parallel processes, Ulysses style: each holds a slice of every sequence and
            attention runs on a slice of the heads (docs/guides/sequence.md).
        sp_backend: how ``sp_size`` is implemented: ``"ulysses"`` (default) or ``"deepspeed"``
            (Accelerate's value, its ALST/Ulysses): both run anyaccel's own Ulysses all-to-all over
            the ``sp`` mesh dimension; DeepSpeed is neither needed nor used.
        sp_handler: Accelerate's ``DeepSpeedSequenceParallelConfig`` (or a mapping of its fields,
            :data:`SP_HANDLER_FIELDS`): ``sp_seq_length`` with ``sp_seq_length_is_variable=False``
            makes every batch's sequence length a checked constant; ``sp_attn_implementation``
            (``"sdpa"`` or ``"eager"``) is the attention a transformers model runs per head slice.
        tp_plan: ``{module-name pattern: style}`` for ``tp_size`` > 1; a style is a
            ``torch.distributed.tensor.parallel`` ``ParallelStyle`` or one of :data:`TP_STYLES`.
            None: the model's own plan (transformers' ``_tp_plan`` / ``config.base_model_tp_plan``).
        parallelize_fn: ``parallelize_fn(model, device_mesh) -> model`` (Lightning Fabric's
            ``ModelParallelStrategy``): applies tensor parallelism itself, on ``device_mesh["tp"]``
            (the full mesh is passed). Excludes ``tp_plan``.
        fsdp: how the data-parallel dimensions shard (:class:`FSDPOptions`; default: its defaults).
        pp_schedule: the pipeline schedule (None: ``"1F1B"``), by ``torch.distributed.pipelining``'s
            name (case-insensitive): one of :data:`PP_SCHEDULES` — ``"GPipe"``, ``"1F1B"`` (one stage
            per rank), ``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"InterleavedZeroBubble"``
            (several stages per rank, looped), ``"ZBVZeroBubble"``, ``"DualPipeV"`` (two per rank,
            in a V).
        pp_microbatches: micro-batches each batch is cut into (its size must divide by it); None:
            as many as there are stages (``pp_size * pp_stages_per_rank``). More micro-batches
            shrink the idle "bubble", ``(stages - 1) / (microbatches + stages - 1)`` of a step.
        pp_stages_per_rank: stages each pipeline rank holds: 1 for GPipe/1F1B, 2 for the V
            schedules, >= 1 for the looped ones (None: 1, 2 and 2).
        pp_split_points: where stages begin, as the names of the model's blocks (e.g.
            ``("model.layers.2",)``): ``pp_size * pp_stages_per_rank - 1`` names in model order.
            None: the repeated blocks are cut evenly (the embedding goes with the first stage,
            the final norm and head with the last).

    A size left as None reads ``PARALLELISM_CONFIG_<NAME>`` from the environment (Accelerate's
    rule), else 1; so does every other field with an option row (``pp_schedule``,
    ``pp_microbatches``, ``pp_stages_per_rank``, ``pp_split_points``, ``sp_backend``: what
    ``anyaccel launch --parallelism_config_<name>`` or the config file's ``parallelism_config`` set),
    else its default. A value given here is checked by that row (:mod:`anyaccel.optionspec`: the
    same words from every entry point). The product of the sizes must be the number of processes; that is checked by
    :meth:`check_world_size` when the job is known. Local; nothing here communicates.
    """

    strategy: ClassVar[str] = "nd"

    dp_replicate_size: Optional[int] = None
    dp_shard_size: Optional[int] = None
    tp_size: Optional[int] = None
    cp_size: Optional[int] = None
    pp_size: Optional[int] = None
    sp_size: Optional[int] = None
    sp_backend: Optional[str] = None
    sp_handler: Any = None
    tp_plan: Optional[Mapping[str, Any]] = None
    parallelize_fn: Optional[Callable[..., Any]] = None
    fsdp: Optional[FSDPOptions] = None
    pp_schedule: Optional[str] = None
    pp_microbatches: Optional[int] = None
    pp_stages_per_rank: Optional[int] = None
    pp_split_points: Optional[Tuple[str, ...]] = None

    def __post_init__(self) -> None:
        from .. import envvars  # the variables' one home and parser

        for dim in MESH_DIM_NAMES:
            name = f"{dim}_size"
            value = getattr(self, name)
            if value is None:  # the launcher's value (Accelerate's rule), else 1
                var = envvars.PARALLELISM_SIZES.get(name)
                value = envvars.read(var) if var is not None else None
                value = 1 if value is None else value
                object.__setattr__(self, name, value)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelismConfig({name}={value!r}): must be an integer >= 1")
        if self.tp_plan is not None and self.parallelize_fn is not None:
            raise ValueError("ParallelismConfig: give tp_plan or parallelize_fn, not both (parallelize_fn applies "
                             "tensor parallelism itself)")
        if self.parallelize_fn is not None and not callable(self.parallelize_fn):
            raise ValueError(f"ParallelismConfig(parallelize_fn={self.parallelize_fn!r}): must be a function "
                             "(model, device_mesh) -> model")
        if self.tp_plan is not None:
            if not isinstance(self.tp_plan, Mapping):
                raise ValueError(f"ParallelismConfig(tp_plan={self.tp_plan!r}): must be a mapping of module-name "
                                 "patterns to styles, e.g. {'layers.*.fc1': 'colwise', 'layers.*.fc2': 'rowwise'}")
            bad = {k: v for k, v in self.tp_plan.items() if isinstance(v, str) and v not in TP_STYLES}
            if bad:
                raise ValueError(f"ParallelismConfig(tp_plan=...): unknown style(s) {bad}; use one of "
                                 f"{', '.join(TP_STYLES)} or a torch ParallelStyle")
        _check_sequence_parallel(self)
        if self.fsdp is None:
            object.__setattr__(self, "fsdp", FSDPOptions())
        elif not isinstance(self.fsdp, FSDPOptions):
            raise ValueError(f"ParallelismConfig(fsdp={self.fsdp!r}): must be FSDPOptions")
        _check_pipeline_fields(self)

    # Accelerate's derived values
    @property
    def total_size(self) -> int:
        """The number of processes these sizes describe."""
        s = self.sizes()
        return math.prod(s.values())

    @property
    def data_parallel_size(self) -> int:
        """Processes that see different batches: ``dp_replicate_size * dp_shard_size``."""
        s = self.sizes()
        return s["dp_replicate"] * s["dp_shard"]

    @property
    def non_data_parallel_size(self) -> int:
        """Processes that do not split the batch: ``pp_size * cp_size * sp_size * tp_size``."""
        s = self.sizes()
        return s["pp"] * s["cp"] * s["sp"] * s["tp"]

    dp_replicate_enabled = property(lambda self: self.dp_replicate_size > 1)
    dp_shard_enabled = property(lambda self: self.dp_shard_size > 1)
    tp_enabled = property(lambda self: self.tp_size > 1)
    cp_enabled = property(lambda self: self.cp_size > 1)
    pp_enabled = property(lambda self: self.pp_size > 1)
    sp_enabled = property(lambda self: self.sp_size > 1)

    def sizes(self) -> Dict[str, int]:
        """``{mesh dimension name: size}``, outermost first (:data:`MESH_DIM_NAMES`); every size is
        an int once ``__post_init__`` has run."""
        return {dim: getattr(self, f"{dim}_size") for dim in MESH_DIM_NAMES}

    def context_parallel_problem(self, device_type: str) -> str:
        """Why ``cp_size`` cannot be used on ``device_type`` ('' when it can): context parallelism
        needs SDPA attention on CUDA and anyaccel does not implement it yet. Local."""
        if self.cp_size == 1:
            return ""
        return (f"ParallelismConfig(cp_size={self.cp_size}): context parallelism needs SDPA attention on CUDA (torch's "
                "context_parallel shards only CUDA SDPA kernels; the CPU's has no sharding strategy) and is not "
                f"available in anyaccel yet (this job's device type: {device_type}); use sp_size={self.cp_size} instead "
                "(sequence parallelism also splits the sequence, on any device), or cp_size=1 and put those processes "
                "in dp_shard_size or tp_size")

    def for_world_size(self, world_size: int) -> "ParallelismConfig":
        """These sizes for a job of ``world_size`` processes: all sizes 1 means
        ``dp_replicate_size=world_size`` (Accelerate's rule: plain data parallelism); otherwise the
        product must be ``world_size`` — a ``ValueError`` naming each size and what to change."""
        if self.total_size == 1 and world_size > 1:
            return dataclasses.replace(self, dp_replicate_size=world_size)
        if self.total_size != world_size:
            sizes = " x ".join(f"{k}_size={v}" for k, v in self.sizes().items())
            others = self.non_data_parallel_size * self.sizes()["dp_replicate"]
            hint = f"dp_shard_size={world_size // others} with the others as they are, or " \
                if world_size % others == 0 else ""
            raise ValueError(f"ParallelismConfig: {sizes} = {self.total_size} processes, but this job has "
                             f"{world_size}; make the product of the sizes equal the number of processes ({hint}"
                             f"launch with --num_processes {self.total_size})")
        return self


def _field(config: ParallelismConfig, name: str) -> Any:
    """Field ``name`` of ``config`` as its option row takes it: when None, the launcher's value
    (``PARALLELISM_CONFIG_<NAME>``, read and checked by the row in :func:`anyaccel.envvars.read`),
    else the given value checked by the row (one wording from every entry point; a
    :class:`~anyaccel.errors.ConfigError`, which is a ``ValueError``). Local."""
    from .. import envvars, optionspec

    value = getattr(config, name)
    if value is None:
        var = envvars.PARALLELISM_FIELDS.get(name)
        return None if var is None else envvars.read(var)
    return optionspec.check(optionspec.option(name), value, f"ParallelismConfig.{name}")


def _check_pipeline_fields(config: ParallelismConfig) -> None:
    """Resolve (:func:`_field`) and normalise the ``pp_*`` fields of a frozen ``config``: schedule
    name in torch's spelling, stages per rank filled in, split points as a tuple; then the rules
    between fields. Local."""
    for name in ("pp_schedule", "pp_microbatches", "pp_stages_per_rank", "pp_split_points"):
        object.__setattr__(config, name, _field(config, name))
    canonical = config.pp_schedule or "1F1B"
    object.__setattr__(config, "pp_schedule", canonical)
    layout = PP_SCHEDULES[canonical]
    per_rank = config.pp_stages_per_rank
    needed = {"single": 1, "v": 2}.get(layout)
    if per_rank is None:
        per_rank = needed or 2
    elif needed is not None and per_rank != needed:
        raise ValueError(f"ParallelismConfig(pp_stages_per_rank={per_rank}): pp_schedule={canonical!r} runs "
                         f"{needed} stage{'s' if needed > 1 else ''} per rank; leave pp_stages_per_rank at None, or "
                         "choose a looped schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble) for more")
    object.__setattr__(config, "pp_stages_per_rank", per_rank)
    points = config.pp_split_points
    if points is not None:  # the row's text with commas
        points = tuple(str(points).split(","))
        object.__setattr__(config, "pp_split_points", points)
        pp = config.sizes()["pp"]  # an int once __post_init__ resolved the sizes
        stages = pp * per_rank
        if pp > 1 and len(points) != stages - 1:
            raise ValueError(f"ParallelismConfig(pp_split_points={points!r}): {len(points)} name(s) for "
                             f"pp_size={pp} x pp_stages_per_rank={per_rank} = {stages} stages; give "
                             f"{stages - 1} (the first block of every stage but the first)")


#: ``ParallelismConfig(sp_backend=...)``: anyaccel's name, and Accelerate's (its only value), both
#: anyaccel's Ulysses implementation
SP_BACKENDS = ("ulysses", "deepspeed")
#: the fields of Accelerate's ``DeepSpeedSequenceParallelConfig`` that ``sp_handler`` may carry
SP_HANDLER_FIELDS = ("sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation")
#: the attention a transformers model may run per head slice under ``sp_size`` > 1 (tested on CPU)
SP_ATTENTION = ("sdpa", "eager")


def _check_sequence_parallel(config: "ParallelismConfig") -> None:
    """``sp_backend`` resolved (None: ``"ulysses"``) and ``sp_handler`` turned into a dict of
    :data:`SP_HANDLER_FIELDS` with checked values; ``sp_size`` beside ``cp_size`` refused (Accelerate's
    rule: both split the sequence)."""
    backend = _field(config, "sp_backend")  # both run anyaccel's Ulysses all-to-all
    object.__setattr__(config, "sp_backend", "ulysses" if backend is None else backend)
    handler = config.sp_handler
    if handler is not None:
        if isinstance(handler, Mapping):
            unknown = [k for k in handler if k not in SP_HANDLER_FIELDS]
            if unknown:
                raise ValueError(f"ParallelismConfig(sp_handler=...): unknown field(s) {unknown}; known: "
                                 f"{', '.join(SP_HANDLER_FIELDS)}")
            fields = {k: handler.get(k) for k in SP_HANDLER_FIELDS}
        elif any(hasattr(handler, k) for k in SP_HANDLER_FIELDS):  # Accelerate's DeepSpeedSequenceParallelConfig
            fields = {k: getattr(handler, k, None) for k in SP_HANDLER_FIELDS}
        else:
            raise ValueError(f"ParallelismConfig(sp_handler={handler!r}): pass Accelerate's "
                             f"DeepSpeedSequenceParallelConfig or a dict of its fields ({', '.join(SP_HANDLER_FIELDS)})")
        length, variable, attention = (fields[k] for k in SP_HANDLER_FIELDS)
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
            raise ValueError(f"ParallelismConfig(sp_handler): sp_seq_length={length!r} must be an integer >= 1")
        if variable is not None and not isinstance(variable, bool):
            raise ValueError(f"ParallelismConfig(sp_handler): sp_seq_length_is_variable={variable!r} must be True or "
                             "False")
        if variable is False and length is None:
            raise ValueError("ParallelismConfig(sp_handler): sp_seq_length_is_variable=False needs sp_seq_length (the "
                             "length every batch has)")
        if attention is not None and attention not in SP_ATTENTION:
            raise ValueError(f"ParallelismConfig(sp_handler): sp_attn_implementation={attention!r}; anyaccel's Ulysses "
                             f"runs {' or '.join(map(repr, SP_ATTENTION))} (flash and flex attention are not supported "
                             "yet)")
        object.__setattr__(config, "sp_handler", fields)
    sizes = config.sizes()
    if sizes["sp"] > 1 and sizes["cp"] > 1:
        raise ValueError(f"ParallelismConfig(sp_size={sizes['sp']}, cp_size={sizes['cp']}): sequence and context "
                         "parallelism both split the sequence; use one of them (set the other to 1)")
    length = config.sp_handler["sp_seq_length"] if config.sp_handler else None
    if length is not None and length % sizes["sp"]:
        raise ValueError(f"ParallelismConfig(sp_size={sizes['sp']}, sp_handler): sp_seq_length={length} is not a "
                         f"multiple of sp_size; every sp rank takes an equal slice of the sequence")


