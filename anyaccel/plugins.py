"""Accelerate's ``FullyShardedDataParallelPlugin`` and ``TorchDynamoPlugin``, at the path anyaccel has always had.

The code lives in :mod:`anyaccel.compat.plugins` (the Accelerate compatibility layer); this file
exists so that ``from anyaccel.plugins import FullyShardedDataParallelPlugin`` keeps working. No
anyaccel module imports it.
"""

from .compat.plugins import (FSDP1_CONFIG_KEYS, FSDP_CONFIG_KEYS, FSDP_STATE_DICT_TYPES, FullyShardedDataParallelPlugin,
                             TorchDynamoPlugin, fsdp1_keys, fsdp_plugin_from_dict)

__all__ = ["FullyShardedDataParallelPlugin", "TorchDynamoPlugin", "fsdp_plugin_from_dict", "fsdp1_keys", "FSDP_CONFIG_KEYS",
           "FSDP1_CONFIG_KEYS", "FSDP_STATE_DICT_TYPES"]
