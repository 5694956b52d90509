"""``anyaccel.hooks``: Accelerate's ``accelerate.hooks`` module path (forward hooks that move
weights and inputs where a dispatched model needs them). Re-exports from their one home,
:mod:`anyaccel.big_modeling.forward_hooks`. Local."""

from .big_modeling.forward_hooks import (AlignDevicesHook, ModelHook, SequentialHook, add_hook_to_module,  # noqa: F401
                                 remove_hook_from_module, remove_hook_from_submodules)

__all__ = ["AlignDevicesHook", "ModelHook", "SequentialHook", "add_hook_to_module", "remove_hook_from_module",
           "remove_hook_from_submodules"]
