"""``anyaccel.test_utils``: Accelerate's ``accelerate.test_utils`` names, on anyaccel.

Accelerate's own test scripts and example scripts import their helpers from here
(``from accelerate.test_utils import RegressionDataset, RegressionModel, are_the_same_tensors``,
``from accelerate.test_utils.testing import assert_exception``,
``from accelerate.test_utils.training import mocked_dataloaders``); with ``sed
s/accelerate/anyaccel/`` they import these. Same names, same behaviour, read from anyaccel's state
(``are_the_same_tensors`` gathers through anyaccel; ``torch_device`` is the device anyaccel picks;
``get_launch_command`` builds an ``anyaccel launch`` command). Differences are listed in the
Accelerate guide (docs/guides/accelerate.md, "anyaccel.test_utils").

A compatibility layer for tests and examples: nothing in anyaccel imports it (checked by the
layers contract in pyproject.toml). Accelerate's test *scripts* (``accelerate.test_utils.scripts``)
are Accelerate's code and are not shipped here.
"""

from __future__ import annotations

from .testing import (DEFAULT_LAUNCH_COMMAND, AccelerateTestCase, MockingTestCase, SubprocessCallException,  # noqa: F401
                      TempDirTestCase, are_the_same_tensors, assert_exception, capture_call_output, device_count,
                      execute_subprocess_async, get_launch_command, get_torch_dist_unique_port, memory_allocated_func,
                      path_in_accelerate_package, pytest_xdist_worker_id, require_bnb, require_cpu, require_cuda,
                      require_cuda_or_hpu, require_cuda_or_xpu, require_fp8, require_fp16, require_huggingface_suite,
                      require_mlu, require_mps, require_multi_device, require_multi_gpu, require_multi_gpu_or_xpu,
                      require_multi_xpu, require_musa, require_non_cpu, require_non_hpu, require_non_torch_xla,
                      require_non_xpu, require_npu, require_pippy, require_sdaa, require_single_device,
                      require_single_gpu, require_single_xpu, require_torch_min_version, require_torchao,
                      require_torchvision, require_tpu, require_transformer_engine, require_transformer_engine_mxfp8,
                      require_xpu, run_command, run_first, skip, slow, torch_device)
from .training import RegressionDataset, RegressionModel  # noqa: F401

__all__ = [
    "DEFAULT_LAUNCH_COMMAND", "are_the_same_tensors", "assert_exception", "capture_call_output", "device_count",
    "execute_subprocess_async", "get_launch_command", "get_torch_dist_unique_port", "memory_allocated_func",
    "path_in_accelerate_package", "pytest_xdist_worker_id", "require_bnb", "require_cpu", "require_cuda",
    "require_cuda_or_hpu", "require_cuda_or_xpu", "require_fp8", "require_fp16", "require_huggingface_suite",
    "require_mlu", "require_mps", "require_multi_device", "require_multi_gpu", "require_multi_gpu_or_xpu",
    "require_multi_xpu", "require_musa", "require_non_cpu", "require_non_hpu", "require_non_torch_xla",
    "require_non_xpu", "require_npu", "require_pippy", "require_sdaa", "require_single_device", "require_single_gpu",
    "require_single_xpu", "require_torch_min_version", "require_torchao", "require_torchvision", "require_tpu",
    "require_transformer_engine", "require_transformer_engine_mxfp8", "require_xpu", "run_first", "skip", "slow",
    "torch_device", "RegressionDataset", "RegressionModel", "TempDirTestCase", "AccelerateTestCase",
    "MockingTestCase", "SubprocessCallException", "run_command",
]
