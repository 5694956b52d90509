"""DistributedDataParallel: every process holds the whole model; gradients are averaged in backward."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, Iterator, Optional, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from ..doctor.tracker import FORWARD_BUFFERS, end_forward_wait, mark_forward_sync
from ..process import process_group
from ..environment import DistributedType
from .base import Strategy
from .capabilities import BackwardSyncControl, UnevenInputs
from .options import DDPOptions

__all__ = ["DDPStrategy", "register_comm_hook", "forward_is_collective", "mark_buffer_broadcasts"]


class DDPStrategy(Strategy, UnevenInputs, BackwardSyncControl):
    """``DistributedDataParallel`` over the default group, with :class:`~.options.DDPOptions`
    (Accelerate's :class:`~anyaccel.kwargs.DistributedDataParallelKwargs` converts into them).
    Wrapping broadcasts rank 0's weights (collective) and registers the communication hook the
    options name (:func:`register_comm_hook`); accumulation micro-steps run under ``no_sync``;
    uneven inputs are joined with ``torch.distributed.algorithms.join.Join`` (:class:`~.capabilities.UnevenInputs`)
    and a sync can be forced in one backward (:class:`~.capabilities.BackwardSyncControl`)."""

    name = "ddp"
    options_type = DDPOptions
    options: DDPOptions

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if isinstance(model, DistributedDataParallel):
            return model
        kwargs = self.options.ddp_kwargs()
        device = self.backend.device
        if device is not None and device.index is not None:  # a single-device module on an accelerator
            kwargs.setdefault("device_ids", [device.index])
            kwargs.setdefault("output_device", device.index)
        wrapped = DistributedDataParallel(model, **kwargs)
        process_group.track_ddp(wrapped)
        mark_buffer_broadcasts(wrapped)
        spec = self.options.comm_hook_spec()
        if spec is not None:
            register_comm_hook(wrapped, *spec)
        return wrapped

    def sync_context(self, models: Sequence[torch.nn.Module], sync: bool) -> Any:
        if sync:
            return super().sync_context(models, sync)
        wrapped = [m for m in models if isinstance(m, DistributedDataParallel)]
        if len(wrapped) == 1:
            return wrapped[0].no_sync()
        return _all_no_sync(wrapped)

    def join_uneven_inputs(self, joinables: Sequence[Any]) -> Optional[ContextManager[Any]]:
        """``Join`` over ``joinables`` (prepared DDP models; ``ZeroRedundancyOptimizer`` too) in a
        multi-process job over a torch.distributed group (CPU/gloo as GPUs); None otherwise."""
        if self.env.world_size <= 1 or self.env.distributed_type not in (DistributedType.MULTI_CPU,
                                                                         DistributedType.MULTI_GPU):
            return None
        from torch.distributed.algorithms.join import Join

        return Join(list(joinables))

    def sync_in_backward(self, model: torch.nn.Module) -> ContextManager[Any]:
        """Arms DDP's reducer as its forward would have outside ``no_sync``, so the next backward
        all-reduces; a null context for a model DDP does not wrap (prepared for evaluation)."""
        if not isinstance(model, DistributedDataParallel):
            return contextlib.nullcontext()
        return _sync_in_backward(model)


def mark_buffer_broadcasts(wrapped: DistributedDataParallel) -> None:
    """Mark the collective start of ``wrapped``'s forwards for the hang doctor (and a save_state or
    load_state on the main process alone, which must see a rank blocked in one): from the
    wrapper's pre-forward (:func:`forward_is_collective`) until the wrapped module's forward starts
    (DDP has broadcast then), not over the model's own compute. The user's module gets no hook
    (``unwrap_model`` returns it as it was): DDP's ``_run_ddp_forward`` of this wrapper is wrapped
    (where a torch lacks it, the whole forward stays marked).

    Only where a forward can wait for the others: a model with buffers is marked now (whether DDP
    broadcasts them, ``broadcast_buffers``, a script may change later: asked at each forward); any
    other model's forward waits only inside ``Join`` (uneven inputs), so it is marked when a
    ``Join`` takes it in (``join_hook``, which torch's ``Join`` calls for each of its joinables:
    :meth:`DDPStrategy.join_uneven_inputs` and a script's own ``Join`` alike). A model without
    buffers outside ``Join`` gets no hook: its forward keeps torch's hook-free path (the
    marks cost ~30 Python calls per step). Local."""
    if getattr(wrapped, "_use_python_reducer", False) or getattr(wrapped, "_delay_all_reduce_all_params", False):
        return  # DDP's forward returns before the broadcast and Join's notice: never a wait
    if getattr(wrapped, "modules_buffers", True):  # DDP's list of buffers never grows from empty
        _mark_forward_waits(wrapped)
        return
    if getattr(wrapped, "_anyaccel_forward_marked", False) or "join_hook" in vars(wrapped):
        return
    join_hook = wrapped.join_hook

    def mark_then_join_hook(**kwargs: Any) -> Any:
        _mark_forward_waits(wrapped)
        vars(wrapped).pop("join_hook", None)  # marked once; DDP's own join_hook from now on
        return join_hook(**kwargs)

    wrapped.join_hook = mark_then_join_hook  # type: ignore[method-assign]  # (this wrapper only)


def _mark_forward_waits(wrapped: DistributedDataParallel) -> None:
    mark_forward_sync(wrapped, FORWARD_BUFFERS, forward_is_collective)
    run = getattr(wrapped, "_run_ddp_forward", None)
    if run is None or getattr(run, "_anyaccel_ends_wait", False):
        return

    def run_after_broadcast(*inputs: Any, **kwargs: Any) -> Any:
        end_forward_wait()
        return run(*inputs, **kwargs)

    run_after_broadcast._anyaccel_ends_wait = True  # type: ignore[attr-defined]
    wrapped._run_ddp_forward = run_after_broadcast  # type: ignore[method-assign]  # (this wrapper only)


def forward_is_collective(model: DistributedDataParallel) -> bool:
    """Whether DDP's next forward of ``model`` waits for every rank: it broadcasts the buffers
    from rank 0 first (``broadcast_buffers`` and a model with buffers — BatchNorm's statistics, a
    registered buffer — after a forward that prepared a synchronising backward) or runs inside
    ``Join``. Asked just before the forward (DDP reads the same flags there). Local."""
    if getattr(model, "_use_python_reducer", False) or getattr(model, "_delay_all_reduce_all_params", False):
        return False  # (DDP's forward returns before either)
    joining = bool(getattr(getattr(model, "_join_config", None), "enable", False))
    return joining or bool(model.will_sync_module_buffers())


@contextlib.contextmanager
def _sync_in_backward(model: DistributedDataParallel) -> Iterator[None]:
    old = model.require_backward_grad_sync, model.require_forward_param_sync
    model.require_backward_grad_sync = model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([])  # arm the reducer as DDP's forward would have
    try:
        yield
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = old


class _all_no_sync:
    """``no_sync`` of several DDP models at once (a plain class: cheap per micro-step)."""

    __slots__ = ("_models", "_stack")

    def __init__(self, models):
        self._models = models
        self._stack = None

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        for model in self._models:
            self._stack.enter_context(model.no_sync())
        return self

    def __exit__(self, *exc):
        stack, self._stack = self._stack, None
        return stack.__exit__(*exc)


def register_comm_hook(model: DistributedDataParallel, hook: str, wrapper: str = "no",
                       state_options: Optional[Dict[str, Any]] = None) -> Any:
    """Register torch's DDP communication hook ``hook`` (Accelerate's ``DDPCommunicationHookType``
    values: ``"fp16"``, ``"bf16"``, ``"power_sgd"``, ``"batched_power_sgd"``) on ``model``,
    wrapped by ``wrapper`` (``"fp16"``/``"bf16"``: compress what the hook sends), as Accelerate's
    ``DistributedDataParallelKwargs.register_comm_hook`` does. PowerSGD hooks get a
    ``PowerSGDState`` over the model's process group built from ``state_options``; returns that
    state (None for the fp16/bf16 hooks, which have none). Local: call it on every rank alike
    before the first backward (the hook's all-reduces are collective)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook,
             "power_sgd": powerSGD_hook.powerSGD_hook, "batched_power_sgd": powerSGD_hook.batched_powerSGD_hook}
    wrappers = {"fp16": default_hooks.fp16_compress_wrapper, "bf16": default_hooks.bf16_compress_wrapper}
    if hook not in hooks:
        raise ValueError(f"comm_hook={hook!r}; choose one of {', '.join(hooks)}")
    if wrapper not in ("no", *wrappers):
        raise ValueError(f"comm_wrapper={wrapper!r}; choose no, {', '.join(wrappers)}")
    if hook == "batched_power_sgd" and not _batched_power_sgd_works():
        raise ValueError("DistributedDataParallelKwargs(comm_hook='batched_power_sgd'): this torch's "
                         f"batched_powerSGD_hook ({torch.__version__}) fails with an AssertionError at its first "
                         "compressed step (iteration start_powerSGD_iter, 1000 by default: it passes one matrix where "
                         "torch's _orthogonalize takes a batch), so it would only ever all-reduce uncompressed, then "
                         "stop the job; use comm_hook='power_sgd' (PowerSGD per layer, which works)")
    fn = hooks[hook]
    if wrapper != "no":
        fn = wrappers[wrapper](fn)
    state = None
    if hook in ("power_sgd", "batched_power_sgd"):
        state = powerSGD_hook.PowerSGDState(process_group=model.process_group, **(state_options or {}))
    try:
        model.register_comm_hook(state=state, hook=fn)
    except TypeError as exc:  # torch refuses bf16 compression without CUDA 11 + NCCL 2.10 (or XPU)
        if "bf16" not in (hook, wrapper):
            raise
        raise ValueError(f"DistributedDataParallelKwargs(comm_hook={hook!r}, comm_wrapper={wrapper!r}): torch refuses "
                         f"bf16 gradient compression here ({exc}); use 'fp16', which works on every backend, or "
                         "leave the hook out") from None
    return state


def _batched_power_sgd_works() -> bool:
    """False when torch's ``batched_powerSGD_hook`` has the bug seen in torch 2.13: it passes a 2-D
    matrix to ``_orthogonalize``, which accepts only batches (3-D) since pytorch#75157, so its
    first compressed step raises. Checked on the installed torch, so a fixed torch is used as is."""
    import inspect

    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    try:
        powerSGD_hook._orthogonalize(torch.ones(2, 1))
        return True
    except AssertionError:
        pass
    except Exception:  # noqa: BLE001 - torch changed its internals: trust the hook
        return True
    try:
        source = inspect.getsource(powerSGD_hook.batched_powerSGD_hook)
    except (OSError, TypeError):
        return True
    return "_orthogonalize(state.q_memory_dict[bucket_index])" not in source
