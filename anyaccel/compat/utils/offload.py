"""``anyaccel.utils.offload``: Accelerate's weight-offload names, re-exported from their one home,
:mod:`anyaccel.big_modeling.offload` (the disk offload folder in Accelerate's format)."""

from __future__ import annotations

from ...big_modeling.offload import (OffloadedWeightsLoader, PrefixedDataset,  # noqa: F401
                                    extract_submodules_state_dict, load_offloaded_weight, offload_state_dict,
                                    offload_weight, save_offload_index)

__all__ = ["OffloadedWeightsLoader", "PrefixedDataset", "extract_submodules_state_dict", "load_offloaded_weight",
           "offload_state_dict", "offload_weight", "save_offload_index"]
