"""``anyaccel.utils.constants``: Accelerate's file-name constants. anyaccel's checkpoints
(:mod:`anyaccel.checkpoint.layout`) and ``save_model`` use the same names, so code that looks for
``SAFE_WEIGHTS_NAME`` in a saved directory finds it."""

from __future__ import annotations

__all__ = ["MODEL_NAME", "SAFE_MODEL_NAME", "OPTIMIZER_NAME", "SCHEDULER_NAME", "SAMPLER_NAME", "SCALER_NAME",
           "RNG_STATE_NAME", "WEIGHTS_NAME", "WEIGHTS_PATTERN_NAME", "WEIGHTS_INDEX_NAME", "SAFE_WEIGHTS_NAME",
           "SAFE_WEIGHTS_PATTERN_NAME", "SAFE_WEIGHTS_INDEX_NAME", "PROFILE_PATTERN_NAME",
           "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION", "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION"]

MODEL_NAME = "pytorch_model"
SAFE_MODEL_NAME = "model"
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
SAMPLER_NAME = "sampler"
SCALER_NAME = "scaler.pt"
RNG_STATE_NAME = "random_states"
WEIGHTS_NAME = f"{MODEL_NAME}.bin"
WEIGHTS_PATTERN_NAME = "pytorch_model{suffix}.bin"
WEIGHTS_INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
SAFE_WEIGHTS_NAME = f"{SAFE_MODEL_NAME}.safetensors"
SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors"
SAFE_WEIGHTS_INDEX_NAME = f"{SAFE_WEIGHTS_NAME}.index.json"
PROFILE_PATTERN_NAME = "profile_{suffix}.json"
XPU_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.4.0"
MITA_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.1.0"
