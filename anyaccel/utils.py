"""``anyaccel.utils``: Accelerate's user-facing ``accelerate.utils`` names, with the same defaults.

A script migrating from Accelerate changes ``from accelerate.utils import X`` to
``from anyaccel.utils import X``. Collectives come from :mod:`anyaccel.ops` (shape-checked: a
mismatch raises :class:`DistributedOperationException` on every rank instead of hanging) with
Accelerate's defaults — notably ``reduce`` here averages (``"mean"``) like
``accelerate.utils.reduce``, while ``Accelerator.reduce`` sums, like Accelerate's method.

What anyaccel does not do — DeepSpeed, Megatron-LM, big-model dispatch (``init_empty_weights``,
device maps), fp8 recipes — is importable under its Accelerate name but raises
``NotImplementedError`` when used, naming the anyaccel way where there is one.
"""

from __future__ import annotations

import importlib.util
import os
import random
from typing import Any, Iterable, List, Optional

import torch

from . import ops
from .checkpoint import ProjectConfiguration
from .data import DataLoaderConfiguration
from .devices import send_to_device as _send_to_device
from .environment import DistributedType
from .errors import ShapeMismatchError
from .kwargs import (AutocastKwargs, DistributedDataParallelKwargs, GradientAccumulationPlugin, GradScalerKwargs,
                     InitProcessGroupKwargs, ProfileKwargs)
from .tracking import LoggerType
from .plugins import FullyShardedDataParallelPlugin, TorchDynamoPlugin
from .precision import convert_to_fp32, remove_autocast

__all__ = [
    # collectives (Collective: every rank calls them in the same order)
    "gather", "gather_object", "broadcast", "broadcast_object_list", "reduce", "pad_across_processes",
    "copy_tensor_to_devices", "wait_for_everyone", "synchronize_rng_states", "synchronize_rng_state",
    # local helpers
    "send_to_device", "set_seed", "extract_model_from_parallel", "save", "tqdm", "convert_to_fp32",
    "is_cuda_available", "is_mps_available", "is_xpu_available", "is_npu_available", "is_hpu_available",
    "is_torch_xla_available", "is_bf16_available", "is_fp16_available", "is_datasets_available",
    "is_pytest_available", "is_tensorboard_available", "is_wandb_available", "is_mlflow_available",
    "is_transformers_available",
    # names and option holders
    "DistributedType", "LoggerType", "ProjectConfiguration", "DataLoaderConfiguration", "DistributedOperationException",
    "DistributedDataParallelKwargs", "GradScalerKwargs", "InitProcessGroupKwargs", "AutocastKwargs",
    "ProfileKwargs", "GradientAccumulationPlugin", "FullyShardedDataParallelPlugin", "TorchDynamoPlugin",
    # refused, with the reason
    "DeepSpeedPlugin", "DummyOptim", "DummyScheduler", "MegatronLMPlugin", "FP8RecipeKwargs", "TERecipeKwargs",
    "AORecipeKwargs", "MSAMPRecipeKwargs", "init_empty_weights", "init_on_device", "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model", "infer_auto_device_map", "dispatch_model", "cpu_offload", "disk_offload",
]

#: Accelerate's name for the error a mismatched collective raises (anyaccel's ShapeMismatchError,
#: which CollectiveMismatchError extends: ranks in different collectives).
DistributedOperationException = ShapeMismatchError


# ---- collectives ---------------------------------------------------------------------------
def gather(tensor: Any) -> Any:
    """All-gather tensors (nested allowed) along dim 0; every rank receives the concatenation in
    rank order. Collective."""
    return ops.gather(tensor)


def gather_object(object: Any) -> List[Any]:
    """All-gather picklable objects; a list from each rank is concatenated, anything else becomes
    one element per rank. Every rank receives the whole. Collective."""
    return ops.gather_object(object)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Every rank receives rank ``from_process``'s tensors (nested allowed). Collective."""
    return ops.broadcast(tensor, from_process=from_process)


def broadcast_object_list(object_list: List[Any], from_process: int = 0) -> List[Any]:
    """Every rank's ``object_list`` is filled in place with rank ``from_process``'s picklable
    objects (and returned). Collective."""
    return ops.broadcast_object_list(object_list, from_process=from_process)


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """All-reduce tensors (nested allowed) with ``"mean"`` (the default, as
    ``accelerate.utils.reduce``), ``"sum"``, ``"max"`` or ``"min"``, then multiply by ``scale``;
    every rank receives the result. Collective."""
    return ops.reduce(tensor, reduction=reduction, scale=scale)


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """Pad tensors (nested allowed) along ``dim`` with ``pad_index`` to the largest size any rank
    has (at the start with ``pad_first``); each rank receives its own padded tensors. Collective."""
    return ops.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)


def copy_tensor_to_devices(tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A tensor that exists on the main process only (``None`` elsewhere) arrives on every rank's
    device: rank 0 sends its shape and dtype, then the values. Collective; rank 0 must pass a
    tensor."""
    meta = [(tuple(tensor.shape), tensor.dtype, str(tensor.device)) if tensor is not None else None]
    ops.broadcast_object_list(meta, from_process=0)
    if meta[0] is None:
        raise ValueError("copy_tensor_to_devices: the main process passed None; it must pass the tensor to copy")
    shape, dtype, _ = meta[0]
    if tensor is None:
        from .state import PartialState

        tensor = torch.empty(shape, dtype=dtype, device=PartialState().device)
    return ops.broadcast(tensor, from_process=0)


def wait_for_everyone() -> None:
    """Barrier: returns on each rank once every rank has called it. Collective."""
    ops.barrier()


def synchronize_rng_state(rng_type: str, generator: Optional[torch.Generator] = None) -> None:
    """Every rank's ``rng_type`` generator (``"torch"``, a device type such as ``"cuda"``, or
    ``"generator"`` with ``generator=``) is set to rank 0's state. Collective."""
    get, put = _rng_access(rng_type, generator)
    state = [get() if ops.rank() == 0 else None]
    ops.broadcast_object_list(state, from_process=0)
    put(state[0])


def synchronize_rng_states(rng_types: Iterable[str], generator: Optional[torch.Generator] = None) -> None:
    """:func:`synchronize_rng_state` for each of ``rng_types``. Collective. (Prepared loaders do
    not need it: their order comes from one seed shared by every rank.)"""
    for rng_type in rng_types:
        synchronize_rng_state(str(getattr(rng_type, "value", rng_type)), generator=generator)


def _rng_access(rng_type: str, generator: Optional[torch.Generator]):
    if rng_type == "torch":
        return torch.get_rng_state, torch.set_rng_state
    if rng_type == "generator":
        if generator is None:
            raise ValueError("synchronize_rng_state('generator') needs generator=<torch.Generator>")
        return generator.get_state, generator.set_state
    from .backends import backend_class

    try:
        device = backend_class(rng_type)  # "cuda", "mps", "xla": the device's own RNG, through its backend
    except ValueError:
        raise ValueError(f"rng type {rng_type!r}: anyaccel synchronises 'torch', 'generator' and the device types "
                         "it has a backend for ('cuda', 'mps', 'xla')") from None
    return device.get_rng_state, device.set_rng_state


# ---- local helpers -------------------------------------------------------------------------
def send_to_device(tensor: Any, device: Any, non_blocking: bool = False, skip_keys: Any = None) -> Any:
    """Move every tensor in a nested structure to ``device`` (dict entries named in ``skip_keys``
    stay where they are). Local."""
    if skip_keys and isinstance(tensor, dict):
        skip = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys)
        return type(tensor)({k: v if k in skip else _send_to_device(v, device, non_blocking)
                             for k, v in tensor.items()})
    return _send_to_device(tensor, device, non_blocking)


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's ``random``, NumPy (when installed), torch's CPU generator and the generator
    of every device whose runtime is started in the calling process (CUDA, MPS, XLA). Call it on
    every process with the same ``seed`` for identical model initialisation everywhere;
    ``device_specific=True`` adds the process rank so that each rank draws different numbers
    (e.g. for augmentation). ``deterministic=True`` also asks torch for deterministic
    algorithms. Local (reads the rank, no communication)."""
    from .backends import started_backends

    if device_specific:
        seed += ops.rank()
    random.seed(seed)
    os.environ.setdefault("PYTHONHASHSEED", str(seed))
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:  # pragma: no cover
        pass
    torch.manual_seed(seed)
    for backend in started_backends():
        backend.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def extract_model_from_parallel(model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                                keep_torch_compile: bool = True) -> torch.nn.Module:
    """The user's module inside DDP (and ``torch.compile``'s wrapper unless
    ``keep_torch_compile``); ``keep_fp32_wrapper=False`` also removes the autocast forward that
    ``prepare`` added under mixed precision. Local. Same as ``Accelerator.unwrap_model``."""
    from .strategies.base import unwrap_module

    if not keep_fp32_wrapper:
        remove_autocast(model)
    return unwrap_module(model, keep_torch_compile=keep_torch_compile)


def _local_rank() -> int:
    from .environment import resolve_environment

    return resolve_environment().local_rank


def save(obj: Any, f: Any, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
    """Save ``obj`` to ``f`` atomically (temporary file + rename; safetensors with
    ``safe_serialization``) from the main process only — from each node's local main process with
    ``save_on_each_node``. The other ranks return at once (no barrier inside)."""
    from .checkpoint import atomic_save

    if (_local_rank() if save_on_each_node else ops.rank()) == 0:
        atomic_save(obj, f, safe_serialization=safe_serialization)


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm(*args, **kwargs)``, drawn only on each node's local main process when
    ``main_process_only`` (the other ranks iterate silently). Local."""
    from .logging import progress

    iterable = args[0] if args else kwargs.pop("iterable", None)
    if len(args) > 1:
        raise TypeError("tqdm(): pass options by keyword (desc=..., total=...) after the iterable")
    return progress(iterable, main=not main_process_only or _local_rank() == 0, **kwargs)


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def is_cuda_available() -> bool:
    """Whether a CUDA GPU is visible (without initialising CUDA). Local."""
    from .devices import cuda_device_count

    return cuda_device_count() > 0


def is_mps_available(min_version: Optional[str] = None) -> bool:
    """Whether Apple's MPS device is usable. Local."""
    from .devices import mps_available

    return mps_available()


def is_xpu_available(check_device: bool = False) -> bool:
    """Always False: anyaccel has no Intel XPU backend (see "Adding a device" in the README)."""
    return False


def is_npu_available(check_device: bool = False) -> bool:
    """Always False: anyaccel has no Ascend NPU backend."""
    return False


def is_hpu_available(init_hccl: bool = False) -> bool:
    """Always False: anyaccel has no Gaudi HPU backend."""
    return False


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Whether torch-xla is installed. Local."""
    return _has("torch_xla")


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether ``mixed_precision="bf16"`` can run on this process's device (its backend decides;
    on a GPU that asks CUDA, which initialises it). Local."""
    from .backends import backend_class
    from .state import resolve_job_environment

    env = resolve_job_environment()
    try:
        backend_class(env.device_type)(env).check_precision("bf16", warn=False)
    except ValueError:
        return False
    return True


def is_fp16_available() -> bool:
    """Whether fp16 mixed precision can run here (True: on the CPU torch runs it too). Local."""
    return True


def is_datasets_available() -> bool:
    return _has("datasets")


def is_pytest_available() -> bool:
    return _has("pytest")


def is_tensorboard_available() -> bool:
    return _has("tensorboard") or _has("tensorboardX")


def is_wandb_available() -> bool:
    return _has("wandb")


def is_mlflow_available() -> bool:
    return _has("mlflow")


def is_transformers_available() -> bool:
    return _has("transformers")


# ---- refused -------------------------------------------------------------------------------
_FSDP = "for sharded training use FSDP2: Accelerator(strategy=\"fsdp\") or fsdp_plugin=FullyShardedDataParallelPlugin(...)"
_REFUSED = {
    "DeepSpeedPlugin": f"anyaccel has no DeepSpeed integration; {_FSDP}",
    "DummyOptim": f"anyaccel has no DeepSpeed integration; pass a torch optimizer; {_FSDP}",
    "DummyScheduler": f"anyaccel has no DeepSpeed integration; pass a torch LR scheduler; {_FSDP}",
    "MegatronLMPlugin": f"anyaccel has no Megatron-LM integration; {_FSDP}",
    "FP8RecipeKwargs": "anyaccel has no fp8 training; use mixed_precision=\"bf16\" or \"fp16\"",
    "TERecipeKwargs": "anyaccel has no fp8 training (Transformer Engine); use mixed_precision=\"bf16\" or \"fp16\"",
    "AORecipeKwargs": "anyaccel has no fp8 training (torchao); use mixed_precision=\"bf16\" or \"fp16\"",
    "MSAMPRecipeKwargs": "anyaccel has no fp8 training (MS-AMP); use mixed_precision=\"bf16\" or \"fp16\"",
}
_DISPATCH = ("anyaccel has no big-model dispatch (meta-device init, device maps, offload); to fit a model "
             f"that one device cannot hold, {_FSDP}, which shards parameters over the processes")
for _name in ("init_empty_weights", "init_on_device", "load_checkpoint_and_dispatch", "load_checkpoint_in_model",
              "infer_auto_device_map", "dispatch_model", "cpu_offload", "disk_offload"):
    _REFUSED[_name] = _DISPATCH


def _refused(name: str, reason: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{name}: {reason}")

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"Not available: {reason}. Calling it raises NotImplementedError."
    if name[0].isupper():
        return type(name, (), {"__init__": lambda self, *a, **k: refuse(), "__doc__": refuse.__doc__})
    return refuse


globals().update({_n: _refused(_n, _r) for _n, _r in _REFUSED.items()})
