"""What stands for a DeepSpeed engine in the training loop, and the engine's knobs the strategy
turns (:mod:`.deepspeed` drives them).

* :class:`EngineOptimizer` — the optimizer a prepared ``AcceleratedOptimizer`` wraps: ``step()`` is
  ``engine.step()`` (through the strategy, which applies ``clip_grad_norm_``'s threshold), its param
  groups and state the engine optimizer's, so a torch LR scheduler keeps working.
* :class:`EngineScheduler` — a scheduler the engine steps itself (a ``DummyScheduler``'s).
* :func:`set_clip` / :func:`global_grad_norm` — where DeepSpeed reads its clipping threshold, and
  the norm of the coming step's gradients (ZeRO's own norm over its partitions).
* :func:`zero3_init_hook` — transformers' ZeRO-3 hook for ``zero3_init_flag``.
* :func:`cpu_optimizer_for` — DeepSpeed's CPU optimizer for optimizer offload.

Local except where a docstring says collective.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Optional

import torch

from .config import DeepSpeedOptions

__all__ = ["EngineOptimizer", "EngineScheduler", "set_clip", "global_grad_norm", "zero3_init_hook",
           "cpu_optimizer_for"]


def cpu_optimizer_for(optimizer: torch.optim.Optimizer) -> Any:
    """DeepSpeed's CPU optimizer over ``optimizer``'s param groups (Accelerate's
    ``map_pytorch_optim_to_deepspeed``): ``DeepSpeedCPUAdam`` (``adamw_mode`` for ``AdamW``), or
    ``DeepSpeedCPUAdagrad`` for ``Adagrad``; ``lr`` and ``weight_decay`` carried over. Local."""
    defaults = {k: v for k, v in optimizer.defaults.items() if k in ("lr", "weight_decay")}
    if isinstance(optimizer, torch.optim.Adagrad):
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

        return DeepSpeedCPUAdagrad(optimizer.param_groups, **defaults)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(optimizer.param_groups, adamw_mode=isinstance(optimizer, torch.optim.AdamW), **defaults)


class EngineOptimizer(torch.optim.Optimizer):
    """The optimizer a DeepSpeed engine steps, with torch's API: ``step()`` is ``engine.step()``,
    ``zero_grad()`` nothing (the engine zeroes after its step), the param groups and state are the
    engine optimizer's (a torch scheduler changes their learning rate as usual)."""

    def __init__(self, strategy: Any):
        # Deliberately no super().__init__: the engine's optimizer owns params and state.
        self._strategy = strategy
        self.engine = strategy.engine

    @property
    def optimizer(self) -> Any:
        return self.engine.optimizer

    @property
    def param_groups(self) -> Any:  # type: ignore[override]
        return self.engine.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return getattr(self.engine.optimizer, "state", {})

    @property
    def defaults(self) -> Any:  # type: ignore[override]
        return getattr(self.engine.optimizer, "defaults", {})

    @property
    def step_was_skipped(self) -> bool:
        """True when DeepSpeed skipped the last step (fp16 overflow)."""
        return not self.engine.was_step_applied()

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        if closure is not None:
            raise ValueError("optimizer.step(closure) is not supported under DeepSpeed")
        self._strategy.engine_step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # engine.step() zeroes the gradients

    def state_dict(self) -> Dict[str, Any]:
        """This process's partition of DeepSpeed's optimizer state (``save_state`` stores the whole)."""
        state: Dict[str, Any] = self.engine.optimizer.state_dict()
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        raise NotImplementedError("load a DeepSpeed optimizer with accelerator.load_state(): its state is partitioned "
                                  "over the processes")

    def __repr__(self) -> str:
        return f"DeepSpeedEngineOptimizer({type(self.engine.optimizer).__name__})"


class EngineScheduler:
    """A scheduler DeepSpeed's engine steps itself: ``step()`` does nothing more."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.scheduler = engine.lr_scheduler
        self.optimizer = engine.optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass  # engine.step() steps it

    def get_last_lr(self) -> Any:
        """The learning rates the engine's optimizer has now (right after a load too)."""
        return self.engine.get_lr()

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)


def set_clip(engine: Any, value: float) -> None:
    """Where DeepSpeed reads its clipping threshold during ``step``: the ZeRO/bf16 optimizer's
    ``clip_grad``, else the engine's config (stage 0 in fp32)."""
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = value
    engine._config.gradient_clipping = value


def global_grad_norm(engine: Any) -> torch.Tensor:
    """The L2 norm of the (reduced, unscaled) gradients of the coming step, the same on every
    rank. Collective."""
    optimizer = engine.optimizer
    if engine.zero_optimization_stage() == 3:
        from deepspeed.runtime.zero.stage3 import combine_grad_norm_groups

        scaled = combine_grad_norm_groups(optimizer._get_norm_groups())
    elif engine.zero_optimization_stage() in (1, 2):
        scaled = optimizer.scaled_global_norm()
    else:
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads).detach()
    scale = getattr(optimizer, "loss_scale", 1.0) or 1.0
    return (torch.as_tensor(scaled, dtype=torch.float32) / scale).detach()


def zero3_init_hook(options: DeepSpeedOptions, mixed_precision: str) -> Any:
    """transformers' ``HfDeepSpeedConfig`` for ZeRO-3, kept alive by the strategy: while it lives,
    ``from_pretrained``/``from_config`` build models under ``deepspeed.zero.Init`` (partitioned as
    they are made). The config's remaining ``"auto"`` values are dropped (DeepSpeed's defaults),
    as Accelerate does. Local."""
    from .config import auto_keys, precision_sections

    try:
        from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config
    except ImportError as exc:
        raise ImportError("zero3_init_flag builds transformers models partitioned and needs transformers installed "
                          f"({exc}); build other models inside deepspeed.zero.Init() yourself") from exc
    config = options.config_dict()
    precision_sections(config, mixed_precision)
    for key in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu"):
        if config.get(key, "auto") == "auto":
            config[key] = 1
    if config.get("train_batch_size") == "auto":
        del config["train_batch_size"]
    for key in auto_keys(config):
        *parents, last = key.split(".")
        node = config
        for part in parents:
            node = node[part]
        del node[last]
    unset_hf_deepspeed_config()
    return HfDeepSpeedConfig(copy.deepcopy(config))
