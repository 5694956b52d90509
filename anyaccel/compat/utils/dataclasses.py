"""``anyaccel.utils.dataclasses``: Accelerate's ``accelerate.utils.dataclasses`` names.

The option holders anyaccel uses are re-exported from their homes (:mod:`anyaccel.compat.kwargs`,
:mod:`anyaccel.compat.plugins`, :mod:`anyaccel.data`, :mod:`anyaccel.checkpoint`,
:mod:`anyaccel.tracking`, :mod:`anyaccel.environment`). The enums below exist for scripts that
name Accelerate's values (``PrecisionType.BF16``, ``RNGType.TORCH``, ``DynamoBackend.INDUCTOR``):
same members, same values, ``str(member)`` is the value and ``"bf16" in PrecisionType`` works.
This module is their home. Plugins for what anyaccel does not do are refused
(:mod:`anyaccel.compat.utils._refuse`).
"""

from __future__ import annotations

import copy
import enum
from typing import Any, List

from ...checkpoint import ProjectConfiguration
from ...data import DataLoaderConfiguration
from ...environment import DistributedType
from ..kwargs import (AORecipeKwargs, AutocastKwargs, DistributedDataParallelKwargs, FP8RecipeKwargs,
                      GradientAccumulationPlugin, GradScalerKwargs, InitProcessGroupKwargs, ProfileKwargs, TERecipeKwargs)
from ..plugins import FullyShardedDataParallelPlugin, TorchDynamoPlugin
from ...strategies.nd.options import ParallelismConfig
from ...tracking import LoggerType
from ._refuse import refused_names
from .deepspeed import DeepSpeedPlugin
from .operations import TensorInformation

__all__ = [
    "DistributedType", "LoggerType", "ProjectConfiguration", "DataLoaderConfiguration", "AutocastKwargs",
    "DistributedDataParallelKwargs", "GradientAccumulationPlugin", "GradScalerKwargs", "InitProcessGroupKwargs",
    "ProfileKwargs", "FullyShardedDataParallelPlugin", "TorchDynamoPlugin", "TensorInformation", "KwargsHandler",
    "PrecisionType", "RNGType", "DynamoBackend", "DDPCommunicationHookType", "ComputeEnvironment",
    "SageMakerDistributedType", "CustomDtype", "ParallelismConfig",
    "DeepSpeedPlugin", "AORecipeKwargs", "TERecipeKwargs", "FP8RecipeKwargs", "FP8BackendType",
    # refused
    "DeepSpeedSequenceParallelConfig", "MegatronLMPlugin", "MSAMPRecipeKwargs", "BnbQuantizationConfig", "TorchTensorParallelPlugin",
    "TorchTensorParallelConfig", "TorchContextParallelConfig",
]


class KwargsHandler:
    """Mixin for a dataclass of keyword options: :meth:`to_kwargs` returns only the fields whose
    value differs from the class's default (Accelerate's base of its ``*Kwargs`` handlers, for
    handlers users write themselves). Local."""

    def to_dict(self) -> dict:
        return copy.deepcopy(self.__dict__)

    def to_kwargs(self) -> dict:
        default = type(self)().to_dict()
        return {k: v for k, v in self.to_dict().items() if default.get(k) != v}


class _Contains(enum.EnumMeta):
    """``value in Enum`` is True for a member's value (Accelerate's ``EnumWithContains``)."""

    def __contains__(cls, item: Any) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class _ValueEnum(enum.Enum, metaclass=_Contains):
    """``str(member)`` is its value; ``list()`` gives every value (Accelerate's ``BaseEnum``)."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> List[str]:
        return [str(member) for member in cls]


class PrecisionType(str, _ValueEnum):
    """Values of ``mixed_precision``: ``"no"``, ``"fp8"`` (torchao or Transformer Engine:
    :mod:`anyaccel.precision_fp8`), ``"fp16"``, ``"bf16"``."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class FP8BackendType(str, _ValueEnum):
    """Values of ``accelerator.fp8_backend`` (equal to the strings it returns): ``NO`` (not fp8),
    ``AO`` (torchao), ``TE`` (Transformer Engine), ``MSAMP`` (Accelerate's; refused here)."""

    NO = "NO"
    TE = "TE"
    MSAMP = "MSAMP"
    AO = "AO"


class RNGType(_ValueEnum):
    """Values of ``rng_types`` (``synchronize_rng_states``). anyaccel synchronises ``torch``,
    ``generator`` and the devices it has a backend for (``cuda``, ``xla``, ``mps``)."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"


class DynamoBackend(str, _ValueEnum):
    """``torch.compile`` backends by Accelerate's names (``dynamo_backend=``; ``"NO"``: no
    compile). anyaccel passes the lower-cased value to ``torch.compile``."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


class DDPCommunicationHookType(_ValueEnum):
    """Accelerate's DDP gradient-compression hooks: ``DistributedDataParallelKwargs(comm_hook=...,
    comm_wrapper=...)`` takes these members or their values and registers torch's hook on the
    prepared DDP model (:func:`anyaccel.strategies.ddp.register_comm_hook`)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


class ComputeEnvironment(str, enum.Enum):
    """Accelerate's config-file ``compute_environment``; anyaccel runs on ``LOCAL_MACHINE`` only."""

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class SageMakerDistributedType(str, enum.Enum):
    """Accelerate's SageMaker modes (anyaccel does not launch on SageMaker)."""

    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"


class CustomDtype(enum.Enum):
    """Accelerate's extra dtypes for device-map size estimates (big-model support, pending)."""

    FP8 = "fp8"
    INT4 = "int4"
    INT2 = "int2"


globals().update(refused_names("deepspeed", ["DeepSpeedSequenceParallelConfig"]))
globals().update(refused_names("megatron", ["MegatronLMPlugin"]))
globals().update(refused_names("msamp", ["MSAMPRecipeKwargs"]))
globals().update(refused_names("bnb", ["BnbQuantizationConfig"]))
globals().update(refused_names("tp", ["TorchTensorParallelPlugin", "TorchTensorParallelConfig",
                                      "TorchContextParallelConfig"]))
