"""``anyaccel.utils.fsdp_utils``: Accelerate's FSDP helpers. anyaccel's FSDP2 strategy
(``Accelerator(strategy="fsdp")``) shards, saves and loads inside ``prepare`` /
``save_state`` / ``load_state`` / ``get_state_dict``, so Accelerate's internal steps are refused
with that way; ``merge_fsdp_weights`` merges a sharded checkpoint into one safetensors model
(:func:`anyaccel.big_modeling.merge.merge_weights`, also ``anyaccel merge-weights``)."""

from __future__ import annotations

from ...big_modeling.merge import merge_weights as merge_fsdp_weights  # noqa: F401
from ._refuse import refused_names

_INTERNAL = ["disable_fsdp_ram_efficient_loading", "enable_fsdp_ram_efficient_loading", "ensure_weights_retied",
             "fsdp2_apply_ac", "fsdp2_canonicalize_names", "fsdp2_load_full_state_dict", "fsdp2_prepare_model",
             "fsdp2_switch_optimizer_parameters", "get_fsdp2_grad_scaler", "load_fsdp_model", "load_fsdp_optimizer",
             "save_fsdp_model", "save_fsdp_optimizer"]
__all__ = _INTERNAL + ["merge_fsdp_weights"]

globals().update(refused_names("fsdp_internal", _INTERNAL))
