"""Pipeline parallelism for the ``nd`` strategy: this process's stages, the schedule, and one step.

``ParallelismConfig(pp_size=P)`` cuts the model into ``P * pp_stages_per_rank`` stages
(:mod:`.split`: at block boundaries, parameter names kept) and lays them on the ``pp`` dimension
of the job's :class:`~anyaccel.strategies.mesh.ProcessMesh` (its ``stage_ranks``) — stage ``i`` on
pipeline rank ``i % P`` for the looped schedules, in a V (rank ``r`` holds ``r`` and ``2P-1-r``)
for ZBV/DualPipeV. The nd strategy then applies tensor
parallelism and FSDP2 to each stage module as it does to a whole model (torchtitan's order:
stages first, then ``parallelize`` each).

Why a training step is one call (:meth:`Pipeline.step_of`, ``Accelerator.pipeline_step``) and not
``loss = loss_fn(model(x), y); accelerator.backward(loss)``: no process holds the whole model, so
no process can run ``model(x)``; the last stage alone sees the outputs, and a schedule must
interleave the forwards and backwards of micro-batches across processes (1F1B runs the backward
of micro-batch 0 before the forward of micro-batch 3). So the batch, the targets and the loss
function go in together; the schedule runs every forward and backward; the loss comes back on
every rank. A plain call of the prepared model raises, showing that loop. ``pipeline_step`` hands
the step (:class:`PipelineStep`) to ``Accelerator.backward``, which divides it over an
accumulation group and watches it for the hang doctor as it does a loss: the step's ``backward()``
runs the schedule.

What a step does: splits the batch into ``pp_microbatches`` equal micro-batches, runs torch's
schedule (``torch.distributed.pipelining``) with the loss computed per micro-batch on the last
stage and divided by the number of micro-batches (and over an accumulation group, as
``accelerator.backward`` divides it) before its backward, so the gradients equal one process's on
the whole batch. (Not torch's ``scale_grads``: it divides the whole ``.grad`` at the end of a step,
gradients accumulated over earlier steps included.) The mean micro-batch loss is broadcast from
the last stage to the pipeline's ranks. Forward only under ``torch.no_grad()`` (evaluation). A new
batch shape builds a new schedule (torch infers the tensors sent between stages from the first
micro-batch).

Tied weights whose names fall in different stages (an embedding tied to the head) are kept equal
as Megatron does (:mod:`.ties`). Collective where noted: every rank of the job calls the
same methods in the same order.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .... import doctor
from ....errors import AnyaccelError
from ....tree import map_tensors
from ...capabilities import default_loss, split_batch
from ...mesh import ProcessMesh
from ..options import PP_SCHEDULES, ParallelismConfig
from . import split as pipeline_split
from .ties import TiedWeights

__all__ = ["Pipeline", "PipelineStep", "PipelineError", "stage_ranks", "split_batch", "default_loss",
           "pipeline_problem", "plan_for_stage", "compile_settings", "WAITS_IN"]

#: what the hang doctor says a rank running the schedule waits in
WAITS_IN = "pipeline_step (sends and receives between pipeline stages)"


class PipelineError(AnyaccelError, RuntimeError):
    """A model cut into pipeline stages was used in a way that needs the whole model."""


def stage_ranks(config: ParallelismConfig, mesh: Optional[ProcessMesh] = None) -> List[int]:
    """The pipeline rank holding each stage, by schedule: looped (``i % pp_size``) or V — the
    mesh's placement (:meth:`ProcessMesh.stage_ranks`; ``mesh``: the job's, else one of the
    config's ``pp_size``). Local."""
    mesh = mesh if mesh is not None else ProcessMesh({"pp": config.pp_size}, 0)
    return list(mesh.stage_ranks(config.pp_stages_per_rank, v_shape=PP_SCHEDULES[config.pp_schedule] == "v"))


def pipeline_problem(config: ParallelismConfig, mixed_precision: str) -> str:
    """Why this job cannot run pipeline stages ('' when it can): what anyaccel does not combine
    with pp yet, each with what to do. Local."""
    if config.sizes()["sp"] > 1:
        return (f"ParallelismConfig(pp_size={config.pp_size}, sp_size={config.sizes()['sp']}): pipeline stages with "
                "sequence parallelism are not supported together yet (the stages after the first would need the "
                "sequence slices and the loss across them); use one of them")
    if mixed_precision == "fp16":
        return (f"ParallelismConfig(pp_size={config.pp_size}) with mixed_precision='fp16': the gradient scaler would "
                "decide on each stage's gradients alone (one stage skipping a step while another takes it); use "
                "mixed_precision='bf16', which needs no scaler")
    if config.fsdp is not None and config.fsdp.checkpoint_format != "sharded":
        return (f"ParallelismConfig(pp_size={config.pp_size}) stores checkpoints sharded (each stage writes its own "
                "parameters through torch.distributed.checkpoint, keyed by name, so they load into any layout); "
                "FSDPOptions(checkpoint_format='full') is not supported with pipeline stages: leave it 'sharded'")
    return ""


#: the schedules that split the backward into input and weight gradients (zero bubble): they run
#: the autograd graph twice (retain_graph), which compiled graphs with donated buffers refuse
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def compile_settings(config: ParallelismConfig) -> None:
    """Before stages are compiled: under a split-backward schedule, AOTAutograd must not donate
    the backward's buffers (torch's ``donated_buffer``, a memory optimisation that assumes one
    backward per graph). Process-wide: torch has one such setting. Local."""
    if config.pp_schedule in SPLIT_BACKWARD:
        import torch._functorch.config as functorch_config

        functorch_config.donated_buffer = False


def plan_for_stage(root: torch.nn.Module, plan: Mapping[str, Any]) -> Dict[str, Any]:
    """The entries of a tensor-parallel ``plan`` (checked on the whole model) that match a module
    with parameters in the stage module ``root``. Local."""
    from fnmatch import fnmatch

    present = [name for name, m in root.named_modules() if name and next(m.parameters(), None) is not None]
    return {k: v for k, v in plan.items() if any(fnmatch(name, k) for name in present)}


class _PlainCallRefused:
    """The prepared model's ``forward`` under pp: says which loop to write instead."""

    def __init__(self, stages: Sequence[int], config: ParallelismConfig):
        self.message = (
            f"this model is cut into {config.pp_size * config.pp_stages_per_rank} pipeline stages "
            f"(ParallelismConfig(pp_size={config.pp_size}, pp_schedule={config.pp_schedule!r})) and this process "
            f"holds stage(s) {list(stages)} only: model(...) cannot run the whole forward, and the loss exists only on "
            "the last stage. Run each batch through the schedule, which does the forward and backward of every "
            "micro-batch and returns the loss on every rank:\n\n"
            "    loss = accelerator.pipeline_step(model, inputs, labels, loss_fn)\n"
            "    optimizer.step()\n"
            "    optimizer.zero_grad()\n\n"
            "(under torch.no_grad() it runs the forward only, for evaluation; return_outputs=True also returns the "
            "last stage's outputs). See docs/guides/pipeline.md.")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(self.message)

    def __reduce__(self) -> Any:
        return _refused_from_message, (self.message,)


def _refused_from_message(message: str) -> _PlainCallRefused:
    refused = _PlainCallRefused.__new__(_PlainCallRefused)
    refused.message = message
    return refused


class Pipeline:
    """This process's share of a pipelined model and the schedule that trains it.

    Built by :meth:`cut` (before tensor parallelism and sharding: it prunes the model in place and
    returns the stage modules to parallelize), finished by :meth:`start` once they are. Local
    until :meth:`start` (collective)."""

    def __init__(self, model: torch.nn.Module, config: ParallelismConfig, plan: pipeline_split.StagePlan,
                 mesh: ProcessMesh, ties: TiedWeights):
        self.model, self.config, self.plan, self.mesh = model, config, plan, mesh
        self.pp_rank = mesh.coordinate("pp")
        self.placement = stage_ranks(config, mesh)
        self.stages = [i for i, r in enumerate(self.placement) if r == self.pp_rank]
        self.num_stages = len(self.placement)
        self.microbatches = config.pp_microbatches or self.num_stages
        self.modules: List[torch.nn.Module] = []
        self.ties = ties
        self._schedules: Dict[Any, Any] = {}
        self._loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None
        self._loss_scale: Any = 1.0
        self._raw_losses: List[torch.Tensor] = []
        self.group: Any = None
        self.device: Any = None
        self.steps = 0  #: schedule steps run (the benchmarks' proof)

    # ---- building ------------------------------------------------------------------------------
    @classmethod
    def cut(cls, model: torch.nn.Module, config: ParallelismConfig, mesh: ProcessMesh) -> "Pipeline":
        """Plan the stages of ``model`` (the whole model, every rank alike), check them, prune
        ``model`` in place to this rank's stages, untie weights shared between stages, and build
        the stage modules (:attr:`modules`). Local."""
        num_stages = config.pp_size * config.pp_stages_per_rank
        plan = pipeline_split.plan_stages(model, num_stages, config.pp_split_points)
        if plan.kind == "transformers":
            pipeline_split.check_transformers_split(model, plan)
        pipeline = cls(model, config, plan, mesh, TiedWeights.find(model, plan))
        pipeline_split.prune(model, plan, pipeline.stages)
        pipeline.ties.untie_local(model)
        pipeline.modules = [pipeline_split.stage_module(model, plan, s) for s in pipeline.stages]
        model.forward = _PlainCallRefused(pipeline.stages, config)
        return pipeline

    def local_names(self, names: Mapping[int, List[str]]) -> Dict[int, str]:
        """For each old parameter (by id, with all its names), the name it has on this rank, if
        any: what the optimizer is re-pointed by. Local."""
        held = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        out = {}
        for pid, all_names in names.items():
            here = [n for n in all_names if n in held]
            if here:
                out[pid] = here[0]
        return out

    def start(self, device: torch.device, mixed_precision: str, autocast_device_type: str) -> None:
        """After tensor parallelism and sharding of :attr:`modules`: autocast on each stage (the
        last one's outputs cast back to fp32, as a whole model's are), the ``pp`` group, and the
        groups of the processes holding each tied weight; checks that the tied copies have the same
        layout. Collective (every rank of the job creates the same groups)."""
        self.device = device
        self.group = self.mesh.group("pp")
        if mixed_precision != "no":
            from ....precision import AutocastForward

            for index, module in zip(self.stages, self.modules):
                module.forward = AutocastForward(module.forward, autocast_device_type, mixed_precision,
                                                 to_fp32=index == self.num_stages - 1)
        self.ties.start(self.model, self.placement, self.pp_rank, self.config.pp_size)

    # ---- one step ------------------------------------------------------------------------------
    def step_of(self, args: Tuple[Any, ...], target: Any, loss_fn: Optional[Callable[[Any, Any], torch.Tensor]],
                sync: bool, return_outputs: bool) -> "PipelineStep":
        """One batch to run through the schedule, as ``Accelerator.backward`` runs a loss's
        backward (:class:`PipelineStep`). Local."""
        return PipelineStep(self, args, target, loss_fn, sync, return_outputs)

    @property
    def has_first(self) -> bool:
        return 0 in self.stages

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stages

    def step(self, args: Tuple[Any, ...], target: Any, loss_fn: Optional[Callable[[Any, Any], torch.Tensor]],
             loss_scale: Any, sync: bool, return_outputs: bool) -> Tuple[Optional[torch.Tensor], Any]:
        """Run the schedule over one batch (forward only when gradients are off); return the mean
        micro-batch loss (None without ``loss_fn``/target) and, with ``return_outputs``, the last
        stage's outputs, both on every rank of this pipeline. ``loss_scale`` multiplies each
        micro-batch loss before its backward (accumulation). With ``sync`` (the last
        micro-step of an accumulation group) tied weights' gradients are summed across their
        stages afterwards. Collective over the job."""
        import torch.distributed as dist

        train = torch.is_grad_enabled()
        with_loss = loss_fn is not None and target is not None
        if train and not with_loss:
            raise ValueError("pipeline_step with gradients on needs a target and a loss function (the schedule runs "
                             "the backward from the loss); for outputs only, call it under torch.no_grad()")
        args = tuple(a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args)
        if isinstance(target, torch.Tensor):
            target = target.to(self.device)
        self._check_batch(args, target)
        for module in self.modules:  # the stage containers follow the user's model.train()/eval()
            if module.training != self.model.training:
                module.train(self.model.training)
        schedule = self._schedule(args, target, train, with_loss)
        self._loss_fn, self._loss_scale = loss_fn, loss_scale / self.microbatches
        self._raw_losses.clear()
        losses: List[torch.Tensor] = []
        kwargs: Dict[str, Any] = {"target": target if self.has_last and with_loss else None,
                                  "losses": losses if self.has_last and with_loss else None}
        call = schedule.step if train else schedule.eval
        outputs = call(*(args if self.has_first else ()), return_outputs=return_outputs, **kwargs)
        self.steps += 1
        loss = None
        if with_loss:
            mine = self._raw_losses[-self.microbatches:] if self.has_last else []
            value = torch.stack(mine).mean().float() if mine else torch.zeros((), device=self.device)
            loss = self._from_last(value.detach().reshape(()))
        if train and sync:
            self.ties.sync()
        if return_outputs:
            box = [map_tensors(torch.Tensor.detach, outputs) if self.has_last else None]
            dist.broadcast_object_list(box, src=self._last_global_rank(), group=self.group)
            outputs = box[0]
        return loss, outputs if return_outputs else None

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        """The schedule's loss function: the user's, recorded, times the step's scale."""
        assert self._loss_fn is not None  # noqa: S101 - set by step() before the schedule runs
        raw = self._loss_fn(output, target)
        self._raw_losses.append(raw.detach())
        return raw * self._loss_scale

    def _check_batch(self, args: Tuple[Any, ...], target: Any) -> None:
        tensors = [a for a in args if isinstance(a, torch.Tensor)] + (
            [target] if isinstance(target, torch.Tensor) else [])
        for t in tensors:
            if t.dim() == 0 or t.shape[0] % self.microbatches:
                raise ValueError(f"pipeline_step: a batch of {t.shape[0] if t.dim() else 0} samples (tensor of shape "
                                 f"{tuple(t.shape)}) cannot be cut into pp_microbatches={self.microbatches} equal "
                                 f"micro-batches; use a batch size that is a multiple of {self.microbatches} "
                                 "(DataLoader(drop_last=True) drops a short last batch)")

    def _schedule(self, args: Tuple[Any, ...], target: Any, train: bool, with_loss: bool) -> Any:
        """The schedule for batches of this shape (built on first use: torch infers the tensors
        sent between stages from the first micro-batch and keeps them)."""
        key = (train, with_loss, _signature(args), _signature((target,)))
        schedule = self._schedules.get(key)
        if schedule is None:
            from torch.distributed.pipelining import PipelineStage
            from torch.distributed.pipelining.schedules import get_schedule_class

            stages = [PipelineStage(module, index, self.num_stages, self.device, group=self.group)
                      for index, module in zip(self.stages, self.modules)]
            cls = get_schedule_class(self.config.pp_schedule)
            loss = self._loss if with_loss else None
            single = PP_SCHEDULES[self.config.pp_schedule] == "single"
            try:
                # scale_grads=False: torch would divide the whole .grad, gradients accumulated over
                # earlier steps included; the loss is divided by the micro-batch count instead
                schedule = cls(stages[0] if single else stages, self.microbatches, loss_fn=loss, scale_grads=False)
            except (ValueError, AssertionError) as exc:
                raise ValueError(f"pp_schedule={self.config.pp_schedule!r} with pp_microbatches={self.microbatches}, "
                                 f"pp_size={self.config.pp_size}: {exc}") from exc
            self._schedules[key] = schedule
        return schedule

    def _last_global_rank(self) -> int:
        return self.mesh.ranks("pp")[self.placement[-1]]

    def _from_last(self, value: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if self.config.pp_size > 1:
            dist.broadcast(value, src=self._last_global_rank(), group=self.group)
        return value

    # ---- what the strategy asks ------------------------------------------------------------------
    def counted(self, parameters: Sequence[torch.nn.Parameter]) -> List[torch.nn.Parameter]:
        """``parameters`` without the tied copies counted on another stage (each tied weight
        enters the global gradient norm once). Local."""
        return self.ties.counted(parameters)

    def keep_own_parameters(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop from ``optimizer`` the parameters of other ranks' stages, and add the tied copies
        this rank made (next to the weight they copy). Local."""
        held = {id(p): p for p in self.model.parameters()}
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in held]
        self.ties.add_copies(optimizer)

    def optimizer_aliases(self) -> Dict[str, str]:
        """For each local copy of a weight tied across stages, the name its optimizer state is
        stored under in checkpoints: the name the untied model's optimizer uses (the first), so
        checkpoints move between pipelined and whole models. Local."""
        return self.ties.aliases(self.model)

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The whole model's state dict on rank 0 (CPU tensors, every stage's entries under their
        names, tied names sharing one tensor), ``{}`` elsewhere. Collective."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        mine = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
        mine = {k: v.detach().cpu() for k, v in mine.items()}
        leader = self.mesh.rank_in("stage") == 0  # one process per stage sends its entries
        gathered: List[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None  # type: ignore[assignment]
        dist.gather_object(mine if leader else None, gathered, dst=0)
        if dist.get_rank() != 0:
            return {}
        state: Dict[str, torch.Tensor] = {}
        for part in gathered:
            state.update(part or {})
        return self.ties.retie(state)

    def local_state(self, state: Mapping[str, Any]) -> Dict[str, Any]:
        """The entries of a whole model's ``state`` that this rank's stages hold. Local."""
        held = set(self.model.state_dict())
        return {k: v for k, v in state.items() if k in held}


class PipelineStep:
    """One batch through a :class:`Pipeline`'s schedule, in the shape of a loss
    (``Accelerator.pipeline_step`` hands it to ``Accelerator.backward``, so the accumulation
    divisor and the hang doctor's watch are written once, there): dividing it scales each
    micro-batch loss before its backward; :meth:`backward` runs the schedule (the forward only under
    ``torch.no_grad()``) and keeps :attr:`loss` and :attr:`outputs`. Local until :meth:`backward`
    (collective over the job)."""

    __slots__ = ("pipeline", "args", "target", "loss_fn", "sync", "return_outputs", "scale", "loss", "outputs")

    def __init__(self, pipeline: Pipeline, args: Tuple[Any, ...], target: Any,
                 loss_fn: Optional[Callable[[Any, Any], torch.Tensor]], sync: bool, return_outputs: bool):
        self.pipeline, self.args, self.target, self.loss_fn = pipeline, args, target, loss_fn
        self.sync, self.return_outputs, self.scale = sync, return_outputs, 1.0
        self.loss: Optional[torch.Tensor] = None
        self.outputs: Any = None

    def __truediv__(self, divisor: float) -> "PipelineStep":
        """The step with its loss divided by ``divisor`` (an accumulation group's size). Local."""
        self.scale = 1.0 / divisor
        return self

    def backward(self, **kwargs: Any) -> None:
        """Run the schedule over the batch (``Accelerator.backward`` calls it inside its watch; the
        hang doctor then says a rank waits in :data:`WAITS_IN`). Collective over the job."""
        if kwargs:
            raise TypeError(f"pipeline_step runs the backward itself; it takes no {sorted(kwargs)}")
        doctor.TRACKER.op = WAITS_IN  # Accelerator.backward puts the op around it back afterwards
        self.loss, self.outputs = self.pipeline.step(self.args, self.target, self.loss_fn, self.scale, self.sync,
                                                     self.return_outputs)


def _signature(values: Tuple[Any, ...]) -> Tuple[Any, ...]:
    return tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__ for v in values)
