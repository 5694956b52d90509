"""Warnings for Accelerate arguments that big-model functions accept and that take no effect in
anyaccel (the house rule: an argument is never silently ignored). Each warns once per process.
Local."""

from __future__ import annotations

import warnings
from typing import Set, Tuple

__all__ = ["no_effect"]

_WARNED: Set[Tuple[str, str]] = set()

_WHY = {
    "offload_state_dict": "loading always reads one tensor at a time, so the state dict is never held whole in "
                          "memory and there is nothing to offload",
    "preload_module_classes": "each module brings its own weights to its execution device before its forward; a "
                              "module that reads a submodule's weights without calling it is not supported",
    "full_state_dict": "a sharded model is filled slice by slice from the checkpoint (each process reads what its "
                       "shards hold), never through a gathered or a sharded state dict, so there is no choice to make",
    "offload_buffers": "the map places buffers with their module; whether offloaded modules keep their buffers in "
                       "memory is decided when the weights are loaded (load_checkpoint_in_model / "
                       "load_checkpoint_and_dispatch take offload_buffers)",
    "fallback_allocation": "the map fills the devices in order; anyaccel does not search for a smaller block to "
                           "keep a device that the next block does not fit used",
}


def no_effect(function: str, argument: str) -> None:
    """Warn (once per process for this function and argument) that ``argument`` of ``function``
    was given a non-default value and takes no effect, and why. Local."""
    if (function, argument) in _WARNED:
        return
    _WARNED.add((function, argument))
    warnings.warn(f"{function}({argument}=...) has no effect in anyaccel: {_WHY[argument]}; the argument is "
                  "accepted for Accelerate compatibility and ignored", UserWarning, stacklevel=3)
