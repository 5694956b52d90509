"""``anyaccel.utils.imports``: Accelerate's ``is_*_available`` checks, answered for anyaccel.

* A library check (``is_datasets_available``, ``is_wandb_available``, ...) says whether the
  package is installed, without importing it.
* A device check says whether anyaccel can run on that device here: ``is_cuda_available``,
  ``is_mps_available``, ``is_torch_xla_available`` ask; the checks of Accelerate's other devices
  (XPU, NPU, HPU, MLU, MUSA, SDAA, Neuron) ask the backend registry, and answer False unless a
  backend for that device type was registered and sees one.
* ``is_deepspeed_available`` says whether DeepSpeed is installed (the ``deepspeed`` strategy).
* fp8: ``is_torchao_available`` and ``is_transformer_engine_available`` say whether the library
  is installed (``mixed_precision="fp8"`` trains with it), ``is_fp8_available`` whether either is.
* An integration anyaccel does not have (Megatron-LM, MS-AMP, Transformer Engine's MXFP8,
  bitsandbytes, PiPPy) answers False even when the package is installed: a script that branches
  on it takes the path without it, as with Accelerate where it is missing.

All are Local (no communication) and cheap.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, Optional

import torch


__all__ = [
    "deepspeed_required", "is_4bit_bnb_available", "is_8bit_bnb_available", "is_aim_available", "is_amdsmi_available",
    "is_bf16_available", "is_bitsandbytes_multi_backend_available", "is_bnb_available", "is_boto3_available",
    "is_clearml_available", "is_comet_ml_available", "is_cuda_available", "is_datasets_available",
    "is_deepspeed_available", "is_dvclive_available", "is_fp16_available", "is_fp8_available", "is_habana_gaudi1",
    "is_hpu_available", "is_import_timer_available", "is_lomo_available", "is_matplotlib_available",
    "is_megatron_lm_available", "is_mlflow_available", "is_mlu_available", "is_mps_available", "is_msamp_available",
    "is_musa_available", "is_neuron_available", "is_npu_available", "is_pandas_available", "is_peft_available",
    "is_pippy_available", "is_pynvml_available", "is_pytest_available", "is_rich_available", "is_rocm_available",
    "is_sagemaker_available", "is_schedulefree_available", "is_sdaa_available", "is_swanlab_available",
    "is_tensorboard_available", "is_timm_available", "is_torch_xla_available", "is_torchao_available",
    "is_torchdata_available", "is_torchdata_stateful_dataloader_available", "is_torchvision_available",
    "is_trackio_available", "is_transformer_engine_available", "is_transformer_engine_mxfp8_available",
    "is_transformers_available", "is_triton_available", "is_wandb_available", "is_weights_only_available",
    "is_xccl_available", "is_xpu_available", "torchao_required",
]


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def is_cuda_available() -> bool:
    """Whether a CUDA GPU is visible (without initialising CUDA). Local."""
    from ...environment.devices import cuda_device_count

    return cuda_device_count() > 0


def is_mps_available(min_version: Optional[str] = "1.12") -> bool:
    """Whether Apple's MPS device is usable. Local."""
    from ...environment.devices import mps_available

    return mps_available()


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Whether torch-xla is installed. Local."""
    return _has("torch_xla")


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether ``mixed_precision="bf16"`` can run on this process's device (its backend decides;
    on a GPU that asks CUDA, which initialises it). Local."""
    from ...backends import create_backend
    from ...process.job import resolve_job_environment

    env = resolve_job_environment()
    try:
        create_backend(env).check_precision("bf16", warn=False)
    except ValueError:
        return False
    return True


def is_fp16_available() -> bool:
    """Whether fp16 mixed precision can run here (True: on the CPU torch runs it too). Local."""
    return True


def is_tensorboard_available() -> bool:
    return _has("tensorboard") or _has("tensorboardX")


def is_rocm_available() -> bool:
    """Whether this torch is built for AMD ROCm (HIP). Local."""
    return getattr(torch.version, "hip", None) is not None


def is_habana_gaudi1() -> bool:
    """Always False: anyaccel has no Gaudi HPU backend."""
    return False


def is_weights_only_available() -> bool:
    """Whether ``torch.load(weights_only=True)`` restricts unpickling (torch >= 2.4: always here). Local."""
    return True


def is_torchdata_stateful_dataloader_available() -> bool:
    """Whether torchdata's ``StatefulDataLoader`` can be imported (torchdata >= 0.8). Local."""
    if not _has("torchdata"):
        return False
    return importlib.util.find_spec("torchdata.stateful_dataloader") is not None


def _library(module: str) -> Callable[..., bool]:
    def check(*args: Any, **kwargs: Any) -> bool:
        return _has(module)

    check.__doc__ = f"Whether {module!r} is installed (not imported). Local."
    return check


def _registered(device_type: str) -> Callable[..., bool]:
    def check(*args: Any, **kwargs: Any) -> bool:
        from ...backends import device_available

        return device_available(device_type)

    check.__doc__ = (f"Whether a backend for {device_type!r} devices is registered and sees one (anyaccel ships "
                     "none: False unless one was registered). Local.")
    return check


def _never(what: str) -> Callable[..., bool]:
    def check(*args: Any, **kwargs: Any) -> bool:
        return False

    check.__doc__ = f"Always False: anyaccel has no {what}."
    return check


# is_<key>_available -> the module whose presence it reports
_LIBRARIES = {
    "aim": "aim", "boto3": "boto3", "clearml": "clearml", "comet_ml": "comet_ml", "datasets": "datasets",
    "dvclive": "dvclive", "matplotlib": "matplotlib", "mlflow": "mlflow", "pandas": "pandas", "peft": "peft",
    "pynvml": "pynvml", "pytest": "pytest", "rich": "rich", "sagemaker": "sagemaker", "schedulefree": "schedulefree",
    "swanlab": "swanlab", "timm": "timm", "torchdata": "torchdata", "torchvision": "torchvision",
    "trackio": "trackio", "transformers": "transformers", "wandb": "wandb", "triton": "triton",
    "lomo": "lomo_optim", "import_timer": "import_timer", "amdsmi": "amdsmi", "deepspeed": "deepspeed",
    "torchao": "torchao", "transformer_engine": "transformer_engine",
}
# Accelerate's is_<device>_available names for devices anyaccel ships no backend for: answered by
# the backend registry (a registered backend for one of them makes its check true)
_REGISTRY_DEVICES = ("xpu", "npu", "hpu", "mlu", "musa", "sdaa", "neuron")
# integrations anyaccel does not have
_NO_INTEGRATION = {
    "megatron_lm": "Megatron-LM", "msamp": "MS-AMP (fp8, deprecated upstream)",
    "transformer_engine_mxfp8": "Transformer Engine MXFP8", "bnb": "bitsandbytes", "4bit_bnb": "bitsandbytes",
    "8bit_bnb": "bitsandbytes", "bitsandbytes_multi_backend": "bitsandbytes", "pippy": "PiPPy pipeline inference",
    "xccl": "an XCCL (Intel XPU) backend",
}
for _key, _module in _LIBRARIES.items():
    globals()[f"is_{_key}_available"] = _library(_module)
for _key in _REGISTRY_DEVICES:
    globals()[f"is_{_key}_available"] = _registered(_key)
for _key, _what in _NO_INTEGRATION.items():
    globals()[f"is_{_key}_available"] = _never(f"{_what} integration")
for _name in __all__:  # the generated checks carry their public name
    if getattr(globals().get(_name), "__name__", "") == "check":
        globals()[_name].__name__ = globals()[_name].__qualname__ = _name


def deepspeed_required(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator (Accelerate's): ``func`` raises ``ImportError`` saying how to install DeepSpeed
    when it is missing. Local."""
    import functools

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _has("deepspeed"):
            raise ImportError(f"{func.__name__} needs DeepSpeed: pip install anyaccel[deepspeed]")
        return func(*args, **kwargs)

    return wrapper


def is_fp8_available(*args: Any, **kwargs: Any) -> bool:
    """Whether a library ``mixed_precision="fp8"`` trains with is installed (torchao, or NVIDIA
    Transformer Engine), without importing it. Local."""
    return _has("torchao") or _has("transformer_engine")


def torchao_required(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator (Accelerate's): ``func`` raises ``ImportError`` saying how to install torchao
    when it is missing. Local."""
    import functools

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _has("torchao"):
            raise ImportError(f"{func.__name__} needs torchao: pip install 'anyaccel[fp8]'")
        return func(*args, **kwargs)

    return wrapper
