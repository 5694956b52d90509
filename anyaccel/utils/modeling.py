"""``anyaccel.utils.modeling``: Accelerate's model-size, device-map and checkpoint-dispatch
names — pending: big-model support (issue 23). Importable, so that a migrated script starts;
using them raises ``NotImplementedError`` saying how to fit a large model today (FSDP2)."""

from __future__ import annotations

from typing import Any

from ._refuse import refused_names

_BIG_MODEL = [
    # big_modeling's names (Accelerate re-exports them from accelerate.utils and the top level)
    "init_empty_weights", "init_on_device", "load_checkpoint_and_dispatch", "dispatch_model", "cpu_offload",
    "cpu_offload_with_hook", "disk_offload",
    # accelerate.utils.modeling
    "align_module_device", "calculate_maximum_sizes", "check_device_map", "check_tied_parameters_in_config",
    "check_tied_parameters_on_same_device", "compute_module_sizes", "convert_file_size_to_int", "dtype_byte_size",
    "find_tied_parameters", "get_balanced_memory", "get_max_layer_size", "get_max_memory", "has_offloaded_params",
    "id_tensor_storage", "infer_auto_device_map", "load_checkpoint_in_model", "load_offloaded_weights",
    "load_state_dict", "named_module_tensors", "retie_parameters", "set_module_tensor_to_device",
]
_AMP = ["get_grad_scaler", "get_mixed_precision_context_manager"]
__all__ = _BIG_MODEL + _AMP + ["is_peft_model"]

globals().update(refused_names("big_model", _BIG_MODEL))
globals().update(refused_names("amp", _AMP))


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a PEFT ``PeftModel`` (False when peft is not installed). Local."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)
