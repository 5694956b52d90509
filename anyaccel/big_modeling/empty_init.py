"""Build a model without allocating its weights: ``init_empty_weights`` / ``init_on_device``.

Accelerate's semantics: parameters created inside the context are moved to ``device`` (``meta``
for ``init_empty_weights``) as they are registered; buffers stay where they are created unless
``include_buffers=True`` (then every tensor constructor makes them on ``device``).

A parameter already on ``device`` when it is registered is kept as it is (Accelerate wraps it in
a new Parameter): a tie made by assignment inside the context (``self.head.weight =
self.embed.weight``, transformers' ``tie_weights``) stays one parameter.

One addition: the CPU random-number state at the moment the context is entered is recorded on
every module that registers a meta parameter. Building on meta consumes no random numbers, so
that state is the one an eager build would have started from; :mod:`.sharded_load` replays each
module's initialisation from it after sharding, which makes a meta model prepared under FSDP2
equal, bit for bit, to the same model built eagerly after the same ``set_seed``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch
from torch import nn

__all__ = ["init_empty_weights", "init_on_device", "INIT_RNG_ATTR"]

# Attribute set on modules built on meta: the CPU RNG state (a uint8 tensor) when the build began.
INIT_RNG_ATTR = "_anyaccel_init_rng"


def _include_buffers_default() -> bool:
    return os.environ.get("ACCELERATE_INIT_INCLUDE_BUFFERS", "").strip().lower() in ("1", "true", "yes", "on")


@contextlib.contextmanager
def init_empty_weights(include_buffers: Optional[bool] = None) -> Iterator[None]:
    """Parameters created inside are on the meta device (no memory). Buffers too with
    ``include_buffers=True`` (default: ``ACCELERATE_INIT_INCLUDE_BUFFERS``, else False). Local.

    Materialise the model afterwards with ``Accelerator.prepare`` under FSDP2 (each process
    allocates and initialises only its shards), ``load_checkpoint_and_dispatch`` or
    ``model.to_empty(device=...)`` followed by your own initialisation."""
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield


@contextlib.contextmanager
def init_on_device(device: torch.device, include_buffers: Optional[bool] = None) -> Iterator[None]:
    """Parameters created inside are placed on ``device`` as they are registered (buffers too
    with ``include_buffers=True``). Local."""
    if include_buffers is None:
        include_buffers = _include_buffers_default()
    device = torch.device(device)
    rng = torch.random.get_rng_state() if device.type == "meta" else None
    old_register_parameter = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        old_register_parameter(module, name, param)
        if param is None:
            return
        current = module._parameters[name]
        if not include_buffers and current.device != device:  # else the device context already placed it
            kwargs = dict(current.__dict__)
            kwargs["requires_grad"] = param.requires_grad
            hf_flag = kwargs.pop("_is_hf_initialized", None)
            module._parameters[name] = type(current)(current.to(device), **kwargs)
            if hf_flag is not None:
                module._parameters[name]._is_hf_initialized = hf_flag
        if rng is not None:
            module.__dict__[INIT_RNG_ATTR] = rng

    try:
        nn.Module.register_parameter = register_parameter
        if include_buffers:
            with device:
                yield
        else:
            yield
    finally:
        nn.Module.register_parameter = old_register_parameter
