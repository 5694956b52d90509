"""The N-D family's options: :class:`ParallelismConfig` (Accelerate 1.15's names and defaults, plus
anyaccel's tensor-parallel, sequence and pipeline fields), as a frozen dataclass validated once,
where it is built. Imports no torch: ``anyaccel launch`` and the configuration file check
``parallelism_config`` through it before anything starts. The sizes' rule against the number of
processes is the mesh's (:func:`anyaccel.strategies.mesh.resolve_sizes`); the dimensions are the
mesh's (:data:`anyaccel.strategies.mesh.DIMS`). Local values; nothing here communicates.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar, Dict, Mapping, Optional, Tuple

from ..fsdp.options import FSDPOptions
from ..mesh import DIMS, resolve_sizes
from ..options import StrategyOptions

__all__ = ["ParallelismConfig", "TP_STYLES", "PP_SCHEDULES", "MESH_DIM_NAMES", "SP_BACKENDS", "SP_HANDLER_FIELDS",
           "SP_ATTENTION"]

#: the tensor-parallel styles a plan may name as strings (transformers' ``tp_plan`` values)
TP_STYLES = ("colwise", "rowwise", "colwise_rep", "rowwise_rep", "colwise_gather_output", "embedding_rowwise",
             "sequence_parallel", "replicate")
#: the pipeline schedules (``torch.distributed.pipelining``'s names, matched case-insensitively) and how
#: each lays stages on the ``pp`` ranks: "single" (one stage per rank), "looped" (stage i on rank
#: i % pp_size, several per rank), "v" (two per rank, rank r holding r and 2*pp_size-1-r)
PP_SCHEDULES = {"1F1B": "single", "GPipe": "single", "Interleaved1F1B": "looped", "LoopedBFS": "looped",
                "InterleavedZeroBubble": "looped", "ZBVZeroBubble": "v", "DualPipeV": "v"}
#: the mesh dimensions, outermost first: the mesh's (:data:`anyaccel.strategies.mesh.DIMS`)
MESH_DIM_NAMES = DIMS


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
    :meth:`for_world_size` (the mesh's rule) when the job is known. Local; nothing here communicates.
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
        from ... import envvars  # the variables' one home and parser

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
        """These sizes for a job of ``world_size`` processes, by the mesh's rule
        (:func:`~anyaccel.strategies.mesh.resolve_sizes`): all sizes 1 means
        ``dp_replicate_size=world_size`` (Accelerate's rule: plain data parallelism); otherwise the
        product must be ``world_size`` — a ``ValueError`` naming each size and what to change."""
        sizes = resolve_sizes(self.sizes(), world_size, owner="ParallelismConfig")
        if sizes == self.sizes():
            return self
        return dataclasses.replace(self, dp_replicate_size=sizes["dp_replicate"])  # the one size the rule fills


def _field(config: ParallelismConfig, name: str) -> Any:
    """Field ``name`` of ``config`` as its option row takes it: when None, the launcher's value
    (``PARALLELISM_CONFIG_<NAME>``, read and checked by the row in :func:`anyaccel.envvars.read`),
    else the given value checked by the row (one wording from every entry point; a
    :class:`~anyaccel.errors.ConfigError`, which is a ``ValueError``). Local."""
    from ... import envvars, optionspec

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
