"""``anyaccel.test_utils.testing``: Accelerate's test helpers (``accelerate.test_utils.testing``).

* ``torch_device``, ``device_count``, ``memory_allocated_func``: the accelerator this process
  would use (``"cuda"``, ``"mps"``, ``"xla"`` or ``"cpu"``), how many, and its allocated-memory
  probe — found once at import, without starting anything.
* ``require_*`` / ``skip`` / ``slow`` / ``run_first``: ``unittest`` decorators that skip a test
  when what it needs is missing (Accelerate's names and conditions; ``slow`` runs only with
  ``RUN_SLOW=yes``).
* ``are_the_same_tensors`` (collective: every rank calls it, every rank gets whether all ranks
  hold the same tensor), ``assert_exception``, ``capture_call_output``,
  ``execute_subprocess_async``, ``run_command``, ``get_launch_command`` (an ``anyaccel launch``
  command), ``path_in_accelerate_package`` (a path inside the *anyaccel* package), test-case
  bases. Everything else is local.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Tuple, Type, Union

import torch

from ..compat import utils as _u

__all__ = [
    "DEFAULT_LAUNCH_COMMAND", "AccelerateTestCase", "MockingTestCase", "SubprocessCallException", "TempDirTestCase",
    "are_the_same_tensors", "assert_exception", "capture_call_output", "device_count", "execute_subprocess_async",
    "get_backend", "get_launch_command", "get_torch_dist_unique_port", "memory_allocated_func", "parse_flag_from_env",
    "path_in_accelerate_package", "pytest_xdist_worker_id", "run_command", "run_first", "skip", "slow",
    "torch_device",
]


def get_backend() -> Tuple[str, int, Callable[[], int]]:
    """``(device type, device count, allocated-memory probe)`` of this machine's accelerator, as
    Accelerate reports it (CPU: ``("cpu", 1, lambda: 0)``): the most preferred device of the
    registry that this process sees. Local; starts no device."""
    from ..environment.devices import known_devices

    for facts in known_devices():
        count = facts.count()
        if count > 0:
            module = getattr(torch, facts.device_type, None)
            probe = getattr(module, "memory_allocated", None) or getattr(module, "current_allocated_memory", None)
            return facts.device_type, count, probe if callable(probe) else (lambda: 0)
    return "cpu", 1, lambda: 0


torch_device, device_count, memory_allocated_func = get_backend()


def get_launch_command(**kwargs: Any) -> List[str]:
    """``["anyaccel", "launch", "--key=value", ...]`` (a True flag as ``--key``, None and False
    left out): Accelerate's helper, for the launcher that takes the same flags. Local."""
    command = ["anyaccel", "launch"]
    for key, value in kwargs.items():
        if value is True:
            command.append(f"--{key}")
        elif value is not None and value is not False:
            command.append(f"--{key}={value}")
    return command


DEFAULT_LAUNCH_COMMAND = get_launch_command(num_processes=device_count, monitor_interval=0.1)


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """The yes/no variable ``key`` (``1``/``true``/``yes``, ``0``/``false``/``no``), else ``default``."""
    if key not in os.environ:
        return default
    try:
        return bool(_u.str_to_bool(os.environ[key]))
    except ValueError:
        raise ValueError(f"{key}={os.environ[key]!r}: if set, it must be yes or no") from None


_RUN_SLOW = parse_flag_from_env("RUN_SLOW", default=False)


def skip(test_case: Any) -> Any:
    """Skip the test, always."""
    return unittest.skip("Test was skipped")(test_case)


def slow(test_case: Any) -> Any:
    """Run the test only when ``RUN_SLOW`` is set to a true value."""
    return unittest.skipUnless(_RUN_SLOW, "test is slow")(test_case)


def run_first(test_case: Any) -> Any:
    """Order the test first when pytest-order is installed (``pytest.mark.order(1)``)."""
    if _u.is_pytest_available():
        import pytest

        return pytest.mark.order(1)(test_case)
    return test_case


def _requires(condition: Callable[[], bool], reason: str) -> Callable[[Any], Any]:
    def decorator(test_case: Any) -> Any:
        return unittest.skipUnless(condition(), reason)(test_case)

    return decorator


def _count(device_type: str) -> int:
    """Devices of ``device_type`` this process sees (0 for a type torch or the registry lacks)."""
    from ..environment.devices import device_facts

    try:
        return int(device_facts(device_type).count())
    except ValueError:  # not a registered device: ask torch's module of that name, if any
        counter = getattr(getattr(torch, device_type, None), "device_count", None)
        return int(counter()) if callable(counter) else 0


def _fp8_available() -> bool:
    return bool(_u.is_fp8_available()) and not (_u.is_hpu_available() and _u.is_habana_gaudi1())


def _cuda_not_xla() -> bool:
    return bool(_u.is_cuda_available()) and not _u.is_torch_xla_available()


# Accelerate's decorators: name -> (condition, reason shown when skipped)
_REQUIREMENTS = {
    "require_cpu": (lambda: torch_device == "cpu", "test requires only a CPU"),
    "require_non_cpu": (lambda: torch_device != "cpu", "test requires a GPU"),
    "require_cuda": (_cuda_not_xla, "test requires a GPU"),
    "require_cuda_or_hpu": (lambda: _cuda_not_xla() or _u.is_hpu_available(), "test requires a GPU or HPU"),
    "require_xpu": (_u.is_xpu_available, "test requires a XPU"),
    "require_cuda_or_xpu": (lambda: _cuda_not_xla() or _u.is_xpu_available(), "test requires a CUDA GPU or XPU"),
    "require_non_xpu": (lambda: torch_device != "xpu", "test requires a non-XPU"),
    "require_non_hpu": (lambda: torch_device != "hpu", "test requires a non-HPU"),
    "require_fp16": (_u.is_fp16_available, "test requires FP16 support"),
    "require_fp8": (_fp8_available, "test requires FP8 support"),
    "require_fsdp2": (lambda: _u.is_torch_version(">=", "2.5.0"), "test requires FSDP2 (torch >= 2.5.0)"),
    "require_peft": (_u.is_peft_available, "test requires PEFT"),
    "require_mlu": (_u.is_mlu_available, "test requires a MLU"),
    "require_sdaa": (_u.is_sdaa_available, "test requires a SDAA"),
    "require_musa": (_u.is_musa_available, "test requires a MUSA"),
    "require_npu": (_u.is_npu_available, "test require a NPU"),
    "require_neuron": (_u.is_neuron_available, "test requires a Neuron device"),
    "require_mps": (_u.is_mps_available, "test requires a `mps` backend support in `torch`"),
    "require_huggingface_suite": (lambda: _u.is_transformers_available() and _u.is_datasets_available(),
                                  "test requires the Hugging Face suite"),
    "require_datasets": (_u.is_datasets_available, "test requires the datasets library"),
    "require_transformers": (_u.is_transformers_available, "test requires the transformers library"),
    "require_timm": (_u.is_timm_available, "test requires the timm library"),
    "require_torchvision": (_u.is_torchvision_available, "test requires the torchvision library"),
    "require_triton": (_u.is_triton_available, "test requires the triton library"),
    "require_schedulefree": (_u.is_schedulefree_available, "test requires the schedulefree library"),
    "require_bnb": (_u.is_bnb_available, "test requires the bitsandbytes library"),
    "require_tpu": (lambda: _u.is_torch_xla_available(check_is_tpu=True), "test requires TPU"),
    "require_non_torch_xla": (lambda: not _u.is_torch_xla_available(), "test requires an env without TorchXLA"),
    "require_single_device": (lambda: torch_device != "cpu" and device_count == 1,
                              "test requires a single device accelerator"),
    "require_single_gpu": (lambda: _count("cuda") == 1, "test requires a GPU"),
    "require_single_xpu": (lambda: _count("xpu") == 1, "test requires a XPU"),
    "require_multi_device": (lambda: device_count > 1, "test requires multiple hardware accelerators"),
    "require_multi_gpu": (lambda: _count("cuda") > 1, "test requires multiple GPUs"),
    "require_multi_xpu": (lambda: _count("xpu") > 1, "test requires multiple XPUs"),
    "require_multi_gpu_or_xpu": (lambda: (_u.is_cuda_available() or _u.is_xpu_available()) and device_count > 1,
                                 "test requires multiple GPUs or XPUs"),
    "require_deepspeed": (_u.is_deepspeed_available, "test requires DeepSpeed"),
    "require_tp": (lambda: _u.is_torch_version(">=", "2.3.0") and _u.is_transformers_available()
                   and _u.compare_versions("transformers", ">=", "4.52.0"),
                   "test requires torch version >= 2.3.0 and transformers version >= 4.52.0"),
    "require_tensorboard": (_u.is_tensorboard_available, "test requires Tensorboard"),
    "require_wandb": (_u.is_wandb_available, "test requires wandb"),
    "require_trackio": (_u.is_trackio_available, "test requires trackio"),
    "require_comet_ml": (_u.is_comet_ml_available, "test requires comet_ml"),
    "require_aim": (_u.is_aim_available, "test requires aim"),
    "require_clearml": (_u.is_clearml_available, "test requires clearml"),
    "require_dvclive": (_u.is_dvclive_available, "test requires dvclive"),
    "require_swanlab": (_u.is_swanlab_available, "test requires swanlab"),
    "require_pandas": (_u.is_pandas_available, "test requires pandas"),
    "require_mlflow": (_u.is_mlflow_available, "test requires mlflow"),
    "require_pippy": (lambda: _u.is_pippy_available() and not _u.is_habana_gaudi1(), "test requires pippy"),
    "require_import_timer": (_u.is_import_timer_available, "test requires tuna interpreter"),
    "require_transformer_engine": (_u.is_transformer_engine_available, "test requires transformers engine"),
    "require_transformer_engine_mxfp8": (_u.is_transformer_engine_mxfp8_available,
                                         "test requires transformers engine MXFP8 block scaling"),
    "require_torchao": (_u.is_torchao_available, "test requires torchao"),
    "require_matplotlib": (_u.is_matplotlib_available, "test requires matplotlib"),
    "require_trackers": (lambda: any((_u.is_wandb_available(), _u.is_tensorboard_available(),
                                      _u.is_trackio_available(), _u.is_swanlab_available()))
                         and not _u.is_comet_ml_available(),
                         "test requires at least one tracker to be available and for `comet_ml` to not be installed"),
    "require_torchdata_stateful_dataloader": (_u.is_torchdata_stateful_dataloader_available,
                                              "test requires torchdata.stateful_dataloader"),
}
for _name, (_condition, _reason) in _REQUIREMENTS.items():
    globals()[_name] = _requires(_condition, _reason)
    __all__.append(_name)
del _name, _condition, _reason


def require_torch_min_version(test_case: Any = None, version: Optional[str] = None) -> Any:
    """Skip the test when torch is older than ``version`` (usable as
    ``@require_torch_min_version(version="2.5")``)."""
    if test_case is None:
        return functools.partial(require_torch_min_version, version=version)
    return unittest.skipUnless(_u.is_torch_version(">=", str(version)),
                               f"test requires torch version >= {version}")(test_case)


__all__.append("require_torch_min_version")


class TempDirTestCase(unittest.TestCase):
    """One temporary directory per class (``self.tmpdir``, a ``Path``), emptied before each test
    when ``clear_on_setup`` and removed after the class."""

    clear_on_setup = True
    tmpdir: Path

    @classmethod
    def setUpClass(cls) -> None:
        cls.tmpdir = Path(tempfile.mkdtemp())

    @classmethod
    def tearDownClass(cls) -> None:
        shutil.rmtree(cls.tmpdir, ignore_errors=True)

    def setUp(self) -> None:
        if self.clear_on_setup:
            for path in list(self.tmpdir.iterdir()):
                shutil.rmtree(path) if path.is_dir() else path.unlink()


class AccelerateTestCase(unittest.TestCase):
    """Accelerate resets its state singletons after each test; anyaccel keeps no process-wide
    state (each ``Accelerator`` owns its own), so there is nothing to reset."""


class MockingTestCase(unittest.TestCase):
    """``self.add_mocks(m)`` in ``setUp`` starts mocks that stop when the test ends."""

    def add_mocks(self, mocks: Union[Any, List[Any]]) -> None:
        self.mocks = list(mocks) if isinstance(mocks, (list, tuple)) else [mocks]
        for m in self.mocks:
            m.start()
            self.addCleanup(m.stop)


def are_the_same_tensors(tensor: torch.Tensor) -> bool:
    """Whether every process holds a tensor equal to this one. Collective: every rank calls it
    with a tensor of the same shape and every rank gets the answer."""
    from ..compat.state import PartialState
    from ..compat.utils import gather

    mine = tensor[None].clone().to(PartialState().device)
    every = gather(mine).cpu()
    return all(torch.equal(every[i], mine[0].cpu()) for i in range(every.shape[0]))


class _RunOutput:
    def __init__(self, returncode: int, stdout: List[str], stderr: List[str]):
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr


async def _stream(cmd: List[str], env: Any, stdin: Any, timeout: Optional[float], quiet: bool,
                  echo: bool) -> _RunOutput:
    if echo:
        print("\nRunning: ", " ".join(cmd))
    proc = await asyncio.create_subprocess_exec(cmd[0], *cmd[1:], stdin=stdin, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, env=env)
    out: List[str] = []
    err: List[str] = []

    async def pump(stream: Any, sink: List[str], pipe: Any, label: str) -> None:
        while True:
            line = await stream.readline()
            if not line:
                return
            text = line.decode("utf-8", errors="replace").rstrip()
            sink.append(text)
            if not quiet:
                print(label, text, file=pipe)

    await asyncio.wait([asyncio.create_task(pump(proc.stdout, out, sys.stdout, "stdout:")),
                        asyncio.create_task(pump(proc.stderr, err, sys.stderr, "stderr:"))], timeout=timeout)
    return _RunOutput(await proc.wait(), out, err)


def execute_subprocess_async(cmd: list, env: Any = None, stdin: Any = None, timeout: float = 180,
                             quiet: bool = False, echo: bool = True) -> _RunOutput:
    """Run ``cmd``, echoing its output line by line; ``RuntimeError`` with its stderr when it
    exits with a positive code. Returns an object with ``returncode``, ``stdout``, ``stderr``
    (lists of lines)."""
    cmd = [str(c) if isinstance(c, Path) else c for c in cmd]
    result = asyncio.run(_stream(cmd, env, stdin, timeout, quiet, echo))
    if result.returncode > 0:
        raise RuntimeError(f"'{' '.join(cmd)}' failed with returncode {result.returncode}\n\n"
                           "The combined stderr from workers follows:\n" + "\n".join(result.stderr))
    return result


def pytest_xdist_worker_id() -> int:
    """This pytest-xdist worker's number (``gw3`` -> 3), 0 without xdist."""
    return int(re.sub(r"^gw", "", os.environ.get("PYTEST_XDIST_WORKER", "gw0")))


def get_torch_dist_unique_port() -> int:
    """29500 plus the pytest-xdist worker number: a port per concurrent test worker."""
    return 29500 + pytest_xdist_worker_id()


class SubprocessCallException(Exception):
    """``run_command``'s command failed; the message holds its output."""


def run_command(command: List[Any], return_stdout: bool = False, env: Any = None) -> Optional[str]:
    """Run ``command`` (stderr into stdout); its output when ``return_stdout``;
    :class:`SubprocessCallException` with the output when it fails."""
    command = [str(c) if isinstance(c, Path) else c for c in command]
    try:
        output = subprocess.check_output(command, stderr=subprocess.STDOUT,
                                         env=os.environ.copy() if env is None else env)
    except subprocess.CalledProcessError as exc:
        raise SubprocessCallException(f"Command `{' '.join(command)}` failed with the following error:\n\n"
                                      f"{exc.output.decode(errors='replace')}") from exc
    return output.decode("utf-8", errors="replace") if return_stdout else None


def path_in_accelerate_package(*components: str) -> Path:
    """A path inside the installed *anyaccel* package (Accelerate's helper points into its own)."""
    return Path(__file__).resolve().parent.parent.joinpath(*components)


@contextlib.contextmanager
def assert_exception(exception_class: Type[BaseException], msg: Optional[str] = None) -> Iterator[None]:
    """Assert that the block raises ``exception_class`` (with ``msg`` in its message when given);
    an ``AssertionError`` when it raises another exception or none."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - judged below
        assert isinstance(exc, exception_class), f"Expected exception of type {exception_class} but got {type(exc)}"
        if msg is not None:
            assert msg in str(exc), f"Expected message '{msg}' to be in exception but got '{exc}'"
        return
    raise AssertionError(f"Expected exception of type {exception_class} but ran without issue.")


def capture_call_output(func: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """What ``func(*args, **kwargs)`` prints to stdout."""
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        func(*args, **kwargs)
    return captured.getvalue()

