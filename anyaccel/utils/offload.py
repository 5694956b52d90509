"""``anyaccel.utils.offload``: Accelerate's weight-offload names — pending: big-model support
(issue 23). Importable; using them raises ``NotImplementedError``."""

from __future__ import annotations

from ._refuse import refused_names

__all__ = ["OffloadedWeightsLoader", "PrefixedDataset", "extract_submodules_state_dict", "load_offloaded_weight",
           "offload_state_dict", "offload_weight", "save_offload_index"]

globals().update(refused_names("big_model", __all__))
