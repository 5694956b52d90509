"""anyaccel: the same PyTorch training script on a CPU, one or many GPUs, several machines or a TPU.

    from anyaccel import Accelerator
    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    ...
    accelerator.backward(loss)

Imports are lazy: ``import anyaccel`` costs almost nothing on top of ``import torch``.

Module paths of before the top level was grouped into packages (``anyaccel.stepping``,
``anyaccel.detectors``, ``anyaccel.selftest_worker``, ...) still import, and still run with
``python -m``: each is its new module (:data:`MOVED_MODULES`).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Dict, Optional, Sequence

__version__ = "0.1.0"

_EXPORTS = {
    "Accelerator": "anyaccel.accelerator",
    "DistributedType": "anyaccel.environment",
    "Environment": "anyaccel.environment",
    "resolve_environment": "anyaccel.environment",
    "notebook_launcher": "anyaccel.launch.notebook",
    "debug_launcher": "anyaccel.launch.notebook",
    "set_seed": "anyaccel.compat.utils",
    "find_executable_batch_size": "anyaccel.training.memory",
    "free_memory": "anyaccel.training.memory",
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
    "GradientState": "anyaccel.training.accumulation",
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
    "FaultToleranceError": "anyaccel.errors",  # fault_tolerance (docs/guides/fault-tolerance.md)
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


# ---- module paths of before the packages (issue 38) ----------------------------------------------
#: every top-level module that moved into a package, and the module it is now:
#: ``import anyaccel.stepping`` gives ``anyaccel.training.stepping`` itself (the same object: names,
#: classes and monkeypatches are shared); ``python -m anyaccel.selftest_worker`` runs the new module
MOVED_MODULES = {
    **{f"anyaccel.{m}": f"anyaccel.environment.{m}" for m in ("detectors", "slurm", "devices", "network")},
    **{f"anyaccel.{m}": f"anyaccel.training.{m}"
       for m in ("stepping", "accumulation", "memory", "precision_fp8", "precision_te")},
    **{f"anyaccel.{m}": f"anyaccel.process.{m}" for m in ("process_group", "lifetime", "preemption", "job")},
    **{f"anyaccel.{m}": f"anyaccel.cli.{m}" for m in ("selftest", "selftest_worker", "env_report")},
}


class _MovedModules:
    """A meta-path finder that answers only for the module paths of one table (old name -> new
    name): the old name becomes the new module, imported on first use. Asked first (a name in the
    table is never a file any more: a stale copy of an old layout, e.g. an editable install's other
    checkout, must not answer for it); every other name costs one dictionary lookup. Also used by
    :mod:`anyaccel.strategies` for its own moves."""

    def __init__(self, table: Dict[str, str]) -> None:
        self.table = table
        self.specs: Dict[str, Any] = {}

    def find_spec(self, name: str, path: Optional[Sequence[str]] = None, target: Any = None) -> Any:
        if name not in self.table:
            return None
        from importlib.machinery import ModuleSpec

        return ModuleSpec(name, self)

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(self.table[spec.name])
        self.specs[spec.name] = module.__spec__  # the import system replaces it next (exec_module puts it back)
        return module

    def exec_module(self, module: Any) -> None:
        """Nothing to run (the module was executed under its own name); only its own ``__spec__``
        back, which the import system replaced with the old name's (its relative imports would
        warn ``__package__ != __spec__.parent``, and ``importlib.reload`` would look for the old name)."""
        own = self.specs.pop(module.__spec__.name, None)
        if own is not None:
            module.__spec__ = own

    def get_code(self, name: str) -> Any:
        """``python -m <old path>``: run the new module as ``__main__``, as ``python -m <new path>`` would."""
        source = f"import runpy\nrunpy.run_module({self.table[name]!r}, run_name='__main__', alter_sys=True)\n"
        return compile(source, f"<{name}: moved to {self.table[name]}>", "exec")


def _redirect_moved_modules(table: Dict[str, str]) -> None:
    """Make the old module paths of ``table`` import (once per table, whoever asks twice)."""
    if not any(isinstance(finder, _MovedModules) and finder.table is table for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules(table))


_redirect_moved_modules(MOVED_MODULES)
