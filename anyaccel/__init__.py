"""anyaccel: the same PyTorch training script on a CPU, one or many GPUs, several machines or a TPU.

    from anyaccel import Accelerator
    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    ...
    accelerator.backward(loss)

Imports are lazy: ``import anyaccel`` costs almost nothing on top of ``import torch``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Accelerator": "anyaccel.accelerator",
    "DistributedType": "anyaccel.environment",
    "Environment": "anyaccel.environment",
    "resolve_environment": "anyaccel.environment",
    "notebook_launcher": "anyaccel.launch.notebook",
    "debug_launcher": "anyaccel.launch.notebook",
    "set_seed": "anyaccel.compat.utils",
    "find_executable_batch_size": "anyaccel.memory",
    "free_memory": "anyaccel.memory",
    "skip_first_batches": "anyaccel.data",
    "DataLoaderConfiguration": "anyaccel.data",
    "LoggerType": "anyaccel.tracking",
    "GeneralTracker": "anyaccel.tracking",
    "get_logger": "anyaccel.logging",
    "ProjectConfiguration": "anyaccel.checkpoint",
    "DistributedDataParallelKwargs": "anyaccel.compat.kwargs",
    "GradScalerKwargs": "anyaccel.compat.kwargs",
    "InitProcessGroupKwargs": "anyaccel.compat.kwargs",
    "AutocastKwargs": "anyaccel.compat.kwargs",
    "ProfileKwargs": "anyaccel.compat.kwargs",
    "GradientAccumulationPlugin": "anyaccel.compat.kwargs",
    "FullyShardedDataParallelPlugin": "anyaccel.compat.plugins",
    "TorchDynamoPlugin": "anyaccel.compat.plugins",
    "PartialState": "anyaccel.compat.state",
    "AcceleratorState": "anyaccel.compat.state",
    "GradientState": "anyaccel.accumulation",
    "ResumePoint": "anyaccel.accelerator",
    # accelerate.data_loader's names
    "prepare_data_loader": "anyaccel.data.accelerate_names",
    "SeedableRandomSampler": "anyaccel.data.accelerate_names",
    "DataLoaderShard": "anyaccel.data.accelerate_names",
    "DataLoaderDispatcher": "anyaccel.data.accelerate_names",
    "synchronize_rng_states": "anyaccel.compat.utils",
    "DDPCommunicationHookType": "anyaccel.compat.utils",
    "is_rich_available": "anyaccel.compat.utils",
    # big models (anyaccel.big_modeling)
    "init_empty_weights": "anyaccel.compat.utils",
    "init_on_device": "anyaccel.compat.utils",
    "load_checkpoint_and_dispatch": "anyaccel.compat.utils",
    "load_checkpoint_in_model": "anyaccel.compat.utils",
    "infer_auto_device_map": "anyaccel.compat.utils",
    "dispatch_model": "anyaccel.compat.utils",
    "cpu_offload": "anyaccel.compat.utils",
    "disk_offload": "anyaccel.compat.utils",
    "DeepSpeedPlugin": "anyaccel.compat.utils",  # the deepspeed strategy (docs/guides/deepspeed.md)
    # Accelerate's top-level names for what anyaccel refuses (calling them says why and what instead)
    "cpu_offload_with_hook": "anyaccel.compat.utils",
    "ParallelismConfig": "anyaccel.strategies.nd.options",
    "SequenceParallelAttention": "anyaccel.strategies.nd.sequence.ulysses",
    "AnyaccelError": "anyaccel.errors",
    "ShapeMismatchError": "anyaccel.errors",
    "CheckpointError": "anyaccel.errors",
    "WorkerFailedError": "anyaccel.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'anyaccel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
