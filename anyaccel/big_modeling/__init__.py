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
"""

from .checkpoints import CheckpointReader, open_checkpoint
from .dispatch import check_device_map, cpu_offload, disk_offload, dispatch_model, load_checkpoint_and_dispatch
from .empty_init import init_empty_weights, init_on_device
from .hooks import (AlignDevicesHook, ModelHook, SequentialHook, add_hook_to_module, remove_hook_from_module,
                    remove_hook_from_submodules)
from .loading import load_checkpoint_in_model
from .offload import (OffloadedWeightsLoader, PrefixedDataset, extract_submodules_state_dict, load_offloaded_weight,
                      offload_state_dict, offload_weight, save_offload_index)
from .placement import find_device, named_module_tensors, set_module_tensor_to_device
from .sizes import (clean_device_map, compute_module_sizes, convert_file_size_to_int, dtype_byte_size,
                    get_balanced_memory, get_max_layer_size, get_max_memory, infer_auto_device_map)

__all__ = [
    "init_empty_weights", "init_on_device", "load_checkpoint_in_model", "load_checkpoint_and_dispatch",
    "dispatch_model", "cpu_offload", "disk_offload", "check_device_map", "infer_auto_device_map",
    "get_balanced_memory", "get_max_memory", "get_max_layer_size", "compute_module_sizes", "clean_device_map",
    "convert_file_size_to_int", "dtype_byte_size", "set_module_tensor_to_device", "named_module_tensors",
    "find_device", "ModelHook", "SequentialHook", "AlignDevicesHook", "add_hook_to_module", "remove_hook_from_module",
    "remove_hook_from_submodules", "OffloadedWeightsLoader", "PrefixedDataset", "offload_state_dict",
    "offload_weight", "load_offloaded_weight", "save_offload_index", "extract_submodules_state_dict",
    "CheckpointReader", "open_checkpoint",
]
