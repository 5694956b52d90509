"""``anyaccel.utils.modeling``: Accelerate's model-size, device-map and checkpoint-dispatch names.

Re-exports from :mod:`anyaccel.big_modeling` (their one home); the few Accelerate helpers that
anyaccel does not offer yet are importable, and raise ``NotImplementedError`` when used, saying
what to do instead."""

from __future__ import annotations

from typing import Any

from ...big_modeling.checkpoints import CheckpointReader, open_checkpoint  # noqa: F401
from ...big_modeling.dispatch import (check_device_map, cpu_offload, disk_offload, dispatch_model,  # noqa: F401
                                     load_checkpoint_and_dispatch)
from ...big_modeling.empty_init import init_empty_weights, init_on_device  # noqa: F401
from ...big_modeling.loading import load_checkpoint_in_model  # noqa: F401
from ...big_modeling.placement import find_device, named_module_tensors, set_module_tensor_to_device  # noqa: F401
from ...big_modeling.sizes import (clean_device_map, compute_module_sizes, convert_file_size_to_int,  # noqa: F401
                                  dtype_byte_size, get_balanced_memory, get_max_layer_size, get_max_memory,
                                  infer_auto_device_map)
from ._refuse import refused_names

_OFFERED = ["init_empty_weights", "init_on_device", "load_checkpoint_and_dispatch", "dispatch_model", "cpu_offload",
            "disk_offload", "check_device_map", "clean_device_map", "compute_module_sizes",
            "convert_file_size_to_int", "dtype_byte_size", "find_device", "get_balanced_memory", "get_max_layer_size",
            "get_max_memory", "infer_auto_device_map", "load_checkpoint_in_model", "named_module_tensors",
            "set_module_tensor_to_device"]
#: Accelerate helpers around tied parameters, offloaded-parameter inspection and hooks with
#: callbacks that anyaccel's big-model support does not offer (yet).
_NOT_YET = ["cpu_offload_with_hook", "align_module_device", "calculate_maximum_sizes",
            "check_tied_parameters_in_config", "check_tied_parameters_on_same_device", "find_tied_parameters",
            "has_offloaded_params", "id_tensor_storage", "load_offloaded_weights", "load_state_dict",
            "retie_parameters"]
_AMP = ["get_grad_scaler", "get_mixed_precision_context_manager"]
__all__ = _OFFERED + _NOT_YET + _AMP + ["is_peft_model"]

globals().update(refused_names("big_model", _NOT_YET))
globals().update(refused_names("amp", _AMP))


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a PEFT ``PeftModel`` (False when peft is not installed). Local."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)
