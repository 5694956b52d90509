"""N-D parallelism: one device mesh for replicas x FSDP shards x sequence parallel x tensor parallel (``nd``).

Configured by :class:`~.options.ParallelismConfig` (Accelerate's names). The mesh is built once
from the Environment and the backend's device type, dimensions outermost first
``("pp", "dp_replicate", "dp_shard", "cp", "sp", "tp")`` — replicas across machines, tensor parallel
within one — keeping only the dimensions with a size above 1 (and ``dp_shard``, FSDP's, always).

``wrap`` (collective), in torchtitan's order: every rank starts from rank 0's weights; tensor
parallel (the user's ``tp_plan``, the model's own transformers plan, or ``parallelize_fn(model,
mesh)``) on the ``tp`` sub-mesh (:mod:`.tensor_parallel`); the experts of MoE layers split over
the mesh's ``experts`` group (``ep_size`` > 1: :mod:`.expert`); sequence parallelism's attention and
loss hooks (``sp_size`` > 1: :mod:`.sequence`); activation checkpointing; then ``fully_shard`` on
the mesh's ``sharding`` sub-mesh (``("dp_replicate", "dp_shard")``: HSDP when both exceed 1; with
``sp``, ``dp_shard x sp`` flattened, as torchtitan's ``dp_shard_cp``) — the experts first, each
its own unit over ``expert_sharding``. Parameters keep their names; optimizers built before are
remapped by name.

Composition (docs/concepts/architecture.md): the mesh provides the processes, FSDP shards. This is
a :class:`~anyaccel.strategies.fsdp.ShardedStrategy` (what every DTensor-parameter strategy shares:
optimizer remapping, collective state dicts, sharded checkpoints, the group of one) whose
:attr:`NDStrategy.sharding` is an :class:`~anyaccel.strategies.fsdp.sharding.FSDPSharding` given
the mesh's ``sharding`` sub-mesh (with ``sp``: ``dp_shard x sp``) — the same sharding code the
``fsdp`` strategy runs over its 1-D mesh. Pipeline stages (``pp_size`` > 1, the outermost
dimension; never with ``sp``): the :class:`~.pipeline.strategy.PipelinedStrategy` mixin cuts the
model first, and each of this rank's stages is parallelized as above and sharded with
``self.sharding.shard``. Its capabilities (:mod:`anyaccel.strategies.capabilities`):
:class:`~anyaccel.strategies.capabilities.Pipelined` and
:class:`~anyaccel.strategies.capabilities.SequenceParallel`.

The rest of the job respects the mesh: loaders shard by its ``batch`` (the ranks of one TP or sp
group see the same batch; sp ranks then keep their slice of it, :meth:`NDStrategy.sequence_feed`),
``gather_for_metrics`` keeps one share per batch (``keeps_metrics_share``), the loss is averaged
over its ``loss`` group, and ``clip_grad_norm_`` is the global norm over DTensors of every mesh.
``save_state`` writes torch.distributed.checkpoint shards as FSDP does, keyed by parameter name,
so ``load_state`` reshards them into any layout (TP2xDP2 into FSDP or DDP over 4, one process, and
back: tests/checkpoint/test_nd_checkpoint_multiprocess.py, docs/guides/nd-parallel.md "Checkpoints").
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import torch

from ...environment import DistributedType
from ..capabilities import Feed, SequenceParallel
from ..fsdp import ties
from ..fsdp.sharding import _fsdp
from ..fsdp.strategy import ShardedStrategy, _broadcast_from_rank0
from ..loss import SequenceGroup
from ..mesh import ProcessMesh
from . import tensor_parallel
from .options import ParallelismConfig
from .pipeline.strategy import PipelinedStrategy
from .tensor_parallel import check_tp_divisibility, tp_styles

__all__ = ["NDStrategy", "tp_styles", "check_tp_divisibility"]


class NDStrategy(PipelinedStrategy, ShardedStrategy, SequenceParallel):
    """Replicas x FSDP2 shards x sequence parallel x tensor parallel over one named device mesh,
    optionally cut into pipeline stages (:class:`~.pipeline.strategy.PipelinedStrategy`).
    ``self.config`` (and ``self.options``) is the :class:`ParallelismConfig` (sizes resolved for
    this job); its ``fsdp`` part configures :attr:`sharding`, an
    :class:`~anyaccel.strategies.fsdp.sharding.FSDPSharding` over the mesh's ``sharding`` sub-mesh
    (:attr:`mesh`: 2-D for HSDP; with ``sp_size`` > 1 the shard dimension is ``dp_shard x sp``
    flattened, torchtitan's ``dp_shard_cp``: sp ranks hold the same parameters and see other
    tokens), which shards the whole model or each pipeline stage. Reported as ``FSDP`` when parameters are sharded over data-parallel ranks, else as the
    environment's type."""

    name = "nd"
    options_type = ParallelismConfig
    options: ParallelismConfig

    def __init__(self, env: Any, backend: Any, options: Optional[ParallelismConfig] = None,
                 mixed_precision: str = "no", dynamo: Any = None):
        config = ParallelismConfig() if options is None else options
        if not isinstance(config, ParallelismConfig):
            raise TypeError(f"the 'nd' strategy takes ParallelismConfig; got {type(config).__name__}")
        self.config = config.for_world_size(env.world_size)  # sizes vs processes: the mesh's rule, the one early error
        self.parallelism_config = self.config  # what Accelerator.parallelism_config reports
        if self.config.context_parallel_problem(backend.device_type):
            raise NotImplementedError(self.config.context_parallel_problem(backend.device_type))
        if self.config.pp_size > 1:
            from .pipeline.schedule import pipeline_problem  # what pp does not combine with (sp among them), and why

            problem = pipeline_problem(self.config, mixed_precision)
            if problem:
                raise ValueError(problem)
        super().__init__(env, backend, self.config, mixed_precision, dynamo)
        assert self.config.fsdp is not None  # ParallelismConfig fills it in
        if self.config.fsdp.cpu_offload:
            raise ValueError("ParallelismConfig(fsdp=FSDPOptions(cpu_offload=True)) is not supported by the 'nd' "
                             "strategy yet; leave cpu_offload off")
        self._sequence: Optional[SequenceGroup] = None  # built with the mesh's groups (nd/sequence/)
        self._sequence_undo: List[Any] = []  # what undoes the transformers hooks (teardown)
        self._use_sharding(self.config.fsdp)  # FSDP2 over the mesh's sharding sub-mesh (data parallel x sp)
        self._pipeline: Any = None  # under pp: this rank's stages and their schedule (nd/pipeline/)

    def make_process_mesh(self) -> ProcessMesh:
        """The job's processes on the config's sizes (``dp_shard`` kept at size 1: FSDP2 always
        has a dimension to shard over). Local."""
        return ProcessMesh(self.config.sizes(), self.env.rank, self.backend.device_type,
                           world_size=self.env.world_size, keep=("dp_shard",), owner="ParallelismConfig",
                           ep=self.config.ep_size)

    @property
    def distributed_type(self) -> DistributedType:
        return DistributedType.FSDP if self.config.dp_shard_size > 1 else self.env.distributed_type

    # ---- the mesh (every answer is the process mesh's) -------------------------------------------
    @property
    def device_mesh(self) -> Any:
        """The job's named mesh (``accelerator.torch_device_mesh``): the process mesh's. Collective
        the first time (every rank creates the sub-groups)."""
        return self.process_mesh.device_mesh

    def rank_in(self, dim: str) -> int:
        """This process's coordinate along mesh dimension ``dim`` (0 where the dimension has size
        1): the process mesh's. Local."""
        return self.process_mesh.coordinate(dim)

    def sequence_slice(self) -> Tuple[int, int, Optional[int]]:
        """This process's slice of every sequence (its ``sp`` coordinate of ``sp_size``) and the
        length ``sp_handler`` declares constant (None: any). Local."""
        handler = self.config.sp_handler or {}
        fixed = handler.get("sp_seq_length") if handler.get("sp_seq_length_is_variable") is False else None
        return self.process_mesh.coordinate("sp"), self.process_mesh.size("sp"), fixed

    def sequence_feed(self, feed: Feed) -> Feed:
        """``feed`` with every batch cut into this process's slice of each sequence first (``feed``
        itself without sequence parallelism). Local."""
        rank, size, fixed = self.sequence_slice()
        if size == 1:
            return feed
        from .sequence.loader import SequenceSlicer, sliced_feed

        return sliced_feed(SequenceSlicer(rank, size, fixed, keep_padding=self.config.ep_size > 1), feed)

    def sequence_group(self) -> SequenceGroup:
        """The ``sp`` group, and the processes whose tokens make one global batch (the mesh's
        ``loss``: data parallel x sp, not TP, whose ranks compute the same loss). Collective the
        first time (it builds groups)."""
        if self._sequence is None:
            mesh = self.process_mesh
            rank, size, fixed = self.sequence_slice()
            self._sequence = SequenceGroup(
                group=mesh.group("sp"), size=size, rank=rank, loss_group=mesh.group("loss"),
                loss_size=mesh.size("gradients"), attention=(self.config.sp_handler or {}).get("sp_attn_implementation"),
                seq_length=fixed)
        return self._sequence

    def token_group(self) -> SequenceGroup:
        """Where this process's tokens count: :meth:`sequence_group` (with ``sp_size`` 1, no slices). Collective
        the first time."""
        return self.sequence_group()

    # ---- wrapping -------------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module, device_placement: bool, evaluation_mode: bool) -> torch.nn.Module:
        """Under pp a model to train cut into stages first (the mixin's); otherwise FSDP's. A model
        that is not wrapped (evaluation only, or frozen) still gets sequence parallelism under
        ``sp_size`` > 1 (the loader hands it slices too) and its experts split under ``ep_size`` > 1
        (:func:`~.expert.parallelize.split_for_evaluation`: the loader hands each process its own
        batch, the dispatcher sends the tokens to their experts). Collective."""
        prepared = super().prepare_model(model, device_placement, evaluation_mode)
        if not any(model is m for m in self._models):  # wrap() did not see it
            if self.config.ep_size > 1:  # the auxiliary loss's hook before the sequence hooks (as in _parallelize)
                self._expert_parallel(self.unwrap(prepared), evaluation=True)
            if self.config.sp_size > 1:
                self._sequence_parallel(self.unwrap(prepared), tp_size=1)
        return prepared

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Tensor parallel, then activation checkpointing, then FSDP2 on the data-parallel mesh.
        Collective."""
        inner = self.unwrap(model)
        if any(type(p).__name__ == "DTensor" for p in inner.parameters()):
            raise ValueError("this model's parameters are DTensors already (parallelized or sharded); pass the plain "
                             "nn.Module to prepare() and put the layout in ParallelismConfig (tp_plan or "
                             "parallelize_fn)")
        names = {id(p): n for n, p in inner.named_parameters()}
        from ...big_modeling import sharded_load  # a meta model: shard first, then fill the shards

        on_meta = sharded_load.has_meta(inner)
        if on_meta and (self.config.tp_size > 1 or self.config.dp_replicate_size > 1 or self.config.pp_size > 1
                        or self.config.data_parallel_size == 1 or self.config.sp_size > 1 or self.config.ep_size > 1):
            raise ValueError(
                f"this model is on the meta device (init_empty_weights) and ParallelismConfig has "
                f"dp_replicate_size={self.config.dp_replicate_size}, dp_shard_size={self.config.dp_shard_size}, "
                f"tp_size={self.config.tp_size}, sp_size={self.config.sp_size}, pp_size={self.config.pp_size}, "
                f"ep_size={self.config.ep_size}: filling "
                "meta parameters is supported when the model is only sharded "
                "(dp_shard_size > 1, the other sizes 1; or strategy='fsdp'); for tensor or replicated layouts build the "
                "model on the CPU (without init_empty_weights) and load weights after prepare")
        if not on_meta:
            _broadcast_from_rank0(inner, self.backend.device)  # TP shards and FSDP shards must cut one model
        parts = [inner]
        if self.config.pp_size > 1:  # this rank's pipeline stages, each parallelized (nd/pipeline/strategy.py)
            parts, names = self._cut_pipeline(inner)
        for part in parts:
            self._parallelize(part, on_meta)
        self._start_pipeline(parts)
        self._track(model, inner, names)
        return model

    def _parallelize(self, part: torch.nn.Module, on_meta: bool) -> None:
        """Tensor parallel, activation checkpointing and FSDP2 on ``part`` (the model, or under pp
        one of this rank's stages). Collective."""
        if self.config.tp_size > 1:
            tied = ties.find_ties(part)  # TP replaces each module's parameters: a tie becomes two DTensors
            self._tensor_parallel(part)
            ties.restore(tied, "parallelize_fn" if self.config.parallelize_fn is not None else "the tensor-parallel plan")
        elif self.config.tp_plan is not None or self.config.parallelize_fn is not None:
            if self.env.is_main_process:
                import warnings

                warnings.warn("ParallelismConfig: tp_plan/parallelize_fn is given but tp_size=1; no tensor "
                              "parallelism is applied", stacklevel=4)
        fsdp = _fsdp()
        if any(isinstance(m, fsdp.FSDPModule) for m in part.modules()):
            raise ValueError("parallelize_fn called fully_shard; under anyaccel it applies tensor parallelism only "
                             "(on device_mesh['tp']): anyaccel shards over the data-parallel dimensions itself, "
                             "configured by ParallelismConfig(fsdp=FSDPOptions(...))")
        if self.config.ep_size > 1:  # after TP (which leaves the experts to ep), before FSDP
            self._expert_parallel(part)
        if self.config.sp_size > 1:  # attention over head slices, the loss over the whole sequence (never with pp)
            self._sequence_parallel(part)
        sharded = self.config.data_parallel_size > 1 or self.config.sp_size > 1
        blocks = self.sharding.checkpointed_blocks(part, sharded=sharded)
        if sharded:
            if self.config.ep_size > 1:  # each experts module its own unit, over the processes holding its experts
                from .expert.parallelize import shard_experts_fsdp

                shard_experts_fsdp(part, fsdp.fully_shard, self.sharding.shard_kwargs(), self.process_mesh.expert_sharding,
                                   self.process_mesh.size("loss"))
            self.sharding.shard(part, blocks, on_meta)  # blocks compiled, then sharded, then the root
        else:
            part.to(self.backend.device)

    def _expert_parallel(self, part: torch.nn.Module, evaluation: bool = False) -> None:
        """The experts of ``part``'s MoE layers split over the mesh's ``experts`` group, and a
        transformers MoE model's auxiliary loss computed over the global batch (refused under pp,
        whose stages have no outputs of the whole model: ``refuse_aux_loss``). A pipeline stage of dense layers only is left as
        it is (the whole model was checked: :meth:`_check_whole_plan`); so is a model to evaluate
        without experts (``evaluation``). Collective (every rank builds the groups on first use,
        whether its stage has experts or not)."""
        from .expert.parallelize import (expert_group_of, install_global_aux_loss, refuse_aux_loss, split_experts,
                                         split_for_evaluation)

        stage = self.config.pp_size > 1 and not evaluation  # a pipeline stage (a model to evaluate is not cut)
        if stage:  # output_router_logits in the config: refused before the experts are split
            refuse_aux_loss(part, f"pp_size={self.config.pp_size}, ep_size={self.config.ep_size}", "pp", hook=False)
        ep = expert_group_of(self.process_mesh)
        if evaluation:
            if not split_for_evaluation(part, ep):
                return
        else:
            split_experts(part, ep, stage=self.config.pp_size > 1)
        if stage:
            return
        from .sequence.transformers import padding_of

        sliced = self.config.sp_size > 1  # installed before the sequence hooks, which keep the slice's padding
        handle = install_global_aux_loss(part, ep, sliced=sliced, padding=padding_of if sliced else None)
        if handle is not None:
            self._sequence_undo.append(handle.remove)

    def _check_whole_plan(self, inner: torch.nn.Module) -> None:
        """Under pp, before the cut: the tensor-parallel plan against the whole model, and under ep
        that it has an experts module (a stage may have none). Local."""
        tensor_parallel.check_whole_plan(inner, self.config)
        if self.config.ep_size > 1:
            from .expert.parallelize import check_has_experts

            check_has_experts(inner, self.config.ep_size)

    def _tensor_parallel(self, model: torch.nn.Module) -> None:
        """The plan (or ``parallelize_fn``) on the mesh's ``tp`` sub-mesh (:mod:`.tensor_parallel`);
        under pp, the entries this stage holds. Collective over ``tp``."""
        stage_plan = None
        if self._pipeline is not None:  # a stage: the planned modules it holds (checked on the whole model)
            from .pipeline.schedule import plan_for_stage as stage_plan
        tensor_parallel.apply(model, self.config, self.process_mesh, stage_plan)

    def _sequence_parallel(self, model: torch.nn.Module, tp_size: Optional[int] = None) -> None:
        """Bind the model's :class:`~.sequence.ulysses.SequenceParallelAttention` modules and, for a
        transformers model, its attention and loss (:mod:`.sequence.transformers`) to the sp group;
        ``tp_size``: the TP degree its attention runs under (default the config's). Collective
        (builds the groups on first use)."""
        from .sequence import transformers as sequence_transformers
        from .sequence.ulysses import bind_attention

        sp = self.sequence_group()
        bound = bind_attention(model, sp)
        if sequence_transformers.is_transformers_model(model):
            from .expert.parallelize import add_aux_term

            tp = self.config.tp_size if tp_size is None else tp_size
            fresh = model.config._attn_implementation != sequence_transformers.ATTENTION_NAME  # not prepared already
            if fresh and self.config.ep_size == 1:  # an MoE model's auxiliary loss without ep: as under ep
                from .expert.parallelize import install_sequence_aux_loss

                aux = install_sequence_aux_loss(model, self.process_mesh)
                if aux is not None:
                    self._sequence_undo.append(aux.remove)
            self._sequence_undo.append(sequence_transformers.install(model, sp, tp, keep_padding=self.config.ep_size > 1))
            handle = add_aux_term(model) if fresh else None  # the auxiliary term, once the loss is the global mean
            if handle is not None:
                self._sequence_undo.append(handle.remove)
        elif not bound:
            raise ValueError(f"ParallelismConfig(sp_size={sp.size}): {type(model).__name__} has no attention anyaccel "
                             "can split over heads: use a transformers model (SDPA or eager attention), or call your "
                             "attention kernel through anyaccel.SequenceParallelAttention (docs/guides/sequence.md)")

    # ---- the training step ----------------------------------------------------------------------
    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """The true global norm over gradients laid out on different meshes (TP layers on 2-D
        meshes, other layers on the data-parallel one, replicated ones on none), in one
        all-reduce: each process adds its local ``|g|^p``, divided by the number of processes
        holding the same elements (replicas); every gradient is scaled by ``max_norm / norm``
        when that is below 1. Returns the norm, the same on every process. Collective."""
        import torch.distributed as dist

        parameters = list(parameters)
        grads = [p.grad for p in parameters if p.grad is not None]
        norm_type = float(norm_type)
        groups: Dict[Any, List[torch.Tensor]] = {}
        counted = self._pipeline.counted(parameters) if self._pipeline is not None else parameters  # ties: once
        ep_local = self._ep_local_parameters()  # an ExpertList's experts: one ep rank holds each, not on its mesh
        for p in counted:
            if p.grad is None:
                continue
            spec = getattr(p.grad, "_spec", None)
            key = None if spec is None else (id(spec.mesh), tuple(spec.placements))
            groups.setdefault((key, id(p) in ep_local), []).append(p.grad)
        parts = []
        for (_, held_by_one_ep_rank), group in groups.items():
            local = torch.nn.utils.get_total_norm([_local(g) for g in group], norm_type)
            copies = _copies(group[0], self.process_mesh.size("stage"),  # other stages hold other weights
                             ep=self.process_mesh.size("experts") if held_by_one_ep_rank else 1)
            parts.append(local.float() if math.isinf(norm_type) else local.float() ** norm_type / copies)
        device = grads[0].device if grads else self.backend.device
        part = torch.stack(parts).to(device) if parts else torch.zeros(1, device=device)
        part = part.max() if math.isinf(norm_type) else part.sum()
        if self.process_mesh.world_size > 1:  # every stage's and shard's part: the whole job
            dist.all_reduce(part, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
        total = part if math.isinf(norm_type) else part ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for g in grads:
                local = _local(g)
                local.mul_(coef.to(local.device, local.dtype))
        return total

    def model_state_dict(self, model: torch.nn.Module) -> Dict[str, Any]:
        """The full state dict on rank 0 (:class:`~anyaccel.strategies.fsdp.strategy.ShardedStrategy`'s);
        refused, on every rank before any collective, for a model whose experts are a split
        ``ExpertList`` (it would miss the other ep ranks' experts). Collective."""
        self._refuse_expert_list(model, "the full state dict (save_model, get_state_dict)")
        return super().model_state_dict(model)

    def load_model_state_dict(self, model: torch.nn.Module, state: Dict[str, Any], strict: bool = True) -> Any:
        """A full state dict into the sharded model (:class:`~anyaccel.strategies.fsdp.strategy.ShardedStrategy`'s);
        refused like :meth:`model_state_dict` for a split ``ExpertList``. Collective."""
        self._refuse_expert_list(model, "loading a full state dict")
        return super().load_model_state_dict(model, state, strict)

    def optimizer_state_dict(self, optimizer: Any) -> Dict[str, Any]:
        """The full optimizer state on rank 0 (:class:`~anyaccel.strategies.fsdp.strategy.ShardedStrategy`'s);
        refused like :meth:`model_state_dict`, on every rank before any collective, for an
        optimizer of a model whose experts are a split ``ExpertList`` (it would miss the other ep
        ranks' experts' state). Collective."""
        self._refuse_expert_list_optimizer(optimizer, "the full optimizer state dict (optimizer_state_dict)")
        return super().optimizer_state_dict(optimizer)

    def load_optimizer_state_dict(self, optimizer: Any, state: Dict[str, Any]) -> None:
        """A full optimizer state into the sharded one (:class:`~anyaccel.strategies.fsdp.strategy.ShardedStrategy`'s);
        refused like :meth:`optimizer_state_dict` for a split ``ExpertList``. Collective."""
        self._refuse_expert_list_optimizer(optimizer, "loading a full optimizer state dict")
        super().load_optimizer_state_dict(optimizer, state)

    def _refuse_expert_list_optimizer(self, optimizer: Any, what: str) -> None:
        """:meth:`_refuse_expert_list` for each prepared model holding one of ``optimizer``'s
        parameters (local: the same models are split alike on every rank)."""
        if self.config.ep_size > 1:
            held = {id(p) for g in getattr(optimizer, "optimizer", optimizer).param_groups for p in g["params"]}
            for model in self._models:
                if any(id(p) in held for p in self.unwrap(model).parameters()):
                    self._refuse_expert_list(model, what)

    def _refuse_expert_list(self, model: torch.nn.Module, what: str) -> None:
        if self.config.ep_size > 1:
            from .expert.parallelize import full_state_problem

            problem = full_state_problem(self.unwrap(model), what)
            if problem:
                raise ValueError(f"ParallelismConfig(ep_size={self.config.ep_size}): {problem}")

    def _ep_local_parameters(self) -> Set[int]:
        """``id`` of every parameter of a split :class:`~.expert.ExpertList` (under ``ep_size`` > 1):
        each expert lives on one rank of its ep group, as a separate parameter whose mesh
        (``expert_sharding``) has no ep dimension, so the norm must not count the ep ranks as
        copies of it. Local."""
        if self.config.ep_size == 1:
            return set()
        from .expert import ExpertList, is_sharded

        return {id(p) for model in self._models for m in self.unwrap(model).modules()
                if isinstance(m, ExpertList) and is_sharded(m) for p in m.parameters()}

    def teardown(self) -> None:
        """Forget the mesh; leave the group of one that :meth:`setup_process_group` made (a
        later Accelerator or notebook launch in this process must find none). Collective."""
        super().teardown()
        from .sequence.transformers import restore

        restore(self._sequence_undo)  # the models' own attention again
        self._sequence, self._pipeline = None, None  # the mesh forgot its device meshes (super())
        if getattr(self, "_own_group", False):
            from ...process import process_group

            self._own_group = False
            process_group.retire()  # torch forgets it; the object lives until the process ends


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (the tensor itself for a plain tensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _copies(t: torch.Tensor, world_size: int, ep: int = 1) -> int:
    """How many processes hold each element of ``t``: all of them for a plain tensor; for a
    DTensor, the processes outside its mesh times its mesh's replicated dimensions. ``ep`` > 1:
    ``t`` belongs to an expert that only one rank of each ep group holds although its mesh has no
    ep dimension (an :class:`~.expert.ExpertList`'s experts, FSDP-sharded over
    ``expert_sharding``): the other ep ranks hold other experts, not copies."""
    spec = getattr(t, "_spec", None)
    if spec is None:
        return world_size // ep
    mesh = spec.mesh
    if any(p.is_partial() for p in spec.placements):
        raise ValueError("clip_grad_norm_: a gradient is a partial sum (Partial placement); reduce it first")
    copies = world_size // mesh.size() // ep
    for dim, placement in enumerate(spec.placements):
        if placement.is_replicate():
            copies *= mesh.size(dim)
    return copies
