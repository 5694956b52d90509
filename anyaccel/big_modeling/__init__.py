"""Big models: build without memory, shard before filling, load without a full copy per process,
and run models larger than memory with layers on devices, in host memory and on disk.

Accelerate's names and semantics. One idea per module:

* :mod:`.empty_init` — ``init_empty_weights`` / ``init_on_device``;
* :mod:`.checkpoints` — reading any checkpoint layout one tensor or one slice at a time;
* :mod:`.sharded_load` — meta → FSDP2 shards → filled from the model's init or a checkpoint;
* :mod:`.loading` — ``load_checkpoint_in_model``;
* :mod:`.placement` — ``set_module_tensor_to_device``;
* :mod:`.sizes` — ``compute_module_sizes``, ``get_balanced_memory``, ``infer_auto_device_map``;
* :mod:`.hooks` — ``add_hook_to_module``, ``AlignDevicesHook``;
* :mod:`.offload` — the disk offload folder (Accelerate's format);
* :mod:`.dispatch` — ``dispatch_model``, ``cpu_offload``, ``disk_offload``, ``load_checkpoint_and_dispatch``;
* :mod:`.estimate` and :mod:`.merge` — ``anyaccel estimate-memory`` and ``anyaccel merge-weights``.

The package imports its modules on first use (PEP 562), so ``anyaccel``'s command line can register
``estimate-memory`` and ``merge-weights`` (:mod:`.commands`) without importing torch.
"""

import importlib
from typing import Any

_HOME = {
    "CheckpointReader": "checkpoints",
    "open_checkpoint": "checkpoints",
    "check_device_map": "dispatch",
    "cpu_offload": "dispatch",
    "disk_offload": "dispatch",
    "dispatch_model": "dispatch",
    "load_checkpoint_and_dispatch": "dispatch",
    "init_empty_weights": "empty_init",
    "init_on_device": "empty_init",
    "AlignDevicesHook": "forward_hooks",
    "ModelHook": "forward_hooks",
    "SequentialHook": "forward_hooks",
    "add_hook_to_module": "forward_hooks",
    "remove_hook_from_module": "forward_hooks",
    "remove_hook_from_submodules": "forward_hooks",
    "load_checkpoint_in_model": "loading",
    "OffloadedWeightsLoader": "offload",
    "PrefixedDataset": "offload",
    "extract_submodules_state_dict": "offload",
    "load_offloaded_weight": "offload",
    "offload_state_dict": "offload",
    "offload_weight": "offload",
    "save_offload_index": "offload",
    "find_device": "placement",
    "named_module_tensors": "placement",
    "set_module_tensor_to_device": "placement",
    "clean_device_map": "sizes",
    "compute_module_sizes": "sizes",
    "convert_file_size_to_int": "sizes",
    "dtype_byte_size": "sizes",
    "get_balanced_memory": "sizes",
    "get_max_layer_size": "sizes",
    "get_max_memory": "sizes",
    "infer_auto_device_map": "sizes",
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name in _HOME:
        value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(_HOME))
