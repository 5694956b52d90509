"""DeepSpeed ZeRO (stages 0-3) behind the usual three lines, on CPUs (gloo) as on GPUs.

A real ``deepspeed.initialize`` engine does the work; this strategy makes the training loop a user
already has drive it, with anyaccel's semantics:

* ``prepare(model, optimizer, loader, scheduler)`` (one call: DeepSpeed builds its engine from the
  model and the optimizer together, as in Accelerate) returns the engine in place of the model, and
  an ``AcceleratedOptimizer``/``AcceleratedScheduler`` as usual. The config's ``"auto"`` values are
  filled from what the call holds (:mod:`.config`). A model prepared without an optimizer
  in its call gets an engine without one (evaluation); an optimizer prepared in a later call is an
  error that says to pass both together.
* ``accelerator.backward(loss)`` runs ``engine.backward`` with the accumulation boundary anyaccel
  decided (``accumulate()``), the loss divided by the accumulation group's size as everywhere else;
  ``optimizer.step()`` on a sync step runs ``engine.step()`` (reduction, clipping, the update, the
  zeroing of gradients); ``optimizer.zero_grad()`` has nothing left to do.
* ``accelerator.clip_grad_norm_(params, max_norm)`` makes that step clip at ``max_norm`` and returns
  the global norm before clipping (DeepSpeed clips inside its step; the config's
  ``gradient_clipping`` clips every step without a call).
* mixed precision is DeepSpeed's (``bf16``/``fp16`` sections; no torch gradient scaler); the forward
  still runs under anyaccel's autocast so fp32 inputs meet the bf16 weights.
* state: :meth:`model_state_dict` gathers ZeRO-3's partitions (every rank calls it; rank 0 gets the
  fp32 weights); ``save_state`` writes DeepSpeed's own checkpoint (``engine.save_checkpoint``)
  inside anyaccel's atomic protocol (:mod:`.checkpoint`), and loads DeepSpeed's, FSDP2's
  (torch.distributed.checkpoint) and full (DDP) checkpoints alike.

Refused with a message: XLA/MPS devices, several trained models per ``Accelerator``,
``clip_grad_value_``, a norm other than 2.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch

from ...environment import DistributedType
from ...errors import CheckpointError
from . import checkpoint as checkpointing
from . import convert as converting
from ..base import Strategy, refuse_split_experts, unwrap_module
from ..capabilities import EngineTraining
from .config import DeepSpeedOptions, PreparedObjects, filled_config, get_value
from .engine import (EngineOptimizer, EngineScheduler, cpu_optimizer_for, global_grad_norm, set_clip,
                               zero3_init_hook)

__all__ = ["DeepSpeedStrategy", "import_deepspeed", "cpu_optimizer_for"]

def import_deepspeed() -> Any:
    """``import deepspeed``, or an ``ImportError`` that says how to install it. Its import-time
    notice that it fell back to its CPU accelerator is dropped: on a CPU job that is the intent
    (the strategy sets that accelerator itself). Local."""
    import logging

    quiet = _DropCpuNotice()
    logger = logging.getLogger("DeepSpeed")
    logger.addFilter(quiet)
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError("the deepspeed strategy needs DeepSpeed: pip install anyaccel[deepspeed] "
                          f"(deepspeed==0.19.8); importing it failed: {exc}") from exc
    finally:
        logger.removeFilter(quiet)
    return deepspeed


class _DropCpuNotice:
    """A logging filter for DeepSpeed's "Setting accelerator to CPU" warning at import."""

    def filter(self, record: Any) -> bool:
        return "Setting accelerator to CPU" not in str(record.msg)


class _Call:
    """The objects of one ``prepare`` call the engine is built from."""

    def __init__(self, objects: Sequence[Any], accumulation_steps: int, split_batches: bool):
        from torch.utils.data import DataLoader

        self.optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        self.schedulers = [o for o in objects if _is_scheduler(o)]
        self.batch_sizes = [getattr(o, "batch_size", None) for o in objects if isinstance(o, DataLoader)]
        self.accumulation_steps = accumulation_steps
        self.split_batches = split_batches


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)) \
        or type(obj).__name__ in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


class DeepSpeedStrategy(Strategy, EngineTraining):
    """DeepSpeed's engine over the job's processes, configured by
    :class:`~.config.DeepSpeedOptions` (Accelerate's
    :class:`~anyaccel.utils.deepspeed.DeepSpeedPlugin` converts into them). Reported as
    ``DistributedType.DEEPSPEED``; one trained model (one engine) per ``Accelerator``."""

    name = "deepspeed"
    checkpoint_format = "deepspeed"
    options_type = DeepSpeedOptions
    options: DeepSpeedOptions

    def __init__(self, env: Any, backend: Any, options: Optional[DeepSpeedOptions] = None,
                 mixed_precision: str = "no", dynamo: Any = None):
        super().__init__(env, backend, options, mixed_precision, dynamo)
        import_deepspeed()  # missing: the error that says how to install it, before any group is joined
        self.zero_stage = self.options.zero_stage
        # gathered across processes: ZeRO-3's partitions, or the fp32 masters behind 16-bit weights
        self.collective_state_dict = self.zero_stage == 3 or mixed_precision != "no"
        self.engine: Any = None
        self._call: Optional[_Call] = None
        self._optimizer: Optional[torch.optim.Optimizer] = None  # what the engine was built with
        self._param_names: List[List[str]] = []  # the optimizer's parameters by name, per param group
        self._configured_clip = 0.0
        self._clip: Optional[float] = None  # asked for by clip_grad_norm_ for the next step
        self._hf_config: Any = None  # transformers' HfDeepSpeedConfig, kept alive for zero3_init_flag
        self._warned: set = set()

    @property
    def distributed_type(self) -> DistributedType:
        return DistributedType.DEEPSPEED

    # ---- the process group ------------------------------------------------------------------------
    def setup_process_group(self) -> None:
        """Make DeepSpeed use this job's device and group: a group of one for a single process
        (DeepSpeed needs one), DeepSpeed's CPU accelerator on CPUs (gloo), its communication layer
        over the group, and, with ``zero3_init_flag``, transformers' ZeRO-3 hook so that models
        built from now on are built partitioned. Collective (DeepSpeed's set-up)."""
        import torch.distributed as dist

        if self.env.world_size == 1 and not dist.is_initialized():
            dist.init_process_group(self.env.backend, store=dist.HashStore(), rank=0, world_size=1)
        deepspeed = import_deepspeed()
        from deepspeed.accelerator import get_accelerator, set_accelerator

        if self.backend.device_type == "cpu" and get_accelerator().device_name() != "cpu":
            from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

            set_accelerator(CPU_Accelerator())  # a CPU job on a machine with GPUs (Accelerator(cpu=True))
        if get_accelerator().device_name() != self.backend.device_type:
            raise ValueError(f"strategy='deepspeed': DeepSpeed runs on its {get_accelerator().device_name()!r} "
                             f"accelerator, and this job's device is {self.backend.device_type!r}; DeepSpeed works "
                             "here on CPUs and CUDA GPUs: use strategy='fsdp' (or ddp) on this device")
        if self.backend.device_type == "cpu":
            # DeepSpeed's CPU communication layer JIT-compiles a shared-memory all-reduce kernel at
            # start (1.5 CPU-minutes with gcc) that only its inference tensor parallelism uses:
            # training goes through the gloo group, so it is not built.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        with checkpointing.quiet_deepspeed():
            deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False,
                                       dist_init_required=False)
        if self.options.zero3_init_flag:
            self._hf_config = zero3_init_hook(self.options, self.mixed_precision)

    # ---- prepare ------------------------------------------------------------------------------
    def begin_prepare(self, objects: Sequence[Any], *, gradient_accumulation_steps: int,
                      split_batches: bool) -> None:
        """Remember what one ``prepare`` call holds: the engine is built from the model, the
        optimizer, the scheduler and the loaders' batch size together. Local."""
        self._call = _Call(objects, gradient_accumulation_steps, split_batches)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool, evaluation_mode: bool) -> torch.nn.Module:
        """Build the DeepSpeed engine around ``model`` with the optimizer (and scheduler) of the same
        ``prepare`` call and return it. A model to evaluate (``evaluation_mode``, nothing to train)
        is only placed, as by every strategy. A model whose experts ``shard_experts`` split already
        is refused (:func:`~anyaccel.strategies.base.refuse_split_experts`: ZeRO would average the
        gradients of different experts). Collective (``deepspeed.initialize``)."""
        if evaluation_mode or not any(p.requires_grad for p in model.parameters()):
            return super().prepare_model(model, device_placement, evaluation_mode)
        refuse_split_experts(model)
        if self.engine is not None:
            raise ValueError("one DeepSpeed engine per Accelerator: this Accelerator already trains a model; create "
                             "another Accelerator(deepspeed_plugin=...) for a second model, or prepare it for "
                             "evaluation (accelerator.prepare_model(model, evaluation_mode=True))")
        call, self._call = self._call or _Call((), 1, False), None
        if len(call.optimizers) > 1:
            raise ValueError(f"DeepSpeed builds one engine from one model and one optimizer; this prepare() call has "
                             f"{len(call.optimizers)} optimizers")
        deepspeed = import_deepspeed()
        model = self.compile(model)
        optimizer = call.optimizers[0] if call.optimizers else None
        scheduler = call.schedulers[0] if call.schedulers else None
        config = self._engine_config(model, optimizer, scheduler, call)
        kwargs: Dict[str, Any] = {"model": model, "config": config}
        if optimizer is not None:
            self._param_names = _names_by_group(model, optimizer)
            if _is_dummy(optimizer):
                if "optimizer" not in config:
                    raise ValueError("DummyOptim stands for the DeepSpeed config's \"optimizer\" section, and this "
                                     "config has none: add one, or pass a torch optimizer")
                kwargs["model_parameters"] = optimizer.params
                if _is_dummy(scheduler) and scheduler.lr_scheduler_callable is not None:
                    kwargs["lr_scheduler"] = scheduler.lr_scheduler_callable
            else:
                if "optimizer" in config:
                    raise ValueError("the DeepSpeed config has an \"optimizer\" section and the script passes a torch "
                                     "optimizer too: remove the section, or pass DummyOptim(model.parameters())")
                if get_value(config, "zero_optimization.offload_optimizer.device", "none") not in (None, "none") \
                        and config.get("zero_force_ds_cpu_optimizer", True):
                    optimizer = cpu_optimizer_for(optimizer)  # offload needs DeepSpeed's CPU optimizer
                kwargs["optimizer"] = optimizer
                if scheduler is not None and not isinstance(scheduler, (torch.optim.lr_scheduler.LRScheduler,
                                                                        torch.optim.lr_scheduler.ReduceLROnPlateau)):
                    kwargs["lr_scheduler"] = scheduler  # one of DeepSpeed's own schedulers
            self._optimizer = call.optimizers[0]
        if self.options.transformer_moe_cls_names:
            _set_moe_leaves(model, self.options.transformer_moe_cls_names)
        with checkpointing.quiet_deepspeed():
            engine, _, _, _ = deepspeed.initialize(**kwargs)
        self.engine = engine
        self._configured_clip = float(engine.gradient_clipping() or 0.0)
        return engine

    def _engine_config(self, model: torch.nn.Module, optimizer: Any, scheduler: Any, call: _Call) -> Dict[str, Any]:
        """The DeepSpeed config with its ``"auto"`` values filled from this call. Local."""
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        sizes = getattr(getattr(model, "config", None), "hidden_sizes", None)
        prepared = PreparedObjects(num_processes=self.env.world_size,
                                   gradient_accumulation_steps=call.accumulation_steps,
                                   batch_sizes=call.batch_sizes, split_batches=call.split_batches,
                                   hidden_size=hidden or (max(sizes) if sizes else None))
        if _is_dummy(optimizer):
            prepared.optimizer_lr, prepared.optimizer_weight_decay = optimizer.lr, optimizer.weight_decay
        if _is_dummy(scheduler) and scheduler.lr_scheduler_callable is None:
            prepared.scheduler_warmup_steps = scheduler.warmup_num_steps
            prepared.scheduler_total_steps = scheduler.total_num_steps
            defaults = getattr(scheduler.optimizer, "defaults", None)
            prepared.scheduler_max_lr = defaults["lr"] if defaults else getattr(scheduler.optimizer, "lr", None)
        config = filled_config(self.options, prepared, self.mixed_precision)
        if optimizer is not None and not _is_dummy(optimizer):
            config["zero_allow_untested_optimizer"] = True
        return config

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, models: List[torch.nn.Module]) -> torch.optim.Optimizer:
        """The engine's optimizer, behind an object whose ``step`` runs ``engine.step()``. An
        optimizer the engine was not built with (prepared in a call without its model) is an
        error: DeepSpeed needs both together."""
        if isinstance(optimizer, EngineOptimizer):
            return optimizer
        if self.engine is None or optimizer is not self._optimizer:
            raise ValueError("under DeepSpeed, pass the model and its optimizer to the same prepare() call "
                             "(model, optimizer, ... = accelerator.prepare(model, optimizer, ...)): DeepSpeed builds "
                             "its engine from both together")
        return EngineOptimizer(self)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """A torch scheduler stays as it is (it steps the engine optimizer's learning rate); one the
        engine owns (a ``DummyScheduler``, or DeepSpeed's own) is stepped by ``engine.step()``, so
        what is returned only reports and saves it."""
        if isinstance(scheduler, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)) \
                and not _is_dummy(scheduler):
            return scheduler
        if self.engine is None or self.engine.lr_scheduler is None:
            raise ValueError(f"{type(scheduler).__name__} stands for a scheduler DeepSpeed builds: pass it to the same "
                             "prepare() call as the model and its DummyOptim, with a \"scheduler\" section in the "
                             "DeepSpeed config (or DummyScheduler(lr_scheduler_callable=...))")
        return EngineScheduler(self.engine)

    def unwrap(self, model: torch.nn.Module, keep_torch_compile: bool = False) -> torch.nn.Module:
        if self.engine is not None and model is self.engine:
            model = model.module
        return unwrap_module(model, keep_torch_compile=keep_torch_compile)

    # ---- the training step ------------------------------------------------------------------------
    def engine_backward(self, loss: torch.Tensor, sync: bool, **kwargs: Any) -> None:
        """``engine.backward`` at the boundary anyaccel chose (the loss is already divided by the
        accumulation group's size: DeepSpeed does not divide it again)."""
        engine = self.engine
        if engine is None or engine.optimizer is None:
            raise RuntimeError("accelerator.backward under DeepSpeed needs a model prepared together with its optimizer "
                               "(accelerator.prepare(model, optimizer, ...))")
        unknown = set(kwargs) - {"retain_graph"}
        if unknown:
            raise TypeError(f"accelerator.backward under DeepSpeed takes retain_graph only; got {sorted(unknown)}")
        engine.set_gradient_accumulation_boundary(sync)
        engine.backward(loss, scale_wrt_gas=False, **kwargs)

    def engine_step(self) -> None:
        """``engine.step()``: reduce, clip (at ``clip_grad_norm_``'s ``max_norm`` for this step
        when it was called), update, zero the gradients. Collective."""
        engine = self.engine
        clip, self._clip = self._clip, None
        if clip is None:
            engine.step()
            return
        set_clip(engine, clip)
        try:
            engine.step()
        finally:
            set_clip(engine, self._configured_clip)

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Make the coming ``optimizer.step()`` clip the gradients' global norm at ``max_norm``
        (DeepSpeed clips inside its step); return that norm before clipping, the same on every
        rank. Collective (the norm of partitioned gradients is all-reduced)."""
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_(norm_type={norm_type}): DeepSpeed clips by the L2 norm only; use 2")
        engine = self.engine
        if engine is None or engine.optimizer is None:
            raise RuntimeError("clip_grad_norm_ under DeepSpeed needs a model prepared with its optimizer")
        own = {id(p) for p in engine.module.parameters() if p.requires_grad}
        given = {id(p) for p in parameters}
        if given != own:
            raise ValueError("under DeepSpeed, clip_grad_norm_ clips all of the model's trainable parameters together "
                             "(DeepSpeed clips inside its step); pass model.parameters()")
        if self._configured_clip and float(max_norm) != self._configured_clip and "clip" not in self._warned:
            self._warned.add("clip")
            warnings.warn(f"clip_grad_norm_(max_norm={max_norm}) overrides the DeepSpeed config's gradient_clipping="
                          f"{self._configured_clip} on the steps where it is called", stacklevel=4)
        self._clip = float(max_norm)
        return global_grad_norm(engine)

    def clip_grad_value_(self, parameters: Iterable[torch.nn.Parameter], clip_value: float) -> None:
        raise ValueError("clip_grad_value_ is not available under DeepSpeed: the gradients are partitioned inside its "
                         "optimizer; clip by norm (accelerator.clip_grad_norm_, or the config's gradient_clipping)")

    # ---- state --------------------------------------------------------------------------------
    def model_state_dict(self, model: torch.nn.Module) -> Dict[str, Any]:
        """The full state dict with the user's key names: the fp32 weights (the optimizer's master
        copy) unless ``zero3_save_16bit_model`` asks for the 16-bit ones the engine computes with.
        When :attr:`collective_state_dict` (ZeRO-3, or 16-bit weights), every rank must call it and
        rank 0 receives the dict (CPU tensors), the others ``{}``."""
        if self.engine is None or model is not self.engine:
            return super().model_state_dict(model)
        if not self.collective_state_dict:
            return {k: v.detach().clone() for k, v in self.unwrap(model).state_dict().items()}
        sixteen = self.zero_stage == 3 and bool(get_value(self.options.config,
                                                           "zero_optimization.stage3_gather_16bit_weights_on_model_save"))
        return checkpointing.full_model_state(self.engine, fp32=not sixteen)

    def load_model_state_dict(self, model: torch.nn.Module, state: Dict[str, Any], strict: bool = True) -> Any:
        """Load a full state dict (every rank holds it) into the engine's weights and fp32 masters.
        Collective."""
        if self.engine is None or model is not self.engine:
            return super().load_model_state_dict(model, state, strict)
        return checkpointing.load_full_model_state(self.engine, state, strict)

    def optimizer_state_dict(self, optimizer: Any) -> Dict[str, Any]:
        """torch's layout (parameters numbered in param-group order, as DDP saves it) of the
        engine's optimizer state, gathered: rank 0 holds it, the others ``{}``. Collective."""
        return checkpointing.full_optimizer_state(self.engine, self._param_names)

    def load_optimizer_state_dict(self, optimizer: Any, state: Dict[str, Any]) -> None:
        """Load torch's layout of a full optimizer state (e.g. saved by DDP). Collective."""
        checkpointing.load_full_optimizer_state(self.engine, self._param_names, state)

    def save_sharded(self, directory: str, models: List[torch.nn.Module], optimizers: List[Any],
                     process_group: Any = None, asynchronous: bool = False) -> Any:
        """DeepSpeed's checkpoint (``engine.save_checkpoint``) under ``directory/deepspeed``.
        Collective. DeepSpeed writes synchronously: with ``asynchronous`` the files are written
        before this returns, and the returned function only lists them."""
        self._check_saved(models, optimizers)
        listing = checkpointing.save(directory, self.engine, self._param_names)
        return (lambda: listing) if asynchronous else listing

    def load_sharded(self, directory: str, manifest: Dict[str, Any], models: List[torch.nn.Module],
                     optimizers: List[Any], strict: bool = True) -> None:
        """Read DeepSpeed's own checkpoint (the same number of processes: ``engine.load_checkpoint``;
        another number: converted), or an FSDP2 one (torch.distributed.checkpoint, keyed by
        parameter name). Collective."""
        self._check_saved(models, optimizers)
        kind = manifest.get("checkpoint_format")
        if kind == self.checkpoint_format:
            if int(manifest.get("world_size", 1)) == self.env.world_size:
                checkpointing.load(directory, self.engine, strict)
                return
            weights, optimizer_state = converting.read_full_states(directory)
        elif kind == "sharded":
            weights, optimizer_state = converting.read_dcp_states(directory)
        else:
            raise CheckpointError(f"{directory}: a {kind!r} checkpoint cannot be loaded by the deepspeed strategy")
        checkpointing.load_full_model_state(self.engine, weights, strict)
        if optimizers and optimizer_state is not None:
            checkpointing.load_full_optimizer_state(self.engine, self._param_names, optimizer_state)

    def _check_saved(self, models: List[torch.nn.Module], optimizers: List[Any]) -> None:
        if self.engine is None or len(models) != 1 or models[0] is not self.engine or len(optimizers) > 1:
            raise CheckpointError("save_state/load_state under DeepSpeed store the engine's model and its optimizer: "
                                  "prepare exactly one model (with its optimizer) on this Accelerator")

    def teardown(self) -> None:
        """Release the engine and DeepSpeed's cached process groups (the job's group may be left
        right after: a later engine makes its groups again). Local."""
        if self.engine is not None:
            with contextlib.suppress(Exception):
                self.engine.destroy()
        self.engine = self._optimizer = None
        with contextlib.suppress(ImportError, AttributeError):
            from deepspeed.utils import groups

            groups._release_process_group_references(group=None)
        if self._hf_config is not None:
            with contextlib.suppress(ImportError):
                from transformers.integrations import unset_hf_deepspeed_config

                unset_hf_deepspeed_config()
            self._hf_config = None


def _is_dummy(obj: Any) -> bool:
    return type(obj).__name__ in ("DummyOptim", "DummyScheduler") and hasattr(obj, "kwargs")


def _names_by_group(model: torch.nn.Module, optimizer: Any) -> List[List[str]]:
    """The names of ``optimizer``'s parameters, per param group, in its order (read before
    DeepSpeed replaces them with flat partitions). Raises ``ValueError`` for one not in ``model``."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    groups = optimizer.param_groups if not _is_dummy(optimizer) else optimizer.param_groups
    names = []
    for group in groups:
        params = group["params"] if isinstance(group, dict) else [group]
        missing = [p for p in params if id(p) not in name_of]
        if missing:
            raise ValueError("the optimizer holds parameters that are not the model's (DeepSpeed builds its engine from "
                             "one model and the optimizer of its parameters)")
        names.append([name_of[id(p)] for p in params])
    return names


def _set_moe_leaves(model: torch.nn.Module, class_names: Sequence[str]) -> None:
    from deepspeed.utils import set_z3_leaf_modules

    present = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in class_names if n not in present]
    if missing:
        raise ValueError(f"transformer_moe_cls_names names {missing}, which the model does not contain")
    set_z3_leaf_modules(model, [present[n] for n in class_names])
