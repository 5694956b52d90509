"""``Accelerator``: the thin façade a training script talks to.

It resolves its options once (argument > launcher variable > default, into
:class:`~anyaccel.options.AcceleratorOptions`; Accelerate's argument formats are converted by
:mod:`anyaccel.compat.arguments`, the Accelerate compatibility layer, which the core below never
imports), starts a :class:`~anyaccel.runtime.Runtime` from them (the environment, the device backend, the
wrapping strategy, the process group, the hang doctor subscription and the preemption handlers, all
released by one ``close()``), and delegates: data sharding to :mod:`anyaccel.data`,
collectives to :mod:`anyaccel.ops`, autocast to :mod:`anyaccel.precision`, accumulation to
:mod:`anyaccel.accumulation`, optimizer/scheduler wrappers to :mod:`anyaccel.stepping`, checkpoints to
:mod:`anyaccel.checkpoint`, trackers to :mod:`anyaccel.tracking`. It tests no device type: what
differs between devices is the backend's, what differs between ways of wrapping the model is the
strategy's.

Why this module is longer than ~450 lines: it is the public surface (one short method per verb a
training script uses, with the docstring that says who calls it and who gets what); each body is a
few lines of delegation.

All its state lives on the instance and its runtime: two ``Accelerator`` objects in one process
share the process group and the hang doctor's thread (there is one of each per process; each keeps
its own ``hang_timeout``) and nothing else. See ``docs/concepts/lifetimes.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import warnings
import weakref
from time import monotonic as _monotonic
from typing import (TYPE_CHECKING, Any, Callable, ContextManager, Dict, Iterable, Iterator, List, NamedTuple, Optional,
                    Sequence, Union, cast)

import torch

from . import doctor, envvars, ops
from . import precision as _precision
from .training.accumulation import AccumulateContext, GradientState
from .backends import rng_types as _rng_types
from .compat.accelerator_members import AccelerateMembers
from .environment import DistributedType
from .process.job import JobView
from .training.stepping import AcceleratedOptimizer, AcceleratedScheduler
from .tree import map_tensors
from .strategies.capabilities import (BackwardSyncControl, EngineTraining, Pipelined, SequenceParallel, UnevenInputs,
                                      default_loss, split_batch)

if TYPE_CHECKING:  # types only; the modules an Accelerator needs only when it is made, or only when a method
    # is called, are imported there (`from anyaccel import Accelerator` does not load them: the import budget,
    # tests/project/test_import_budget.py)
    from torch.distributed.device_mesh import DeviceMesh

    from .backends.base import Backend
    from .checkpoint import ProjectConfiguration
    from .checkpoint.async_save import AsyncSaver
    from .checkpoint.training_state import TrainingState
    from .compat.kwargs import AutocastKwargs, GradientAccumulationPlugin, ProfileKwargs
    from .compat.state import AcceleratorState
    from .data import DataLoaderConfiguration, PreparedDataLoader
    from .environment import Environment
    from .options import AcceleratorOptions
    from .process.preemption import Preemption
    from .runtime import Runtime
    from .training.precision_fp8 import Fp8Training
    from .strategies.base import Strategy
    from .strategies.nd.options import ParallelismConfig
    from .strategies.options import StrategyOptions
    from .tracking import GeneralTracker, TrackerSet
    from .compat.utils.deepspeed import DeepSpeedPlugin

# Accelerate's ``accelerate.accelerator`` module path: the names scripts import from it
# (``from anyaccel.accelerator import Accelerator, GradientAccumulationPlugin``), re-exported.
from .training.accumulation import GradientState  # noqa: E402,F401,F811
from .environment import DistributedType  # noqa: E402,F401,F811

if TYPE_CHECKING:
    from .compat.kwargs import (DistributedDataParallelKwargs, GradScalerKwargs,  # noqa: F401
                                InitProcessGroupKwargs)
    from .compat.plugins import FullyShardedDataParallelPlugin, TorchDynamoPlugin  # noqa: F401
    from .compat.state import PartialState  # noqa: F401
    from .tracking import LoggerType  # noqa: F401

#: re-exported names loaded on first use (PEP 562): a script that passes no plugin and logs
#: nothing does not load them (the import budget, tests/project/test_import_budget.py); the
#: others are loaded by the first ``Accelerator(...)``
_ON_DEMAND = {"FullyShardedDataParallelPlugin": "anyaccel.compat.plugins", "TorchDynamoPlugin": "anyaccel.compat.plugins",
              "LoggerType": "anyaccel.tracking", "ProjectConfiguration": "anyaccel.checkpoint",
              "DataLoaderConfiguration": "anyaccel.data", "AcceleratorState": "anyaccel.compat.state",
              "PartialState": "anyaccel.compat.state",
              **{name: "anyaccel.compat.kwargs" for name in (
                  "AutocastKwargs", "DistributedDataParallelKwargs", "GradientAccumulationPlugin", "GradScalerKwargs",
                  "InitProcessGroupKwargs", "ProfileKwargs")}}


if not TYPE_CHECKING:  # (hidden from type checkers, which read the imports above: a module __getattr__ would
    # type every misspelt name Any)
    def __getattr__(name: str) -> Any:
        if name not in _ON_DEMAND:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(_ON_DEMAND[name]), name)
        globals()[name] = value
        return value

    def __dir__() -> List[str]:  # dir(), tab completion and autodoc list the names loaded on first use too
        return sorted(set(globals()) | set(_ON_DEMAND))


__all__ = ["Accelerator", "ResumePoint"]

# Live instances, only so that notebook_launcher can refuse to fork after an Accelerator was
# created in the notebook (the forked workers would inherit its process group and devices).
_live_instances: "weakref.WeakSet[Accelerator]" = weakref.WeakSet()


def _qualified(obj: Any) -> str:
    """``torch.optim.adamw.AdamW`` for messages: what the object is."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _own_version() -> str:
    from . import __version__

    return __version__


def _check_version_gates(is_main_process: bool) -> None:
    """A script whose ``accelerate.__version__`` became anyaccel's own: the main process warns
    (:mod:`anyaccel.compat.version_gate`, imported when the first Accelerator is made)."""
    from .compat.version_gate import check_script

    check_script(_own_version(), is_main_process)


def _check_rng_types(rng_types: Optional[Sequence[str]]) -> None:
    for kind in rng_types or ():
        if str(kind) not in _rng_types():
            raise ValueError(f"rng_types contains {kind!r}; allowed: {', '.join(_rng_types())} (none is needed: "
                             "anyaccel's loaders share one seed, so their order agrees on every rank)")


class Accelerator(JobView, AccelerateMembers):
    """Make one training script run on CPU, one or many GPUs, several machines or a TPU.

    Every process of the job creates its own ``Accelerator`` with the same arguments. Arguments
    left at ``None`` take the value ``anyaccel launch`` passed (config file or flag), else the
    default. Names follow Hugging Face Accelerate.

    Args:
        device_placement: move prepared models and batches to :attr:`device`.
        split_batches: the DataLoader's ``batch_size`` is the *global* batch, split over processes
            (default: it is the per-process batch). Older spelling of
            ``DataLoaderConfiguration.split_batches``.
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"`` (linear layers in fp8 through
            torchao, the rest under bf16 autocast; ``kwargs_handlers=[AORecipeKwargs(...)]`` says
            how: :mod:`anyaccel.precision_fp8`).
        gradient_accumulation_steps: micro-batches per optimizer step (see :meth:`accumulate`).
        cpu: force the CPU even when GPUs are visible.
        log_with: tracker name(s) or :class:`~anyaccel.tracking.LoggerType` members (``"csv"``,
            ``"tensorboard"``, ``"wandb"``, ``"mlflow"``, ``"all"``) and/or
            :class:`~anyaccel.tracking.GeneralTracker` instances, for :meth:`log`.
        project_dir: where trackers and automatic checkpoints write.
        project_config: a :class:`~anyaccel.checkpoint.ProjectConfiguration`.
        step_scheduler_with_optimizer: step prepared schedulers only when the optimizer stepped
            (``False``: on every ``scheduler.step()`` call, once).
        step_scheduler_per_process: ``True`` (default, Accelerate's rule): a prepared scheduler
            steps ``num_processes`` times per optimizer step (once with ``split_batches``), so a
            schedule built for the single-process step count (``len(loader) * epochs`` before
            ``prepare``) ends when training ends. ``False``: once per optimizer step, for a
            schedule written for the steps each process really takes.
        kwargs_handlers: ``DistributedDataParallelKwargs``, ``GradScalerKwargs``,
            ``InitProcessGroupKwargs`` instances.
        rng_types: accepted for Accelerate compatibility and checked, but never needed: when an
            epoch of a prepared loader starts, every rank takes rank 0's sampler generator state
            (or order seed), so the ranks' orders agree by construction (what Accelerate
            synchronises RNGs for).
        even_batches: ``True`` (default) pads the last round of an epoch so that every rank gets
            the same number of batches (``gather_for_metrics`` removes the padding); ``False``
            leaves the last batches uneven, and some ranks may get one batch fewer. Older
            spelling of ``DataLoaderConfiguration.even_batches``.
        dispatch_batches: older spelling of ``DataLoaderConfiguration.dispatch_batches``.
        dataloader_config: a :class:`~anyaccel.data.DataLoaderConfiguration` (how prepared
            DataLoaders are cut; giving it together with a contradicting ``split_batches``/
            ``even_batches``/``dispatch_batches`` raises ``ValueError``).
        strategy: how models are wrapped across processes: a registered name (``"ddp"``, the
            default for several processes; ``"fsdp"``: FSDP2 sharding, CPU included; ``"nd"``;
            ``"single"``; a third-party strategy's) or that strategy's **options object**
            (``FSDPOptions(reshard_after_forward=False)``, ``ParallelismConfig(...)``, a registered
            strategy's own options class), which reaches the strategy typed and selects it;
            ``None`` takes what ``anyaccel launch`` passed, else the default for the device.
        fsdp_plugin: a :class:`~anyaccel.plugins.FullyShardedDataParallelPlugin` (implies
            ``strategy="fsdp"``).
        dynamo_backend: ``torch.compile`` backend for prepared models (``"inductor"``; ``"no"``).
        dynamo_plugin: a :class:`~anyaccel.plugins.TorchDynamoPlugin` (backend, mode, fullgraph,
            dynamic), instead of ``dynamo_backend``.
        hang_timeout: seconds a rank may wait in one collective before the hang doctor prints where
            every rank is (:mod:`anyaccel.doctor`); ``0`` turns the reports off. Default 300. Each
            ``Accelerator``'s own: with several alive, the smallest positive one applies.
        preemption_signals: signals (``"SIGTERM,SIGUSR1"`` by default; ``"none"``) on which every
            rank saves a checkpoint at the same step of the training loader (the first prepared
            one) under ``project_dir/checkpoints`` and exits with 75; :meth:`resume` continues
            from it (:mod:`anyaccel.preemption`).
        parallelism_config: a :class:`~anyaccel.ParallelismConfig` (``dp_replicate_size``,
            ``dp_shard_size``, ``tp_size``, ``cp_size``, ``sp_size``, ``pp_size``; ``tp_plan`` or
            ``parallelize_fn``; ``pp_schedule``, ``pp_microbatches``...): N-D parallelism over one
            named device mesh (implies ``strategy="nd"``; see docs/guides/nd-parallel.md,
            docs/guides/sequence.md, and docs/guides/pipeline.md for :meth:`pipeline_step`).
        gradient_accumulation_plugin: a :class:`~anyaccel.kwargs.GradientAccumulationPlugin`
            (``num_steps``, ``sync_with_dataloader``, ``sync_each_batch``, ``adjust_scheduler``),
            instead of ``gradient_accumulation_steps``.
        deepspeed_plugin: a :class:`~anyaccel.utils.DeepSpeedPlugin` (ZeRO stage, offload, a
            DeepSpeed config): trains through a DeepSpeed engine, on CPUs too (implies
            ``strategy="deepspeed"``; see docs/guides/deepspeed.md).
        fault_tolerance: ``"off"`` (default), or the ``HOST:PORT`` of a torchft Lighthouse
            (``anyaccel launch --fault_tolerance on`` starts one and passes it): each process is a
            replica group; the others go on when one dies, and a restarted group heals from a live
            peer in :meth:`resume` (:mod:`anyaccel.fault_tolerance`,
            docs/guides/fault-tolerance.md). Needs the ``ft`` extra (torchft).
    """

    # Public attributes, set in __init__ (declared here so that the reference documents them).
    #: The ``torch.device`` this process computes on (``cuda:<local rank>``, ``cpu``, an XLA
    #: device): prepared models and batches are moved there. Local.
    device: torch.device
    #: The options as resolved once from the arguments, the launcher's settings and the defaults. Local.
    options: AcceleratorOptions
    #: The fp16 gradient scaler (``None`` unless ``mixed_precision="fp16"``). Local.
    scaler: Optional[torch.amp.GradScaler]
    #: Gradient accumulation settings in use (``num_steps``, ``sync_with_dataloader``, ``sync_each_batch``). Local.
    gradient_accumulation_plugin: GradientAccumulationPlugin
    #: Where this process is in gradient accumulation (``sync_gradients``, the micro-step). Local.
    gradient_state: GradientState
    #: Whether ``prepare`` moves models and batches to :attr:`device`. Local.
    device_placement: bool
    #: Prepared schedulers step only when their optimizer stepped. Local.
    step_scheduler_with_optimizer: bool
    #: A prepared scheduler steps once per process per optimizer step (Accelerate's rule). Local.
    step_scheduler_per_process: bool
    #: Where trackers and automatic checkpoints write, and how checkpoints are named and kept. Local.
    project_config: ProjectConfiguration
    #: The trackers asked for (``Accelerator(log_with=...)``), started by :meth:`init_trackers`. Local.
    log_with: Any
    #: Training steps counted for checkpoints (restored by :meth:`load_state`). Local.
    step: int

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: Optional[bool] = None,
        mixed_precision: Optional[str] = None,
        gradient_accumulation_steps: Optional[int] = None,
        cpu: Optional[bool] = None,
        log_with: Any = None,
        project_dir: Optional[str] = None,
        project_config: Optional[ProjectConfiguration] = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: Optional[Sequence[Any]] = None,
        rng_types: Optional[Sequence[str]] = None,
        even_batches: Optional[bool] = None,
        strategy: Union[str, StrategyOptions, None] = None,
        fsdp_plugin: Optional[FullyShardedDataParallelPlugin] = None,
        dynamo_backend: Optional[str] = None,
        dynamo_plugin: Optional[TorchDynamoPlugin] = None,
        dispatch_batches: Optional[bool] = None,
        dataloader_config: Optional[DataLoaderConfiguration] = None,
        step_scheduler_per_process: bool = True,
        hang_timeout: Optional[float] = None,
        preemption_signals: Union[str, Sequence[str], None] = None,
        gradient_accumulation_plugin: Optional[GradientAccumulationPlugin] = None,
        parallelism_config: Optional[ParallelismConfig] = None,
        deepspeed_plugin: Optional[DeepSpeedPlugin] = None,
        fault_tolerance: Optional[str] = None,
    ) -> None:
        from .compat.arguments import resolve_options  # (imported here, not at import: the import budget)
        from .runtime import start_runtime
        _check_rng_types(rng_types)
        self.options = options = resolve_options(  # argument > launcher variable > default, once
            envvars.worker_settings(), device_placement=device_placement, split_batches=split_batches,
            mixed_precision=mixed_precision, gradient_accumulation_steps=gradient_accumulation_steps, cpu=cpu,
            step_scheduler_with_optimizer=step_scheduler_with_optimizer, kwargs_handlers=kwargs_handlers,
            even_batches=even_batches, strategy=strategy, fsdp_plugin=fsdp_plugin, dynamo_backend=dynamo_backend,
            dynamo_plugin=dynamo_plugin, dispatch_batches=dispatch_batches, dataloader_config=dataloader_config,
            step_scheduler_per_process=step_scheduler_per_process, hang_timeout=hang_timeout,
            preemption_signals=preemption_signals, gradient_accumulation_plugin=gradient_accumulation_plugin,
            parallelism_config=parallelism_config, deepspeed_plugin=deepspeed_plugin, fault_tolerance=fault_tolerance)
        self._runtime = runtime = start_runtime(options)
        self._closer = weakref.finalize(self, runtime.close)  # collected without end_training: release locally
        self._closer.atexit = False  # at interpreter exit the process's own exit handlers do it, as before
        self._adopt(runtime, options)
        self.project_config: ProjectConfiguration = self._project_configuration(project_dir, project_config)
        self.log_with = log_with
        self._models: List[torch.nn.Module] = []
        self._sync_flagged: List[torch.nn.Module] = []  # prepared models with DDP's require_backward_grad_sync
        self._no_sync_depth = 0  # inside accelerator.no_sync(): backward keeps gradients local
        self._optimizers: List[AcceleratedOptimizer] = []
        self._schedulers: List[AcceleratedScheduler] = []
        self._dataloaders: List[PreparedDataLoader] = []
        self._custom_objects: List[Any] = []
        self._save_hooks: List[Callable[..., Any]] = []
        self._load_hooks: List[Callable[..., Any]] = []
        self._trigger = False
        self.step = 0  # incremented by save_state for automatic checkpoint naming
        _live_instances.add(self)
        _check_version_gates(self.is_main_process)

    def _project_configuration(self, project_dir: Optional[str],
                               config: Optional[ProjectConfiguration]) -> ProjectConfiguration:
        """``config`` (or a new one) with ``project_dir`` applied; with fault tolerance, under
        ``replica_group_<g>``: each replica group logs and checkpoints on its own."""
        if config is None:
            from .checkpoint import ProjectConfiguration

            config = ProjectConfiguration(project_dir=project_dir)
        elif project_dir is not None:
            config.project_dir = project_dir
        if self._replica is not None:
            config.project_dir = os.path.join(config.project_dir or ".", f"replica_group_{self._replica.settings.group}")
        return config

    def _adopt(self, runtime: Runtime, options: AcceleratorOptions) -> None:
        """Take what the runtime started (environment, backend, device, strategy) and what the
        resolved options say (scaler, accumulation, kwargs handlers, loaders, schedulers)."""
        from .compat.kwargs import AutocastKwargs, GradientAccumulationPlugin, GradScalerKwargs, ProfileKwargs

        self._env: Environment = runtime.env
        self._backend = runtime.backend
        self.device = runtime.device
        self._mixed_precision = runtime.mixed_precision
        self._strategy = strategy = runtime.strategy
        self._replica = runtime.replica  # fault tolerance (None: off): asked at the step's boundaries
        if self._replica is not None:  # a heal reads and loads what this Accelerator prepared
            self._replica.attach(weakref.WeakMethod(self._training_state))
        engine = strategy if isinstance(strategy, EngineTraining) else None  # DeepSpeed: its engine's backward
        self.scaler = None if engine is not None and engine.owns_loss_scaling else self._backend.make_scaler(
            self._mixed_precision, **options.handler(GradScalerKwargs).to_kwargs())
        self._engine_backward = engine.engine_backward if engine is not None else None
        self._fp8: Optional[Fp8Training] = None  # mixed_precision="fp8": converts models before they are wrapped
        if self._mixed_precision == "fp8":  # imported here: a script without fp8 never loads it (start-up)
            from .training.precision_fp8 import Fp8Training

            self._fp8 = Fp8Training(options.fp8, self._backend.fp8_support(), is_main_process=self.is_main_process,
                                    sharded=self._strategy.distributed_type == DistributedType.FSDP)
        self.gradient_accumulation_plugin = options.gradient_accumulation_plugin or GradientAccumulationPlugin()
        accumulation = options.accumulation
        self.gradient_state = GradientState(options.gradient_accumulation_steps,
                                            sync_with_dataloader=accumulation.sync_with_dataloader,
                                            sync_each_batch=accumulation.sync_each_batch)
        self._divide_by_group_size = bool(accumulation.divide_by_group_size)
        self._autocast_kwargs = options.handler(AutocastKwargs)
        self._profile_kwargs = options.handler(ProfileKwargs)
        self._state: Optional[AcceleratorState] = None
        fsdp_plugin = options.fsdp_plugin
        # Accelerate always has an FSDP plugin under FSDP (the plugin module is loaded only then: a DDP
        # worker forked by notebook_launcher imported it on its way to the first collective)
        if fsdp_plugin is None and getattr(self._strategy.options, "strategy", None) == "fsdp":
            from .compat.plugins import FullyShardedDataParallelPlugin
            from .strategies.options import FSDPOptions

            if isinstance(self._strategy.options, FSDPOptions):
                fsdp_plugin = FullyShardedDataParallelPlugin.from_options(self._strategy.options)
        self._plugins = {"fsdp": fsdp_plugin, "dynamo": options.dynamo_plugin,
                         "deepspeed": options.deepspeed_plugin}
        self.dataloader_config = options.dataloader_config
        self.device_placement = options.device_placement
        self.step_scheduler_with_optimizer = options.step_scheduler_with_optimizer
        self.step_scheduler_per_process = options.step_scheduler_per_process

    def __getstate__(self) -> Dict[str, Any]:
        """Pickling (Accelerate's tests pickle an Accelerator): a copy owns nothing of this
        process (see :meth:`Runtime.__getstate__ <anyaccel.runtime.Runtime.__getstate__>`)."""
        state = dict(self.__dict__)
        state.pop("_closer", None)
        return state

    @property
    def _preemption(self) -> Preemption:
        return self._runtime.preemption

    @property
    def _trackers(self) -> Optional[TrackerSet]:
        return self._runtime.trackers

    @property
    def _async_saver(self) -> Optional[AsyncSaver]:
        """The AsyncSaver of ``save_state(async_save=True)`` (the runtime owns it; made at first use)."""
        return self._runtime.async_saver

    @_async_saver.setter
    def _async_saver(self, saver: Optional[AsyncSaver]) -> None:
        self._runtime.async_saver = saver

    # ---------------------------------------------------------------------------------------
    # Where am I (process indices and the rank rules: JobView, shared with the state objects)
    # ---------------------------------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        """The device :class:`~anyaccel.backends.base.Backend` of this process. Local."""
        return self._backend

    @property
    def strategy(self) -> Strategy:
        """The :class:`~anyaccel.strategies.base.Strategy` that wraps prepared models. Local."""
        return self._strategy

    @property
    def deepspeed_plugin(self) -> Optional[DeepSpeedPlugin]:
        """The :class:`~anyaccel.utils.DeepSpeedPlugin` given (Accelerate's attribute), or None. Local."""
        return cast(Optional["DeepSpeedPlugin"], self.options.deepspeed_plugin)

    # ---- the N-D parallelism mesh; Accelerate's names -------------------------------------------
    @property
    def parallelism_config(self) -> Optional[ParallelismConfig]:
        """The :class:`~anyaccel.ParallelismConfig` in use (sizes resolved for this job), or None. Local."""
        return getattr(self._strategy, "parallelism_config", None)  # only a strategy over a mesh has one

    @property
    def torch_device_mesh(self) -> Optional[DeviceMesh]:
        """The job's named ``DeviceMesh`` under ``parallelism_config`` (None otherwise). Collective
        the first time it is read, if ``prepare`` has not built it yet."""
        return self._strategy.process_mesh.device_mesh if self.parallelism_config is not None else None

    def _mesh_rank(self, dim: str) -> int:
        """This process's coordinate along ``dim`` of the strategy's mesh; 0 without a
        ``parallelism_config`` (what Accelerate reports then). Local."""
        return self._strategy.process_mesh.coordinate(dim) if self.parallelism_config is not None else 0

    @property
    def data_parallel_rank(self) -> int:
        """Rank along the replica dimension (0 without one), as Accelerate. Local."""
        return self._mesh_rank("dp_replicate")

    @property
    def data_parallel_shard_rank(self) -> int:
        """Rank along the FSDP shard dimension (0 without one). Local."""
        return self._mesh_rank("dp_shard")

    @property
    def tensor_parallel_rank(self) -> int:
        """Rank along the tensor-parallel dimension (0 without one). Local."""
        return self._mesh_rank("tp")

    @property
    def context_parallel_rank(self) -> int:
        """Rank along the context-parallel dimension (0 without one). Local."""
        return self._mesh_rank("cp")

    @property
    def sequence_parallel_rank(self) -> int:
        """Which slice of each sequence this process holds under ``sp_size`` > 1 (0 without). Local."""
        return self._mesh_rank("sp")

    @property
    def pipeline_parallel_rank(self) -> int:
        """Rank along the pipeline dimension: which stages this process holds under ``pp_size`` > 1
        (0 without one; Accelerate's name, where it raises). Local."""
        return self._mesh_rank("pp")

    @property
    def expert_parallel_rank(self) -> int:
        """Rank within this process's expert-parallel group under ``ep_size`` > 1: which block of
        ``num_experts / ep_size`` experts of each MoE layer this process holds (rank ``r`` holds
        experts ``r * n .. (r + 1) * n - 1``); 0 without one. Local."""
        return self._mesh_rank("ep")

    @property
    def distributed_type(self) -> DistributedType:
        """As Accelerate reports it: the strategy's (``FSDP`` under ``strategy="fsdp"``, else the
        environment's: ``NO``, ``MULTI_CPU``, ``MULTI_GPU``, ``XLA``), unless a script assigned
        ``accelerator.state.distributed_type``. Local."""
        return self.state.distributed_type

    @property
    def state(self) -> AcceleratorState:
        """The :class:`~anyaccel.state.AcceleratorState` view of this accelerator's job (process
        indices, device, mixed precision, distributed type): Accelerate's ``accelerator.state``,
        without a process-wide singleton; read-only but for the two attributes Accelerate's
        scripts assign (see :mod:`anyaccel.state`). Local."""
        if self._state is None:
            from .compat.state import AcceleratorState

            self._state = AcceleratorState.of(self._env, self.device, self._mixed_precision, self._strategy,
                                              plugins=self._plugins)
        return self._state

    @property
    def project_configuration(self) -> ProjectConfiguration:
        """The :class:`~anyaccel.checkpoint.ProjectConfiguration` (Accelerate's attribute name
        for ``project_config``). Local."""
        return self.project_config

    @property
    def project_dir(self) -> Optional[str]:
        """Where trackers and automatic checkpoints write (``project_config.project_dir``). Local."""
        return self.project_config.project_dir

    @property
    def logging_dir(self) -> Optional[str]:
        """Where trackers write: ``project_config.logging_dir``, else ``project_dir``. Local."""
        return self.project_config.logging_dir or self.project_config.project_dir

    @property
    def save_iteration(self) -> int:
        """The number the next automatic checkpoint gets (``checkpoint_<n>``): one past the last
        saved or loaded, or ``ProjectConfiguration.iteration``. Local."""
        return int(self.project_config.iteration)

    @property
    def mixed_precision(self) -> str:
        """The precision this job trains in: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"`` (after the launcher's
        setting and what the device supports were applied). Local."""
        return self._mixed_precision

    @property
    def dataloader_config(self) -> DataLoaderConfiguration:
        """How data loaders prepared from now on are cut across processes. Settable, as in
        Accelerate (``accelerator.dataloader_config = DataLoaderConfiguration(...)``); a new
        configuration's ``whole_last_batches=None`` (Accelerate's class has no such field) is the
        launcher's ``--whole_last_batches``, else False, as at construction. Local."""
        return self._dataloader_config

    @dataloader_config.setter
    def dataloader_config(self, config: DataLoaderConfiguration) -> None:
        from .data import resolve_dataloader_config

        self._dataloader_config = resolve_dataloader_config(config, whole_last_batches=self.options.whole_last_batches)

    @property
    def split_batches(self) -> bool:
        """``dataloader_config.split_batches`` (settable, for loaders prepared afterwards). Local."""
        return self.dataloader_config.split_batches

    @split_batches.setter
    def split_batches(self, value: bool) -> None:
        self.dataloader_config = dataclasses.replace(self.dataloader_config, split_batches=bool(value))

    @property
    def even_batches(self) -> bool:
        """``dataloader_config.even_batches`` (settable, for loaders prepared afterwards). Local."""
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config = dataclasses.replace(self.dataloader_config, even_batches=bool(value))

    @property
    def dispatch_batches(self) -> Optional[bool]:
        """``dataloader_config.dispatch_batches``: whether rank 0 reads batches and sends each
        process its part (None: decided per loader). Local."""
        return self.dataloader_config.dispatch_batches

    @property
    def use_seedable_sampler(self) -> bool:
        """``dataloader_config.use_seedable_sampler`` (Accelerate's option; anyaccel's prepared
        loaders share one seed across ranks either way). Local."""
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        """``dataloader_config.non_blocking``: batches are moved to the device with
        ``non_blocking=True``. Local."""
        return self.dataloader_config.non_blocking

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (see :meth:`accumulate`); settable. Local."""
        return self.gradient_state.accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        self.gradient_state.accumulation_steps = int(steps)

    @property
    def sync_gradients(self) -> bool:
        """False on the micro-steps of gradient accumulation where gradients only add up locally. Local."""
        return self.gradient_state.sync_gradients

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last optimizer step was skipped by the fp16 scaler (inf/NaN gradients). Local."""
        return any(opt.step_was_skipped for opt in self._optimizers)

    def __repr__(self) -> str:
        e = self._env
        return (f"Accelerator(distributed_type={e.distributed_type.value}, num_processes={e.world_size}, "
                f"process_index={e.rank}, device={self.device}, mixed_precision={self._mixed_precision})")

    # ---------------------------------------------------------------------------------------
    # prepare
    # ---------------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: Optional[List[bool]] = None) -> Any:
        """Prepare models, optimizers, LR schedulers and DataLoaders for this environment; returns
        them in the order given (one object → that object). May be called several times.

        Collective when it prepares a DataLoader (the shuffle seed is shared) or a model in a
        multi-process job (DDP broadcasts rank 0's weights): every rank calls ``prepare`` with the
        same kinds of objects in the same order.

        * ``nn.Module`` → moved to :attr:`device`; wrapped in ``DistributedDataParallel`` when
          there are several processes; forward under autocast when mixed precision is on.
        * ``torch.optim.Optimizer`` → :class:`~anyaccel.stepping.AcceleratedOptimizer`.
        * LR scheduler → :class:`~anyaccel.stepping.AcceleratedScheduler`.
        * ``DataLoader`` → :class:`~anyaccel.data.PreparedDataLoader` (this process's shard).

        Anything else raises ``TypeError`` naming its type.
        """
        if device_placement is not None and len(device_placement) != len(args):
            raise ValueError(f"device_placement has {len(device_placement)} entries for {len(args)} objects")
        placements = device_placement or [self.device_placement] * len(args)
        kinds = [self._kind(obj, i) for i, obj in enumerate(args)]
        if isinstance(self._strategy, EngineTraining):  # DeepSpeed builds its engine from the objects together
            self._strategy.begin_prepare([obj for obj, kind in zip(args, kinds) if kind != "done"],
                                         gradient_accumulation_steps=self.gradient_accumulation_steps,
                                         split_batches=self.split_batches)
        result: List[Any] = list(args)
        for phase in ("model", "optimizer", "dataloader", "scheduler"):
            for i, (obj, kind) in enumerate(zip(args, kinds)):
                if kind != phase:
                    continue
                if phase == "model":
                    result[i] = self.prepare_model(obj, device_placement=placements[i])
                elif phase == "optimizer":
                    result[i] = self.prepare_optimizer(obj)
                elif phase == "dataloader":
                    result[i] = self.prepare_data_loader(obj, device_placement=placements[i])
                else:
                    result[i] = self.prepare_scheduler(obj)
        return result[0] if len(result) == 1 else tuple(result)

    @staticmethod
    def _kind(obj: Any, index: int) -> str:
        from torch.utils.data import DataLoader

        from .data import PreparedDataLoader

        if isinstance(obj, (AcceleratedOptimizer, AcceleratedScheduler, PreparedDataLoader)):
            return "done"
        if isinstance(obj, torch.nn.Module):
            return "model"
        if isinstance(obj, torch.optim.Optimizer):
            return "optimizer"
        if isinstance(obj, DataLoader):
            return "dataloader"
        if isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
            return "scheduler"
        raise TypeError(
            f"prepare() argument {index} is a {type(obj).__module__}.{type(obj).__qualname__}; it accepts "
            "torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler and "
            "torch.utils.data.DataLoader objects."
        )

    def prepare_model(self, model: torch.nn.Module, device_placement: Optional[bool] = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        """Move ``model`` to the device and wrap it for training across processes (the strategy's
        wrapper: DDP when distributed), unless ``evaluation_mode``; add autocast. Collective in a
        multi-process job (DDP construction broadcasts rank 0's parameters). Anything but a
        ``torch.nn.Module`` is a ``TypeError`` naming what was passed."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"prepare_model() takes the model (a torch.nn.Module); got {_qualified(model)}. "
                            "Pass optimizers, schedulers and DataLoaders to prepare() (or prepare_optimizer(), "
                            "prepare_scheduler(), prepare_data_loader()).")
        place = device_placement if device_placement is not None else self.device_placement
        if self.options.dynamo_plugin is not None:  # Accelerate reads the plugin here: changes made to it count
            self._strategy.dynamo = self.options.dynamo_plugin.to_options()
        if self._fp8 is not None and not evaluation_mode and any(p.requires_grad for p in model.parameters()):
            self._fp8.convert(self._strategy.unwrap(model))  # before any wrapper (TP, compile, FSDP2, DDP) sees it
        wrapped = self._strategy.prepare_model(model, device_placement=place, evaluation_mode=evaluation_mode)
        for optimizer in self._optimizers:  # prepared before this model: point them at its new parameters
            if self._fp8 is not None:
                self._fp8.remap(optimizer.optimizer)
            self._strategy.prepare_optimizer(optimizer.optimizer, self._models + [wrapped])
            if self._fp8 is not None:
                self._fp8.attach(optimizer.optimizer)
        if self._mixed_precision != "no":
            _precision.add_autocast(wrapped, self._backend.autocast_device_type, self._mixed_precision)
        if self._fp8 is not None:
            self._fp8.wrap_forward(wrapped)
        self._models.append(wrapped)
        if hasattr(wrapped, "require_backward_grad_sync"):  # (backward reads it on these only: a plain module
            self._sync_flagged.append(wrapped)  # would answer through nn.Module.__getattr__ and an AttributeError)
        if self._replica is not None:  # its gradients are averaged over the replica groups, during backward
            self._replica.watch(self._trained_parameters(), self._models)
        from .process import process_group

        process_group.keep_all()  # groups made while wrapping (device meshes) are kept like the default one
        return wrapped

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> AcceleratedOptimizer:
        """Wrap ``optimizer``. Local (no communication). Anything but a ``torch.optim.Optimizer``
        is a ``TypeError`` naming what was passed."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"prepare_optimizer() takes a torch.optim.Optimizer; got {_qualified(optimizer)}. "
                            "Pass models to prepare() or prepare_model().")
        if self._fp8 is not None:
            self._fp8.remap(optimizer)  # built on the model before its fp8 conversion replaced parameters
        optimizer = self._strategy.prepare_optimizer(optimizer, self._models)
        if self._fp8 is not None:
            self._fp8.attach(optimizer)  # FSDP2's fp8 all-gather: scales precomputed after each step
        wrapped = AcceleratedOptimizer(optimizer, self.gradient_state, self.scaler,
                                       before_step=self._strategy.before_optimizer_step(),
                                       commit=self._replica.commit if self._replica is not None else None)
        self._optimizers.append(wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap ``scheduler`` so it steps only with its optimizer, once per data-parallel process
        (``num_processes``; under a ``parallelism_config``, the processes that see different
        batches) per optimizer step as Accelerate's does (once with ``split_batches`` or
        ``step_scheduler_per_process=False``; see :mod:`anyaccel.stepping`). Local."""
        scheduler = self._strategy.prepare_scheduler(scheduler)
        opts = [o for o in self._optimizers if o.optimizer is scheduler.optimizer or o is scheduler.optimizer]
        dp_size = self._strategy.process_mesh.loader_shard()[1]  # the processes that read different batches
        per_step = dp_size if self.step_scheduler_per_process and not self.split_batches else 1
        wrapped = AcceleratedScheduler(scheduler, opts or list(self._optimizers), self.gradient_state,
                                       step_with_optimizer=self.step_scheduler_with_optimizer,
                                       steps_per_optimizer_step=per_step)
        self._schedulers.append(wrapped)
        return wrapped

    def prepare_data_loader(self, data_loader: Any, device_placement: Optional[bool] = None) -> PreparedDataLoader:
        """Shard ``data_loader`` over the processes as :attr:`dataloader_config` says (one process:
        the original loader's batches, in its order); its batches reach the device through the
        backend's feed. Collective (rank 0's generator states or shuffle seed are broadcast)."""
        from .data import prepare_data_loader

        place = self.device_placement if device_placement is None else device_placement
        batch_rank, batch_size = self._strategy.process_mesh.loader_shard()  # over every replica group too
        feed: Optional[Callable[[Iterable[Any]], Iterable[Any]]] = self._backend.feed if place else None
        if isinstance(self._strategy, SequenceParallel):  # each sp rank keeps its slice of every sequence
            feed = self._strategy.sequence_feed(feed)
        prepared = prepare_data_loader(data_loader, self.device if place else torch.device("cpu"), batch_size,
                                       batch_rank, tracker=self.gradient_state, feed=feed,
                                       config=self.dataloader_config)
        if not self._dataloaders and self._preemption.signals:  # the training loader: preemption stops here
            preemption = self._preemption
            if preemption.install():
                # nothing here refers to self strongly: the signal handler holds the Preemption,
                # which must not keep this Accelerator alive
                preemption.gate = self.gradient_state
                preemption.on_stop = weakref.WeakMethod(self._stop_for_preemption)
                preemption.in_loop = functools.partial(_iterating, self.gradient_state, weakref.ref(prepared))
                prepared.on_batch = preemption.boundary  # called per batch: one call, no wrapper
            elif self.is_local_main_process:
                warnings.warn("checkpoint-on-preemption is off: the Accelerator was not created in the main thread, "
                              "where Python must install signal handlers", stacklevel=2)
        if not self._dataloaders and self._replica is not None:  # the step's quorum forms before its first batch
            prepared.on_batch = _replica_boundary(self._replica, self.gradient_state, prepared.on_batch)
        self._dataloaders.append(prepared)
        return prepared

    def _trained_parameters(self) -> List[torch.nn.Parameter]:
        """The parameters of every prepared model that get gradients, in prepare order."""
        return [p for m in self._models for p in m.parameters() if p.requires_grad]


    def _stop_for_preemption(self, reason: str) -> None:
        """Every rank arrives here at the same boundary: save, requeue (rank 0), exit 75."""
        from .checkpoint import CheckpointError, save_state
        from .process.preemption import PREEMPTED_EXIT_CODE, requeue_slurm_job

        try:  # an asynchronous save in flight is finished first
            self.wait_for_checkpoint()
        except CheckpointError as exc:
            print(f"[anyaccel] {exc}", file=sys.stderr, flush=True)
        config = self.project_config  # the next checkpoint_<n> under project_dir (".") whatever the naming setting
        if not (config.automatic_checkpoint_naming and config.project_dir):
            config = dataclasses.replace(config, automatic_checkpoint_naming=True, project_dir=config.project_dir or ".")
        directory = save_state(self._training_state(), None, config)
        note = requeue_slurm_job(launch=self._runtime.env.launch) if self.process_index == 0 else None
        # no rank exits before rank 0 has requeued: an exiting rank makes its launcher stop the rest
        # of the node, rank 0 included, and a slow scontrol would then never finish
        ops.barrier()
        if self.is_main_process:
            print(f"[anyaccel] {reason}: every rank saved {directory} and stops (exit {PREEMPTED_EXIT_CODE}); "
                  "start the same command again and accelerator.resume() continues from it"
                  + (f"\n[anyaccel] {note}" if note else ""), file=sys.stderr, flush=True)
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def skip_first_batches(self, dataloader: PreparedDataLoader, num_batches: int = 0) -> PreparedDataLoader:
        """Make the next iteration of a prepared ``dataloader`` skip its first ``num_batches``
        batches (on every process: each skips its own). Returns the loader. Local."""
        from .data import skip_first_batches

        return skip_first_batches(dataloader, num_batches)

    # ---------------------------------------------------------------------------------------
    # the training step
    # ---------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward(**kwargs)``, divided by the number of micro-batches in the current
        accumulation group (``gradient_accumulation_steps``, fewer for a loader's short last
        group unless ``GradientAccumulationPlugin(divide_by_group_size=False)``, see
        :mod:`anyaccel.accumulation`) and multiplied by the loss scale under fp16.
        Local; DDP all-reduces gradients during it on sync steps. With fault tolerance a sync
        step's ``backward`` that raises still sends the step's gradients over the replica groups
        (their all-reduces keep lining up) and its group votes the step down (the others commit it,
        and the group heals at its next quorum; with ``find_unused_parameters=True`` no group commits
        it: :meth:`Replica.abandon`), then raises.

        The one place a step's backward is divided over an accumulation group and watched by the
        hang doctor: :meth:`pipeline_step` hands it the schedule's step in the shape of a loss
        (its ``backward()`` runs the schedule)."""
        state = self.gradient_state
        if state.accumulation_steps > 1:
            loss = loss / (state.group_size if self._divide_by_group_size else state.accumulation_steps)
        # the hang doctor sees DDP's all-reduce (or, in a pipeline step's backward, the schedule's
        # sends and receives): doctor.waiting(op, count=False), written inline because this
        # runs every step (no context-manager object, no two extra calls)
        tracker = doctor.TRACKER
        outer, counted = tracker.op, tracker.counted
        # local under accumulate()'s micro-steps, accelerator.no_sync() and DDP's own model.no_sync()
        syncing = state.sync_gradients and not self._no_sync_depth
        for model in self._sync_flagged:  # (a loop, not all(generator): no calls per step)
            if not model.require_backward_grad_sync:
                syncing = False
                break
        tracker.op = doctor.BACKWARD_SYNC if syncing else doctor.BACKWARD_LOCAL
        tracker.syncs += syncing
        tracker.counted, tracker.since = False, _monotonic()
        tracker.backwards += 1
        replica = self._replica if syncing else None  # averaged over the replica groups (as DDP: not in no_sync)
        if replica is not None:
            replica.arm()
        try:
            try:
                if self._engine_backward is not None:  # DeepSpeed: the engine's backward, at anyaccel's boundary
                    self._engine_backward(loss, state.sync_gradients, **kwargs)
                elif self.scaler is not None:
                    self.scaler.scale(loss).backward(**kwargs)  # type: ignore[no-untyped-call]  # torch: unannotated
                else:
                    loss.backward(**kwargs)  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
            except Exception as exc:
                if replica is not None:  # the step's all-reduces still line up over the groups; this one votes it down
                    replica.abandon(self._trained_parameters(), exc)
                raise
            if replica is not None:
                replica.average_gradients(self._trained_parameters())
        except RuntimeError as exc:
            doctor.raise_explained(exc, tracker.op or doctor.BACKWARD_SYNC)
            raise
        finally:
            tracker.op, tracker.counted = outer, counted

    def pipeline_step(self, model: torch.nn.Module, inputs: Any, target: Any = None,
                      loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None, return_outputs: bool = False) -> Any:
        """One batch through ``model``: forward, ``loss_fn(outputs, target)`` and backward, as
        ``accelerator.backward`` would (divided over an accumulation group); returns the loss,
        detached, on every rank (``(loss, outputs)`` with ``return_outputs``). Under
        ``torch.no_grad()`` the forward only (evaluation; ``target``/``loss_fn`` optional).

        The training step that works when the model is cut into pipeline stages
        (``ParallelismConfig(pp_size=...)``), where no process can call ``model(x)``: the batch is
        cut into ``pp_microbatches`` micro-batches that the schedule runs through the stages, the
        loss lives on the last stage and is sent to every rank, and so are the outputs with
        ``return_outputs``. Without pipeline stages it is ``model(*inputs)``, the loss and
        ``backward`` — so one script runs with any ``pp_size``.

        ``inputs``: a tensor or tuple of tensors (the model's positional inputs), or a transformers
        batch (a mapping with ``input_ids``, ``labels`` used as ``target``). ``loss_fn``: None takes
        a transformers model's own loss (causal LM). Collective under pp (every rank of the job
        calls it with the same batch: all stages of one pipeline see the same one); local
        otherwise, like ``backward``. See docs/guides/pipeline.md."""
        args, target = split_batch(inputs, target)
        strategy = self._strategy
        if loss_fn is None and target is not None:
            loss_fn = default_loss(strategy.unwrap(model))
        pipeline = strategy.pipeline_for(model) if isinstance(strategy, Pipelined) else None
        if pipeline is None:  # no stages: one forward and backward
            outputs = model(*args)
            outputs = getattr(outputs, "logits", outputs)
            loss = loss_fn(outputs, target) if loss_fn is not None and target is not None else None
            if loss is not None and torch.is_grad_enabled():
                self.backward(loss)
            loss = None if loss is None else loss.detach()
            return (loss, outputs) if return_outputs else loss
        step = pipeline.step_of(args, target, loss_fn, self.sync_gradients, return_outputs)
        self.backward(step)  # the schedule runs as the step's backward: divided over accumulation, watched
        return (step.loss, step.outputs) if return_outputs else step.loss

    def causal_lm_loss(self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Next-token cross entropy of a causal LM as one process computes it on the global batch:
        labels shifted by one (across the slice border under ``sp_size`` > 1), ``ignore_index``
        left out, the mean token-weighted over every process's tokens; the same number on every
        process, with gradients scaled so that the strategy's averaging gives that number's
        gradient. For your own LM; a prepared transformers model's ``labels=`` loss is already
        this under sequence parallelism. Collective (an all-gather of one label column per row over
        the sp group, an all-reduce of two numbers over the data-parallel processes)."""
        return self._strategy.causal_lm_loss(logits, labels, ignore_index)

    def global_token_mean(self, loss_sum: torch.Tensor, num_tokens: Any) -> torch.Tensor:
        """``loss_sum`` (this process's summed per-token loss) over ``num_tokens`` (the tokens it
        counted), both added over every process of the global batch: the mean one process computes,
        the same on every process, with gradients scaled so that the strategy's averaging gives
        its gradient. For a per-token loss of your own under sequence parallelism. Collective (one
        all-reduce of two numbers)."""
        return self._strategy.global_token_mean(loss_sum, num_tokens)

    def accumulate(self, *models: torch.nn.Module) -> AccumulateContext:
        """Context for one micro-batch under gradient accumulation: decides whether this step
        synchronises (every ``gradient_accumulation_steps``-th micro-batch and the last batch of
        the loader), and keeps gradients local otherwise (DDP's ``no_sync``). Prepared optimizers
        and schedulers then step only on sync steps. Local (no communication of its own); every
        rank must use it identically."""
        return AccumulateContext(self.gradient_state, models or self._models, self._strategy.sync_context)

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Keep gradients local to each process inside the block (DDP's ``no_sync``; a no-op for a
        single process). Local (no communication of its own); every rank must use it identically."""
        with self._strategy.sync_context([model], False):
            self._no_sync_depth += 1
            try:
                yield
            finally:
                self._no_sync_depth -= 1

    def unscale_gradients(self, optimizer: Optional[AcceleratedOptimizer] = None) -> None:
        """Divide gradients by the fp16 loss scale (no-op otherwise). Local."""
        opts = [optimizer] if optimizer is not None else self._optimizers
        for opt in opts:
            if isinstance(opt, AcceleratedOptimizer):
                opt.unscale_()

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float,
                        norm_type: float = 2.0) -> Optional[torch.Tensor]:
        """Clip the gradients' global norm (after unscaling under fp16); returns that norm, the same
        on every rank. On the non-sync micro-steps of accumulation gradients are incomplete, so
        nothing is clipped and ``None`` is returned. Collective only where the strategy must first
        make gradients final (XLA replicas); local under DDP (gradients are already identical)."""
        if not self.sync_gradients:
            return None
        self.unscale_gradients()
        self._strategy.before_clipping(opt.optimizer for opt in self._optimizers)
        return self._strategy.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.nn.Parameter], clip_value: float) -> None:
        """Clamp every gradient to ``[-clip_value, clip_value]`` (after unscaling under fp16);
        skipped on non-sync micro-steps. Collective only where the strategy must first make
        gradients final (XLA replicas); Local otherwise, like :meth:`clip_grad_norm_`."""
        if not self.sync_gradients:
            return None
        self.unscale_gradients()
        self._strategy.before_clipping(opt.optimizer for opt in self._optimizers)
        self._strategy.clip_grad_value_(parameters, clip_value)

    def autocast(self, autocast_handler: Optional[AutocastKwargs] = None,
                 enabled: Optional[bool] = None) -> ContextManager[Any]:
        """Context manager running the block under this accelerator's mixed precision. An
        :class:`~anyaccel.kwargs.AutocastKwargs` (``autocast_handler``, else the one given in
        ``kwargs_handlers``) can turn it off for the block (``enabled=False``: full precision even
        inside another autocast) or set ``cache_enabled``. Local."""
        handler = autocast_handler if autocast_handler is not None else self._autocast_kwargs
        if not hasattr(handler, "cache_enabled"):
            raise TypeError(f"autocast_handler must be an AutocastKwargs (anyaccel.utils.AutocastKwargs); got "
                            f"{handler!r} — to switch autocast off for a block, pass enabled=False")
        return _precision.autocast(self._backend.autocast_device_type, self._mixed_precision,
                                   handler.enabled if enabled is None else enabled, handler.cache_enabled)

    @contextlib.contextmanager
    def profile(self, profile_handler: Optional[ProfileKwargs] = None) -> Iterator[torch.profiler.profile]:
        """Profile the block with ``torch.profiler`` (options from ``profile_handler``, a
        :class:`~anyaccel.kwargs.ProfileKwargs`, else the one in ``kwargs_handlers``); yields the
        profiler (call ``prof.step()`` per step when a ``schedule_option`` is set). Every rank
        profiles itself; with ``output_trace_dir`` the main process writes its Chrome trace there
        as ``profile_0.json`` (Accelerate's name) when the block ends. Local."""
        import os

        handler = profile_handler if profile_handler is not None else self._profile_kwargs
        profiler = handler.build(self._backend.autocast_device_type)
        with profiler:
            yield profiler
        if handler.output_trace_dir and self.is_main_process:
            os.makedirs(handler.output_trace_dir, exist_ok=True)
            profiler.export_chrome_trace(os.path.join(handler.output_trace_dir, f"profile_{self.process_index}.json"))

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: Sequence[Any], even_batches: Optional[bool] = None) -> Iterator[None]:
        """Let ranks run different numbers of batches inside the block (e.g. with
        ``even_batches=False``): ranks that run out keep answering the others' collectives until
        every rank is done, with ``torch.distributed.algorithms.join.Join`` over ``joinables``
        (prepared DDP models; the optimizer too for ``ZeroRedundancyOptimizer``). Works on CPU/gloo
        as on GPUs. ``even_batches`` overrides the prepared map-style loaders' setting inside the
        block (iterable ones warn and keep theirs). A no-op (with a warning naming why) in a single
        process, under a strategy that cannot join (one without the
        :class:`~anyaccel.strategies.capabilities.UnevenInputs` capability: DDP can, FSDP cannot), or after
        a script assigned another ``state.distributed_type``. Collective: every rank enters it."""
        if self.num_processes <= 1:
            yield
            return
        overridden = []
        if even_batches is not None:
            for loader in self._dataloaders:
                sampler = getattr(loader, "batch_sampler", None)
                if sampler is None or not hasattr(sampler, "even_batches"):
                    warnings.warn("join_uneven_inputs(even_batches=...) is only supported for map-style datasets; "
                                  "a prepared loader over an iterable dataset keeps its own setting", stacklevel=3)
                    continue
                overridden.append((sampler, sampler.even_batches))
                sampler.even_batches = even_batches
        try:
            kind = self.distributed_type  # reassigned by a script: Accelerate's rule reads that
            strategy = self._strategy
            joiner = strategy.join_uneven_inputs(joinables) if isinstance(strategy, UnevenInputs) and \
                kind == strategy.distributed_type else None
            if joiner is None:
                warnings.warn(f"join_uneven_inputs is only supported for multi-GPU/multi-CPU DDP training (this run: "
                              f"{kind.value}, strategy {self._strategy.name!r}); the block runs without Join, so "
                              "every rank must run the same number of collectives", stacklevel=3)
                yield
            else:
                with joiner:
                    yield
        finally:
            for sampler, value in overridden:
                sampler.even_batches = value

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: torch.nn.Module) -> Iterator[None]:
        """Inside the block, ``backward`` of ``model`` all-reduces its gradients even after several
        forward passes under :meth:`no_sync` (what DDP does by itself only outside ``no_sync``).
        The strategy's :class:`~anyaccel.strategies.capabilities.BackwardSyncControl`: a no-op under a
        strategy without it and for a model that is not DDP-wrapped (one process, FSDP). Collective
        inside: every rank must use it for the same backward."""
        strategy = self._strategy
        if not isinstance(strategy, BackwardSyncControl):
            yield
            return
        with strategy.sync_in_backward(model):
            yield

    # ---------------------------------------------------------------------------------------
    # collectives
    # ---------------------------------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        """All-gather tensors (nested allowed) along dim 0; every rank receives the whole. Collective."""
        return ops.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather predictions/labels for metrics: every rank receives all ranks' values with the
        padding that evened out the last batches removed, so over an epoch of a prepared loader
        each sample appears exactly once. Tensors (nested allowed, batch sizes may differ across
        ranks) use one fused all-gather; other objects (or ``use_gather_object=True``) use object
        gathering. Collective."""
        loader = self.gradient_state.active_loader
        padded = loader is not None and loader.end_of_dataloader and loader.last_round_total
        keep = self._strategy.process_mesh.keeps_metrics_share  # one share per batch (the mesh says whose)
        if not use_gather_object:
            try:
                gathered = ops.gather_uneven(input_data if keep else map_tensors(
                    lambda t: t[:0] if t.dim() else t, input_data))
            except TypeError:  # not only tensors
                use_gather_object = True
            else:
                return ops.drop_padding(gathered, loader.last_round_total, loader.last_round_real) \
                    if padded and loader is not None else gathered
        data = (input_data if isinstance(input_data, list) else [input_data]) if keep else []
        gathered = ops.gather_object(data)
        if padded and loader is not None and len(gathered) == loader.last_round_total:
            gathered = gathered[: loader.last_round_real]
        return gathered

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """All-reduce tensors (nested allowed) with ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``
        (``"none"``: only ``scale``); every rank receives the result. Under a
        ``parallelism_config`` each data-parallel group (its TP/CP ranks hold the same batch)
        counts once: ``"sum"`` and ``"mean"`` are over the data-parallel ranks, taking the value
        of each group's first TP rank (values that differ between TP ranks, such as a rank's own
        shard sizes, need ``torch.distributed.all_reduce``). Collective."""
        mesh = self._strategy.process_mesh
        dp_size = mesh.size("batch")
        if dp_size < self.num_processes and reduction in ("sum", "mean"):
            tensor = map_tensors(functools.partial(_data_parallel_share, keep=mesh.keeps_metrics_share,
                                                   as_float=reduction == "mean"), tensor)
            if reduction == "mean":
                reduction, scale = "sum", scale / dp_size
        return ops.reduce(tensor, reduction=reduction, scale=scale)

    def broadcast(self, tensor: Any, from_process: int = 0) -> Any:
        """Every rank receives rank ``from_process``'s tensors. Collective."""
        return ops.broadcast(tensor, from_process=from_process)

    def gather_object(self, obj: Any) -> List[Any]:
        """Gather picklable objects; lists are concatenated over ranks. Collective."""
        return ops.gather_object(obj)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
        """Pad tensors along ``dim`` to the largest size on any rank. Collective."""
        return ops.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def wait_for_everyone(self) -> None:
        """Barrier: returns on each rank once every rank has called it. Collective."""
        ops.barrier()

    def set_trigger(self) -> None:
        """Raise a flag on this rank (e.g. early stopping); see :meth:`check_trigger`. Local."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """True on every rank if any rank called :meth:`set_trigger` since the last check (the
        flag is then cleared). Collective."""
        flag = torch.tensor(1.0 if self._trigger else 0.0, device=self.device)
        hit = bool(ops.reduce(flag, "sum", check=False).item() > 0)
        if hit:
            self._trigger = False
        return hit

    # ---------------------------------------------------------------------------------------
    # main-process helpers
    # ---------------------------------------------------------------------------------------
    def main_process_first(self) -> ContextManager[None]:
        """Rank 0 runs the block first (e.g. download/cache a dataset), the others after it.
        Collective: every rank must enter it."""
        return self.state.main_process_first()

    def local_main_process_first(self) -> ContextManager[None]:
        """Like :meth:`main_process_first`, per node (local rank 0 first). Collective."""
        return self.state.local_main_process_first()

    def on_main_process(self, function: Optional[Callable[..., Any]] = None) -> Callable[..., Any]:
        """Decorator: the function runs on rank 0 only (returns None elsewhere). Local."""
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Optional[Callable[..., Any]] = None) -> Callable[..., Any]:
        """Decorator: the function runs on local rank 0 of each node only (None elsewhere). Local."""
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Optional[Callable[..., Any]] = None) -> Callable[..., Any]:
        """Decorator: the function runs on the last rank only (None elsewhere). Local."""
        return self.state.on_last_process(function)

    def on_process(self, function: Optional[Callable[..., Any]] = None, process_index: int = 0) -> Callable[..., Any]:
        """Decorator: the function runs only on rank ``process_index`` (None elsewhere). Local."""
        return self.state.on_process(function, process_index=process_index)

    def on_local_process(self, function: Optional[Callable[..., Any]] = None, local_process_index: int = 0) -> Callable[..., Any]:
        """Decorator: the function runs only on local rank ``local_process_index`` of each node
        (None elsewhere). Local."""
        return self.state.on_local_process(function, local_process_index=local_process_index)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only (one line per node, not one per rank). Local."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> ContextManager[Any]:
        """Give each rank a contiguous share of ``inputs`` (list, tuple, tensor or dict of them):
        the first ranks get one more element when it does not divide. With ``apply_padding`` every
        share is padded with the last element to equal length. Local (no communication)."""
        return self.state.split_between_processes(inputs, apply_padding=apply_padding)

    # ---------------------------------------------------------------------------------------
    # models, saving, checkpoints
    # ---------------------------------------------------------------------------------------
    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> torch.nn.Module:
        """The user's module: the strategy's wrappers (DDP) removed; the autocast forward removed
        too unless ``keep_fp32_wrapper``; a ``torch.compile`` wrapper the user put on the model
        before ``prepare`` removed unless ``keep_torch_compile``. Models anyaccel compiles are
        compiled in place: with ``keep_torch_compile=True`` (the default) the user's own object
        comes back, compiled; with ``False`` a shallow copy of it that is not compiled and shares
        every parameter and buffer (like ``_orig_mod``; the prepared model stays compiled), for
        ``torch.jit.trace`` or export. Local."""
        if not keep_fp32_wrapper:
            _precision.remove_autocast(model)
        inner = self._strategy.unwrap(model, keep_torch_compile=keep_torch_compile)
        return inner if keep_torch_compile else self._strategy.without_compile(inner)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> Dict[str, torch.Tensor]:
        """The model's full state dict, keyed as the user's module (no ``module.`` or ``_orig_mod.``
        prefixes) unless ``unwrap=False``. Local for single-process and DDP models; under FSDP it is
        gathered: every rank must call it, rank 0 receives the full dict (on the CPU), the others
        ``{}``."""
        return self._strategy.model_state_dict(model) if unwrap else model.state_dict()

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """Save ``obj`` to path ``f`` from the main process only, atomically (temp file + rename):
        an interrupted save never leaves a truncated file. Other ranks return at once — no
        barrier inside, so calling it under ``if accelerator.is_main_process`` is safe (on XLA see
        :meth:`~anyaccel.backends.xla.XlaBackend.host_copy`). Local."""
        from .checkpoint import atomic_save

        obj = self._backend.host_copy(obj, self.is_main_process)
        if self.is_main_process:
            atomic_save(obj, f, safe_serialization=safe_serialization)

    def save_model(self, model: torch.nn.Module, save_directory: str, max_shard_size: Any = "10GB",
                   safe_serialization: bool = True) -> None:
        """Write the unwrapped model's full weights to ``save_directory`` (safetensors, sharded
        above ``max_shard_size``, loadable by a plain ``nn.Module`` without anyaccel) from the main
        process. Single process and DDP: no barrier inside, other ranks return at once (calling it
        under ``if accelerator.is_main_process`` is safe). FSDP: the weights are gathered, so every
        rank must call it. Collective under a sharding strategy, Local otherwise."""
        from .checkpoint import save_model

        if self._strategy.collective_state_dict or self.is_main_process:
            state = self.get_state_dict(model)
            if self.is_main_process:
                save_model(state, save_directory, max_shard_size=max_shard_size, safe_serialization=safe_serialization)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include objects with ``state_dict``/``load_state_dict`` in :meth:`save_state`. Local; every
        rank registers the same objects in the same order (saving and loading them is collective)."""
        for obj in objects:
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"register_for_checkpointing needs objects with state_dict() and load_state_dict(); "
                                f"{type(obj).__name__} has not")
            self._custom_objects.append(obj)

    def register_save_state_pre_hook(self, hook: Callable[..., Any]) -> None:
        """Call ``hook(models, weights, output_dir)`` in :meth:`save_state` before the models are
        written (Accelerate's signature: the hook may edit or pop entries of ``weights``; ``models``
        are the user's modules, unwrapped from DDP, so ``model.save_pretrained(...)`` works, and
        what the hook writes into ``output_dir`` is part of the atomic checkpoint). Local
        registration; every rank should register the same hooks."""
        self._save_hooks.append(hook)

    def register_load_state_pre_hook(self, hook: Callable[..., Any]) -> None:
        """Call ``hook(models, input_dir)`` in :meth:`load_state` before the models are loaded
        (Accelerate's signature; ``models`` are the user's modules, and a model the hook removes
        from the list is not loaded again). Local registration; every rank should register the same
        hooks."""
        self._load_hooks.append(hook)

    def _alone_in(self, what: str, directory: Any) -> bool:
        """Whether this (main) process runs ``what`` without the others, called under ``if
        accelerator.is_main_process:``; raises where it cannot (:mod:`anyaccel.checkpoint.participation`)."""
        if self.num_processes <= 1:
            return False
        from .checkpoint import participation

        sharded_by = None if participation.full_state_on_main(self._strategy) else self._strategy.name
        return participation.alone(what, None if directory is None else str(directory), self.process_index,
                                   self.num_processes, sharded_by)

    def _training_state(self, alone: bool = False) -> TrainingState:
        from .checkpoint import TrainingState

        custom = list(self._custom_objects) + ([self._replica] if self._replica is not None else [])  # its counters
        fsdp_plugin = self._plugins["fsdp"]
        if fsdp_plugin is not None:  # Accelerate reads the plugin at each save and load: set_state_dict_type counts
            self._strategy.checkpoint_format = fsdp_plugin.to_options().checkpoint_format

        return TrainingState(models=list(self._models), optimizers=list(self._optimizers),
                             schedulers=list(self._schedulers), dataloaders=list(self._dataloaders),
                             custom_objects=custom, scaler=self.scaler, strategy=self._strategy,
                             process_index=self.process_index, num_processes=self.num_processes,
                             mixed_precision=self._mixed_precision,
                             gradient_accumulation_steps=self.gradient_accumulation_steps, step=self.step,
                             save_hooks=list(self._save_hooks), load_hooks=list(self._load_hooks), alone=alone)

    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True,
                   async_save: Optional[bool] = None) -> str:
        """Checkpoint everything prepared (models, optimizers, schedulers, fp16 scaler, loader
        positions), every rank's RNG states and registered objects into ``output_dir``; returns
        the directory. Atomic: a process killed during the save leaves the previous checkpoint
        loadable. Without ``output_dir``, ``ProjectConfiguration(automatic_checkpoint_naming=True)``
        names it ``project_dir/checkpoints/checkpoint_<n>`` and keeps ``total_limit`` of them.
        ``safe_serialization=False`` writes model weights with ``torch.save``. Collective when every
        rank calls it (with the same directory): rank 0 writes the shared files, each rank its RNG
        state, and an error on any rank raises on all of them. Local when called on the main process
        alone (under ``if accelerator.is_main_process:``, as diffusers' scripts do), it writes the
        same checkpoint without the others — models, optimizers, schedulers, registered objects,
        what the pre-hooks write, and its own RNG state, as Accelerate does — once it has found out
        that they are not coming (~1 s; no collective, the others train on); under a strategy
        that shards the state (FSDP2, DeepSpeed, N-D) that raises ``CheckpointError`` naming the
        fix instead. See :mod:`anyaccel.checkpoint` and :mod:`anyaccel.checkpoint.participation`.

        ``async_save=True`` (default: ``ProjectConfiguration.async_save``) returns once the state is
        copied to host memory and writes it in the background; the directory holds the checkpoint
        only when complete on every rank (:meth:`wait_for_checkpoint`). One save is in flight at a
        time (the next waits); ``load_state``, preemption and ``end_training`` wait for it; its
        error is raised by the next of these (:mod:`anyaccel.checkpoint.async_save`)."""
        from .checkpoint import participation, save_state

        if self.gradient_state.micro_step != 0:
            warnings.warn("save_state is called in the middle of a gradient-accumulation group: the gradients "
                          "accumulated so far are not saved, so a run resumed from it differs; save after a sync step "
                          "(when accelerator.sync_gradients is True)", stacklevel=2)
        alone = self._alone_in("save_state", output_dir)
        with participation.by_itself(alone, "save_state", output_dir):  # a hook's collective raises then
            # asynchronous checkpoints: the saver owns the write in flight
            if getattr(self.project_config, "async_save", False) if async_save is None else async_save:
                if self._async_saver is None:
                    from .checkpoint.async_save import AsyncSaver

                    self._async_saver = AsyncSaver()
                return self._async_saver.save(self._training_state(alone), output_dir, self.project_config,
                                              safe_serialization)
            self.wait_for_checkpoint()
            return save_state(self._training_state(alone), output_dir, self.project_config,
                              safe_serialization=safe_serialization)

    def wait_for_checkpoint(self) -> Optional[str]:
        """Wait until the asynchronous :meth:`save_state` in flight is complete on every
        rank; return its directory (None when none was in flight). Raises its ``CheckpointError``
        (on every rank). Local wait (every rank should call it)."""
        return self._async_saver.wait() if self._async_saver is not None else None

    def load_state(self, input_dir: Optional[str] = None, strict: bool = True) -> str:
        """Restore what :meth:`save_state` wrote: models, optimizers, schedulers, scaler,
        registered objects, every rank's RNG states, and each prepared loader's epoch and shuffle.
        Call it after ``prepare`` (and ``register_for_checkpointing``) with the same objects in the
        same order. As in Accelerate, a loader saved in the middle of an epoch runs that epoch
        again **from its first batch** (same order): the script skips the batches already done,
        as Accelerate's and transformers' scripts do (``accelerator.skip_first_batches(loader,
        resume_step)`` for that epoch, or diffusers' ``continue`` loop), and the run continues
        bitwise. With ``DataLoaderConfiguration(use_stateful_dataloader=True)`` the loaders also
        continue after the batches already seen (then skip nothing yourself); :meth:`resume`
        always does. Without ``input_dir`` loads the newest automatic checkpoint.
        ``strict`` is passed to ``load_state_dict`` of the models. Collective when every rank calls
        it (with the same ``input_dir``): rank 0 finds and checks the checkpoint, every rank loads
        that one, and a problem on any rank raises ``FileNotFoundError``/``CheckpointError`` on all
        of them, naming the path and what is wrong. Local when called by the main process alone in
        a job of several processes (inside ``if accelerator.is_main_process:``), as under Accelerate
        with DDP: once it has found out that the others are not coming (~1 s; no collective, the
        others train on), it loads into the main process only — its model, optimizer, schedulers,
        registered objects, loaders' epochs (from the epoch's first batch) and RNG — and keeps its
        place in a gradient-accumulation group, in step with the others. The other processes keep
        their weights, and DDP never re-broadcasts parameters, so the replicas stay apart: it warns
        once, saying to call it on every process. Under a strategy that shards the state (FSDP2,
        DeepSpeed, N-D) that raises ``CheckpointError`` naming the fix instead. Only reads. Returns
        the directory loaded."""
        return self._load_state(input_dir, strict, loader_positions=self.use_stateful_dataloader)

    def _load_state(self, input_dir: Optional[str], strict: bool, loader_positions: bool,
                    alone: Optional[bool] = None) -> str:
        from .checkpoint import load_state, participation

        self.wait_for_checkpoint()
        if alone is None:
            alone = self._alone_in("load_state", input_dir)
        # alone: the loaders restart the saved epoch (a position would change this process's number
        # of batches, and with it the gradient all-reduces the others wait in)
        with participation.by_itself(alone, "load_state", input_dir):  # a hook's collective raises then
            directory, manifest = load_state(self._training_state(alone), input_dir, self.project_config,
                                             strict=strict, loader_positions=loader_positions and not alone)
        if self._fp8 is not None:
            self._fp8.refresh()  # fp8 scales precomputed from the weights before the load
        self.step = int(manifest.get("step", 0))
        if alone:  # the others go on with their accumulation group: this process's syncs must stay in step
            participation.loaded_alone(directory)
        else:
            self.gradient_state.reset()
        return directory

    def resume(self, checkpoint: Optional[str] = None) -> "ResumePoint":
        """Continue a run that stopped (preempted, killed, restarted by ``--max_restarts``): load
        the newest complete checkpoint under ``project_dir/checkpoints`` (or ``checkpoint``) and
        return where training stands, so the loop starts there::

            start = accelerator.resume()
            for epoch in range(start.epoch, num_epochs):
                for batch in train_loader:   # continues mid-epoch after the batches already done
                    ...

        Unlike :meth:`load_state` (without ``use_stateful_dataloader``), it restores the loaders'
        positions in the epoch: skip nothing yourself after it. Returns ``ResumePoint(epoch, step, checkpoint)``: ``epoch`` the epoch to run (possibly part
        way through), ``step`` the training batches done over all epochs (per process), and the
        directory loaded — ``ResumePoint(0, 0, None)`` when there is nothing to resume from (a
        first run with ``project_dir`` or automatic checkpoint naming; without either, finding
        nothing is a ``ValueError`` that says what to pass, as ``save_state()``'s). Call it after
        ``prepare`` and ``register_for_checkpointing``, with the same objects as the run that saved. Collective: every rank calls it; rank 0 chooses the
        checkpoint and every rank loads that one (a rank that cannot read it raises on all ranks,
        so none starts afresh while the others resume); called on the main process alone it raises
        ``CheckpointError`` there (~1 s, never a wait). A checkpoint written by another model
        raises :class:`~anyaccel.errors.CheckpointError` naming the first key that differs,
        before anything is loaded.

        With fault tolerance the replica group then joins the quorum of the next step and, when
        live groups are ahead of it (it was restarted), heals from one of them: their weights,
        optimizer, schedulers, loader positions, RNG and step replace what it had, and the
        returned point is theirs (``checkpoint`` then names the peer). Collective over the replica
        groups too."""
        if self._replica is not None:
            return self._resume_replica(checkpoint)
        return self._resume_from_disk(checkpoint)

    def _resume_replica(self, checkpoint: Optional[str]) -> "ResumePoint":
        """:meth:`resume` with fault tolerance: this group's own newest checkpoint (if any), then
        the quorum, which heals it from a live peer that is ahead."""
        point = self._resume_from_disk(checkpoint, missing_ok=True)
        assert self._replica is not None
        heal = self._replica.join()
        if heal is None:
            return point
        if self._replica.healed_step is not None:
            self.step = self._replica.healed_step
        epoch, step = _loader_point(self._dataloaders[0] if self._dataloaders else None)
        return ResumePoint(epoch, step, f"a live replica group (after its step {heal.step})")

    def _resume_from_disk(self, checkpoint: Optional[str], missing_ok: bool = False) -> "ResumePoint":
        from .checkpoint.agreement import newest_checkpoint

        self._alone_in("resume", checkpoint)  # on the main process alone: raises (before any collective)

        if checkpoint is None:
            config = dataclasses.replace(self.project_config, project_dir=self.project_config.project_dir or ".")
            checkpoint = newest_checkpoint(self._training_state(), config)
            if checkpoint is None:
                if not (missing_ok or self.project_config.automatic_checkpoint_naming or self.project_config.project_dir):
                    # told nowhere to look, and save_state() would refuse to name one: say what to do
                    raise ValueError("resume() found no checkpoint under ./checkpoints and was told of no other "
                                     "place: save_state() writes checkpoints there only with ProjectConfiguration("
                                     "automatic_checkpoint_naming=True, project_dir=...); pass that (or project_dir="
                                     "..., where a preempted run saves), or resume('path/to/checkpoint')")
                return ResumePoint(0, 0, None)
        directory = self._load_state(checkpoint, True, loader_positions=True, alone=False)  # loaders continue mid-epoch
        epoch, step = _loader_point(self._dataloaders[0] if self._dataloaders else None)
        return ResumePoint(epoch, step, directory)

    # ---------------------------------------------------------------------------------------
    # trackers and logging
    # ---------------------------------------------------------------------------------------
    def _tracker_set(self) -> TrackerSet:
        trackers = self._runtime.trackers
        if trackers is None:
            from .tracking import TrackerSet

            config = self.project_config
            trackers = self._runtime.trackers = TrackerSet(self.log_with,
                                                           getattr(config, "logging_dir", None) or config.project_dir
                                                           or ".", is_main_process=self.is_main_process)
        return trackers

    def init_trackers(self, project_name: str, config: Optional[Dict[str, Any]] = None,
                      init_kwargs: Optional[Dict[str, Any]] = None) -> None:
        """Start the trackers named by ``log_with`` (they write on the main process only). Local: any
        rank may call it, none waits for another — calling it on the main process only (``if
        accelerator.is_main_process:``, as diffusers' scripts do) while every rank calls :meth:`log`
        works."""
        self._tracker_set().init(project_name, config=config, init_kwargs=init_kwargs or {})

    def log(self, values: Dict[str, Any], step: Optional[int] = None,
            log_kwargs: Optional[Dict[str, Any]] = None) -> None:
        """Log scalar ``values`` at ``step`` to every tracker, from the main process only. Local: other
        ranks return at once, whether or not they called :meth:`init_trackers`; on the main process
        a call before :meth:`init_trackers` raises ``RuntimeError`` (nothing would be recorded)."""
        self._tracker_set().log(values, step=step, log_kwargs=log_kwargs or {})

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called ``name`` (its underlying writer with ``unwrap=True``); on other ranks
        than the main one, a stand-in whose every method does nothing (as Accelerate's blank
        tracker). Local."""
        return self._tracker_set().get(name, unwrap=unwrap)

    @property
    def trackers(self) -> List[GeneralTracker]:
        """The trackers started by :meth:`init_trackers` (empty before, and on processes other than
        the main one). Local."""
        return list(self._tracker_set().trackers) if self._trackers is not None else []

    def progress(self, iterable: Any = None, **tqdm_kwargs: Any) -> Any:
        """A tqdm progress bar over ``iterable``, shown by the local main process only (other
        ranks iterate silently). Local."""
        from .logging import progress

        return progress(iterable, main=self.is_local_main_process, **tqdm_kwargs)

    # ---------------------------------------------------------------------------------------
    # memory and teardown
    # ---------------------------------------------------------------------------------------
    def free_memory(self, *objects: Any) -> List[None]:
        """Drop references to everything prepared, run the garbage collector and empty the device
        cache. Returns ``[None] * len(objects)`` so you can write ``a, b = acc.free_memory(a, b)``.
        Local."""
        from .training.memory import free_memory

        self._models.clear()
        self._sync_flagged.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        if self._fp8 is not None:
            self._fp8.release()
        self._dataloaders.clear()
        self.gradient_state.reset()
        self.step = 0
        return free_memory(*objects)

    clear = free_memory

    def end_training(self) -> None:
        """Finish an asynchronous checkpoint still being written, finish the trackers, put back the
        signal handlers that were there before, wait for every rank, and leave the hang doctor:
        :meth:`Runtime.close <anyaccel.runtime.Runtime.close>`, collectively. Collective. Safe to
        call twice (the second call does nothing). The process group stays, as with Accelerate: a
        second ``Accelerator`` of the process trains on it, and it ends with the process once gloo's
        threads are idle (docs/concepts/lifetimes.md). An Accelerator that is garbage-collected
        releases its trackers, signal handlers and doctor subscription (an asynchronous write in
        flight finishes on its own thread, which the interpreter waits for at exit)."""
        self._closer.detach()
        self._runtime.close(collective=True)


class ResumePoint(NamedTuple):
    """Where a resumed run stands (see :meth:`Accelerator.resume`)."""

    epoch: int  #: the epoch to run next (the loader continues it where the checkpoint stopped)
    step: int  #: training batches done, over all epochs, by this process
    checkpoint: Optional[str]  #: the directory loaded; None on a first run


def _loader_point(loader: Optional[PreparedDataLoader]) -> "tuple[int, int]":
    """``(epoch to run, training batches done over all epochs)`` of the training loader's state
    (``(0, 0)`` without one). Local."""
    if loader is None:
        return 0, 0
    state = loader.state_dict()
    epoch = int(state.get("epoch", 0)) + (1 if state.get("finished_epoch") else 0)
    position = 0 if state.get("finished_epoch") else int(state.get("position", 0))
    try:
        per_epoch = len(loader)
    except TypeError:  # an iterable dataset: no length
        per_epoch = 0
    return epoch, epoch * per_epoch + position


def _replica_boundary(replica: Any, gradient_state: GradientState,
                      then: Optional[Callable[[], None]]) -> Callable[[], None]:
    """The training loader's per-batch hook with fault tolerance: ``then`` (preemption's boundary)
    first, then, at a gradient-sync point, the quorum of the optimizer step about to start (it
    forms once per step, before the step's first batch is fetched). Local to the hook's caller;
    the quorum is collective over the replica groups."""

    def boundary() -> None:
        if then is not None:
            then()
        if not gradient_state.micro_step:
            replica.begin_step()

    return boundary


def _iterating(gradient_state: GradientState, loader: "weakref.ref[PreparedDataLoader]") -> bool:
    """Is ``loader`` (the training loader) being iterated? Preemption's question."""
    prepared = loader()
    return prepared is not None and prepared in gradient_state._loaders


def _data_parallel_share(t: torch.Tensor, keep: bool, as_float: bool) -> torch.Tensor:
    """``t`` (as floats for a mean of integers) on the rank that counts for its data-parallel
    group, zeros on the others, so a sum over all ranks counts each group once. Local."""
    if as_float and not (t.is_floating_point() or t.is_complex()):
        t = t.float()
    return t if keep else torch.zeros_like(t)
