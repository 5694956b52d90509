"""Option holders under Accelerate's names: ``Accelerator(kwargs_handlers=[...])`` takes the
``*Kwargs`` ones, ``Accelerator(gradient_accumulation_plugin=...)`` the accumulation plugin,
``accelerator.autocast(autocast_handler=...)`` and ``accelerator.profile(profile_handler=...)`` theirs.
The fp8 recipe handlers (``AORecipeKwargs``, ``TERecipeKwargs``, ``FP8RecipeKwargs``) convert into
the core's :class:`~anyaccel.precision_fp8.Fp8Options`. Local values, checked when built."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

from .. import lazyclass

if TYPE_CHECKING:  # both import torch; Accelerate's kwargs classes do not need it until converted
    from ..training.accumulation import AccumulationOptions
    from ..training.precision_fp8 import Fp8Options
    from ..process.process_group import ProcessGroupOptions

__all__ = ["DistributedDataParallelKwargs", "GradScalerKwargs", "InitProcessGroupKwargs", "AutocastKwargs",
           "ProfileKwargs", "GradientAccumulationPlugin", "AORecipeKwargs", "TERecipeKwargs", "FP8RecipeKwargs"]


@lazyclass.dataclass
class DistributedDataParallelKwargs:
    """Passed to ``torch.nn.parallel.DistributedDataParallel`` when a model is prepared (converted
    into the DDP strategy's :class:`~anyaccel.strategies.options.DDPOptions`, :meth:`to_options`).

    ``comm_hook`` (``DDPCommunicationHookType`` or its value: ``"fp16"``, ``"bf16"``,
    ``"power_sgd"``, ``"batched_power_sgd"``), ``comm_wrapper`` (``"fp16"``/``"bf16"``, around a
    PowerSGD hook) and ``comm_state_option`` (``PowerSGDState``'s keyword arguments) register one
    of torch's DDP communication hooks on the wrapped model, as Accelerate does. They take effect
    only where DDP wraps the model (several processes, ``strategy="ddp"``); otherwise the
    accelerator warns that the hook was not registered."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: Optional[int] = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: Any = "no"
    comm_wrapper: Any = "no"
    comm_state_option: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.to_options()  # a bad value is an error here, not when the first model is wrapped

    def to_options(self) -> Any:
        """These settings as the DDP strategy's :class:`~anyaccel.strategies.options.DDPOptions`
        (which check them: a bad value is a ``ValueError`` naming the field). Local."""
        from ..strategies.options import DDPOptions

        return DDPOptions(**dataclasses.asdict(self))

    def to_dict(self, ignore_keys: tuple = ("comm_hook", "comm_wrapper", "comm_state_option")) -> dict:
        """The fields as a dict, without ``ignore_keys`` (Accelerate's: the hook fields). Local."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ignore_keys}

    def to_kwargs(self) -> dict:
        """Only the values that differ from DDP's defaults (so deprecated names are not passed);
        the hook fields are not ``DistributedDataParallel`` arguments and are left out."""
        return self.to_options().ddp_kwargs()

    def register_comm_hook(self, model: Any) -> Any:
        """Register the hook these settings name on ``model`` (a ``DistributedDataParallel``), as
        ``prepare`` does; nothing when ``comm_hook`` is ``"no"``. Returns the PowerSGD state (or
        None). Local; every rank alike, before the first backward."""
        spec = self.to_options().comm_hook_spec()
        if spec is None:
            return None
        from ..strategies.ddp import register_comm_hook

        return register_comm_hook(model, *spec)


@lazyclass.dataclass
class GradScalerKwargs:
    """Passed to ``torch.amp.GradScaler`` under ``mixed_precision="fp16"``."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    def to_kwargs(self) -> dict:
        return dataclasses.asdict(self)


@lazyclass.dataclass
class InitProcessGroupKwargs:
    """Process-group options: ``backend`` (``"gloo"``/``"nccl"``) and ``timeout``."""

    backend: Optional[str] = None
    timeout: Optional[timedelta] = None

    def to_options(self) -> ProcessGroupOptions:
        """These settings as the core's :class:`~anyaccel.process_group.ProcessGroupOptions`. Local."""
        from ..process.process_group import ProcessGroupOptions

        return ProcessGroupOptions(backend=self.backend,
                                   timeout_s=self.timeout.total_seconds() if self.timeout else None)

    def to_kwargs(self) -> dict:
        return dataclasses.asdict(self)


@lazyclass.dataclass
class AutocastKwargs:
    """``accelerator.autocast(autocast_handler=AutocastKwargs(enabled=False))`` runs a block
    outside mixed precision; ``cache_enabled`` is passed to ``torch.autocast``. Also accepted in
    ``kwargs_handlers``: the default for every ``accelerator.autocast()`` block (the forward of
    prepared models keeps the accelerator's mixed precision)."""

    enabled: bool = True
    cache_enabled: Optional[bool] = None

    def to_kwargs(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@lazyclass.dataclass
class ProfileKwargs:
    """``torch.profiler.profile`` options for ``accelerator.profile(profile_handler=...)``
    (Accelerate's names): ``activities`` (``"cpu"``, ``"cuda"``, ...; default: the CPU and this
    process's accelerator), ``schedule_option`` (``wait``/``warmup``/``active``/``repeat``/
    ``skip_first`` for ``torch.profiler.schedule``), ``on_trace_ready``, ``record_shapes``,
    ``profile_memory``, ``with_stack``, ``with_flops``, ``with_modules``, and ``output_trace_dir``
    (the main process writes its Chrome trace there)."""

    activities: Optional[List[str]] = None
    schedule_option: Optional[dict] = None
    on_trace_ready: Optional[Callable] = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: Optional[str] = None

    def __post_init__(self) -> None:
        from ..backends import profiler_activities

        known = profiler_activities() if self.activities else ()
        for name in self.activities or ():
            if name not in known:
                raise ValueError(f"ProfileKwargs.activities contains {name!r}; choose from {', '.join(known)}")

    def build(self, device_type: str) -> Any:
        """The ``torch.profiler.profile`` object (not started). Local."""
        import torch.profiler as tp

        from ..backends import default_profiler_activities

        names = self.activities or default_profiler_activities(device_type)
        activities = [getattr(tp.ProfilerActivity, n.upper()) for n in names]
        schedule = tp.schedule(**self.schedule_option) if self.schedule_option else None
        return tp.profile(activities=activities, schedule=schedule, on_trace_ready=self.on_trace_ready,
                          record_shapes=self.record_shapes, profile_memory=self.profile_memory,
                          with_stack=self.with_stack, with_flops=self.with_flops, with_modules=self.with_modules)


@lazyclass.dataclass
class GradientAccumulationPlugin:
    """Gradient accumulation (``Accelerator(gradient_accumulation_plugin=...)``):

    * ``num_steps``: micro-batches per optimizer step (like ``gradient_accumulation_steps``).
    * ``adjust_scheduler``: accepted, and changes nothing, exactly as in Accelerate 1.15: its
      scheduler would advance ``_step_count`` on micro-steps when the flag is on, but it reads the
      flag from ``to_kwargs()``, which leaves out values equal to the default (``True``), with
      ``False`` as the fallback, so the branch never runs whatever the value. A prepared scheduler
      steps only when its optimizer steps (tested against Accelerate, both values).
    * ``sync_with_dataloader``: the last batch of a prepared loader closes the accumulation group
      (default True); False lets a group continue into the next epoch.
    * ``sync_each_batch``: all-reduce gradients on every micro-batch (no ``no_sync``: less memory
      for large models, more communication); the optimizer still steps every ``num_steps``.
    * ``divide_by_group_size`` (anyaccel's): :meth:`Accelerator.backward` divides the loss by the
      size of the current group — ``num_steps``, or fewer for a loader's short last group, so that
      every optimizer step sees the mean gradient of its batches (default True). ``False``
      divides by ``num_steps`` always, as Accelerate does.
    """

    num_steps: Optional[int] = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False
    divide_by_group_size: bool = True

    def __post_init__(self) -> None:
        if self.num_steps is not None and int(self.num_steps) < 1:
            raise ValueError(f"GradientAccumulationPlugin(num_steps={self.num_steps}): must be at least 1")

    def to_options(self) -> AccumulationOptions:
        """How to accumulate, as the core's :class:`~anyaccel.accumulation.AccumulationOptions`
        (``num_steps`` becomes ``gradient_accumulation_steps``; ``adjust_scheduler`` changes
        nothing, see above). Local."""
        from ..training.accumulation import AccumulationOptions

        return AccumulationOptions(sync_with_dataloader=bool(self.sync_with_dataloader),
                                   sync_each_batch=bool(self.sync_each_batch),
                                   divide_by_group_size=bool(self.divide_by_group_size))

    def to_kwargs(self) -> dict:
        return dataclasses.asdict(self)


def _installed(backend: str) -> None:
    """Accelerate's handlers refuse to be made without their library: ``ImportError`` saying what
    to install."""
    import importlib.util

    from ..training.precision_fp8 import INSTALL

    module = {"AO": "torchao", "TE": "transformer_engine"}[backend]
    if importlib.util.find_spec(module) is None:
        library = "torchao" if backend == "AO" else "NVIDIA Transformer Engine"
        raise ImportError(f"fp8 with {library} ({backend}): {module} is not installed; {INSTALL[backend]}")


@lazyclass.dataclass
class AORecipeKwargs:
    """fp8 through torchao under ``mixed_precision="fp8"`` (Accelerate's handler and fields):
    ``config`` (a ``torchao.float8.Float8LinearConfig``; None: the recipe's, with
    ``pad_inner_dim`` on and FSDP2's fp8 all-gather where it can be), ``module_filter_func``
    (``(module, name) -> bool``: which ``nn.Linear`` layers to convert; None: all but the first and
    last, sizes multiples of 16), ``pad_inner_dim``, ``enable_fsdp_float8_all_gather``. anyaccel's
    own: ``recipe`` (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``) and ``emulate``
    (fp8 computed in higher precision: the default where the device has no fp8 matmul, the CPU).
    Fields left None take the launcher's ``fp8_config`` settings, then the defaults
    (:mod:`anyaccel.precision_fp8`). ``ImportError`` when torchao is not installed; a bad value is a
    ``ValueError`` naming it."""

    config: Any = None
    module_filter_func: Optional[Callable] = None
    pad_inner_dim: Optional[bool] = None
    enable_fsdp_float8_all_gather: Optional[bool] = None
    recipe: Optional[str] = None
    emulate: Optional[bool] = None

    def __post_init__(self) -> None:
        _installed("AO")
        self.to_options()  # a bad value is an error here

    def to_options(self, launcher: Optional[Fp8Options] = None) -> Fp8Options:
        """These settings as the core's :class:`~anyaccel.precision_fp8.Fp8Options`; fields left
        None take ``launcher``'s (the launcher's fp8 settings). Local."""
        from ..training.precision_fp8 import Fp8Options

        told = launcher or Fp8Options()
        pick = lambda mine, theirs: theirs if mine is None else mine  # noqa: E731
        recipe = pick(self.recipe, told.recipe if self.config is None else None)
        return Fp8Options(backend="AO", config=self.config, module_filter=self.module_filter_func, recipe=recipe,
                          emulate=pick(self.emulate, told.emulate), pad_inner_dim=pick(self.pad_inner_dim, told.pad_inner_dim),
                          fsdp_float8_all_gather=pick(self.enable_fsdp_float8_all_gather, told.fsdp_float8_all_gather))

    def to_kwargs(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


#: TERecipeKwargs' fields checked by the option table's rows (the launcher's --fp8_* flags)
_TE_ROWS = {"fp8_format": "fp8_format", "amax_compute_algo": "fp8_amax_compute_algo", "margin": "fp8_margin",
            "interval": "fp8_interval", "amax_history_len": "fp8_amax_history_len"}


@lazyclass.dataclass
class TERecipeKwargs:
    """fp8 through NVIDIA Transformer Engine under ``mixed_precision="fp8"`` (CUDA only;
    Accelerate's handler and fields: ``use_autocast_during_eval``, ``margin``, ``interval``,
    ``fp8_format`` (``HYBRID``, ``E4M3``, ``E5M2``), ``amax_history_len``, ``amax_compute_algo``
    (``max``, ``most_recent``), ``override_linear_precision`` (three booleans: fprop, dgrad,
    wgrad), ``use_mxfp8_block_scaling`` (refused: MXFP8 is not implemented)). Fields left None take
    the launcher's ``fp8_config`` settings, then Transformer Engine's defaults
    (:mod:`anyaccel.precision_te`). ``ImportError`` when Transformer Engine is not installed."""

    use_autocast_during_eval: Optional[bool] = None
    margin: Optional[int] = None
    interval: Optional[int] = None
    fp8_format: Optional[str] = None
    amax_history_len: Optional[int] = None
    amax_compute_algo: Optional[str] = None
    override_linear_precision: Optional[tuple] = None
    use_mxfp8_block_scaling: Optional[bool] = None

    def __post_init__(self) -> None:
        self._check()
        _installed("TE")

    def _check(self) -> None:
        from .. import optionspec

        for name, row in _TE_ROWS.items():
            if getattr(self, name) is not None:
                setattr(self, name, optionspec.check(optionspec.option(row), getattr(self, name),
                                                     f"{type(self).__name__}({name})"))
        if self.use_mxfp8_block_scaling:
            raise ValueError(f"{type(self).__name__}(use_mxfp8_block_scaling=True): MXFP8 block scaling (Blackwell GPUs) "
                             "is not implemented in anyaccel; leave it unset (delayed scaling)")
        flags = self.override_linear_precision
        if flags is not None and (len(tuple(flags)) != 3 or not all(isinstance(f, bool) for f in flags)):
            raise ValueError(f"{type(self).__name__}(override_linear_precision={flags!r}): three booleans (fprop, "
                             "dgrad, wgrad)")

    def _te_fields(self) -> Dict[str, Any]:
        names = ("use_autocast_during_eval", "margin", "interval", "fp8_format", "amax_history_len", "amax_compute_algo",
                 "override_linear_precision")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def to_options(self, launcher: Optional[Fp8Options] = None) -> Fp8Options:
        """These settings as the core's :class:`~anyaccel.precision_fp8.Fp8Options` (backend TE);
        fields left None take ``launcher``'s Transformer Engine settings. Local."""
        from ..training.precision_fp8 import Fp8Options

        te = dict(launcher.te) if launcher is not None else {}
        te.update(self._te_fields())
        return Fp8Options(backend="TE", te=te)

    def to_kwargs(self) -> dict:
        return self._te_fields()


@lazyclass.dataclass
class FP8RecipeKwargs(TERecipeKwargs):
    """Accelerate's deprecated fp8 handler (a ``FutureWarning`` says so, as Accelerate's does):
    ``backend`` (None: the launcher's ``--fp8_backend``, else ``"TE"``, as Accelerate)
    ``"TE"`` with :class:`TERecipeKwargs`' fields; ``"AO"`` (torchao,
    accepted here beyond Accelerate 1.15, which allows only MSAMP and TE) with none of them;
    ``"MSAMP"`` is refused (MS-AMP is deprecated upstream); ``opt_level`` is MS-AMP's (refused when
    set). Prefer :class:`AORecipeKwargs` or :class:`TERecipeKwargs`."""

    opt_level: Optional[str] = None
    backend: Optional[str] = None

    def __post_init__(self) -> None:
        import warnings

        warnings.warn("FP8RecipeKwargs is deprecated (as in Accelerate); use AORecipeKwargs (torchao) or "
                      "TERecipeKwargs (Transformer Engine)", FutureWarning, stacklevel=3)
        from .. import optionspec

        if self.opt_level is not None:
            raise ValueError(f"FP8RecipeKwargs(opt_level={self.opt_level!r}) is MS-AMP's setting; MS-AMP is not available "
                             "(deprecated upstream): use backend 'AO' or 'TE'")
        if self.backend is not None:
            self.backend = optionspec.check(optionspec.option("fp8_backend"), self.backend, "FP8RecipeKwargs(backend)")
        else:  # Accelerate's rule: the launcher's backend, else Transformer Engine
            from ..envvars import worker_settings

            self.backend = worker_settings().fp8_backend or "TE"
        self._check()
        if self.backend == "AO" and self._te_fields():
            raise ValueError(f"FP8RecipeKwargs(backend='AO'): {', '.join(self._te_fields())} are Transformer Engine's "
                             "settings; drop them, or use backend 'TE'")
        _installed(self.backend)

    def to_options(self, launcher: Optional[Fp8Options] = None) -> Fp8Options:
        """The core's :class:`~anyaccel.precision_fp8.Fp8Options` of ``backend`` (TE's fields for TE;
        torchao's defaults and the launcher's torchao settings for AO). Local."""
        if self.backend == "AO":
            return _ao_defaults(launcher)
        return super().to_options(launcher)


def _ao_defaults(launcher: Optional[Fp8Options]) -> Fp8Options:
    """torchao with the launcher's torchao settings (``FP8RecipeKwargs(backend="AO")``)."""
    from ..training.precision_fp8 import Fp8Options

    told = launcher or Fp8Options()
    return Fp8Options(backend="AO", recipe=told.recipe, emulate=told.emulate, pad_inner_dim=told.pad_inner_dim,
                      fsdp_float8_all_gather=told.fsdp_float8_all_gather)
