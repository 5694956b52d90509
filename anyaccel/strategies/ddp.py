"""DistributedDataParallel: every process holds the whole model; gradients are averaged in backward."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, Iterator, Optional, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from .. import process_group
from ..environment import DistributedType
from .base import Strategy
from .options import DDPOptions

__all__ = ["DDPStrategy", "register_comm_hook"]


class DDPStrategy(Strategy):
    """``DistributedDataParallel`` over the default group, with :class:`~.options.DDPOptions`
    (Accelerate's :class:`~anyaccel.kwargs.DistributedDataParallelKwargs` converts into them).
    Wrapping broadcasts rank 0's weights (collective) and registers the communication hook the
    options name (:func:`register_comm_hook`); accumulation micro-steps run under ``no_sync``;
    uneven inputs are joined with ``torch.distributed.algorithms.join.Join``."""

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
            return super().sync_in_backward(model)
        return _sync_in_backward(model)


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
    fn = hooks[hook]
    if wrapper != "no":
        fn = wrappers[wrapper](fn)
    state = None
    if hook in ("power_sgd", "batched_power_sgd"):
        state = powerSGD_hook.PowerSGDState(process_group=model.process_group, **(state_options or {}))
    model.register_comm_hook(state=state, hook=fn)
    return state
