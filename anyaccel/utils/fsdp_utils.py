"""``anyaccel.utils.fsdp_utils``: Accelerate's FSDP helpers. anyaccel's FSDP2 strategy
(``Accelerator(strategy="fsdp")``) shards, saves and loads inside ``prepare`` /
``save_state`` / ``load_state`` / ``get_state_dict``, so Accelerate's internal steps are refused
with that way; merging sharded checkpoints is pending: big-model support (issue 23)."""

from __future__ import annotations

from ._refuse import refused_names

_INTERNAL = ["disable_fsdp_ram_efficient_loading", "enable_fsdp_ram_efficient_loading", "ensure_weights_retied",
             "fsdp2_apply_ac", "fsdp2_canonicalize_names", "fsdp2_load_full_state_dict", "fsdp2_prepare_model",
             "fsdp2_switch_optimizer_parameters", "get_fsdp2_grad_scaler", "load_fsdp_model", "load_fsdp_optimizer",
             "save_fsdp_model", "save_fsdp_optimizer"]
__all__ = _INTERNAL + ["merge_fsdp_weights"]

globals().update(refused_names("fsdp_internal", _INTERNAL))
globals().update(refused_names("big_model", ["merge_fsdp_weights"]))
