"""Which devices exist, asked without side effects; the facts about each device type; moving
nested data onto a device.

The probes here never create a CUDA context: ``torch.cuda.device_count()`` asks NVML when it can
and does not poison a later ``fork`` (the notebook launcher forks). ``CUDA_VISIBLE_DEVICES`` is
honoured because it is what ``device_count`` sees.

This module is the low half of the device seam (:mod:`anyaccel.backends` is the high half): the
environment (a lower layer than the backends) chooses the device from the :class:`DeviceFacts` in
the registry here, and everything above asks the backend registry, which answers from the same
facts. Adding a device registers its facts once, through
:func:`anyaccel.backends.register_backend` (which calls :func:`register_device`); nothing outside
the two halves names a device type.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import lazyclass

__all__ = ["cuda_device_count", "mps_available", "cuda_initialized", "send_to_device", "DeviceFacts",
           "register_device", "device_facts", "known_devices"]


def cuda_device_count() -> int:
    """Number of visible CUDA devices (0 on CPU-only builds). Does not initialise CUDA."""
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def cuda_initialized() -> bool:
    """True when this process already created a CUDA context (a fork would then be unsafe)."""
    return bool(getattr(torch.cuda, "is_initialized", lambda: False)())


def mps_available() -> bool:
    """True on Apple silicon with a PyTorch build that supports the MPS device."""
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def send_to_device(data: Any, device: Optional[Any], non_blocking: bool = False, skip_keys: Any = None) -> Any:
    """Move every tensor inside ``data`` to ``device``, as Accelerate's ``send_to_device`` does:
    tensors and objects with their own ``.to`` (e.g. Hugging Face ``BatchEncoding``, at any depth)
    are moved; lists, tuples and namedtuples are rebuilt with their type; every ``Mapping`` is
    rebuilt with its type, the values of keys named in ``skip_keys`` (a key or a list, at every
    depth) left where they are; other objects are returned untouched (so is an object whose
    ``.to`` refuses a device). Local to the calling process. ``device=None``
    leaves tensors where they are (``Tensor.to(None)``)."""
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=non_blocking)
    to = getattr(data, "to", None)
    if callable(to) and not isinstance(data, type):
        try:
            return to(device, non_blocking=non_blocking)
        except TypeError:  # a .to without non_blocking
            try:
                return to(device)
            except TypeError:
                return data
    if isinstance(data, (list, tuple)):
        moved = [send_to_device(x, device, non_blocking, skip_keys) for x in data]
        return type(data)(*moved) if hasattr(data, "_fields") else type(data)(moved)
    if isinstance(data, Mapping):
        skip = [skip_keys] if isinstance(skip_keys, str) else (skip_keys or [])
        moved_map = {k: v if k in skip else send_to_device(v, device, non_blocking, skip_keys)
                     for k, v in data.items()}
        try:
            rebuild: Callable[[Dict[Any, Any]], Any] = type(data)  # a Mapping subclass takes a dict
            return rebuild(moved_map)
        except TypeError:  # e.g. defaultdict: keep the values, lose the factory
            return moved_map
    return data


# --------------------------------------------------------------------------------------------
# The facts about each device type
# --------------------------------------------------------------------------------------------


@lazyclass.dataclass(frozen=True)
class DeviceFacts:
    """What the environment and the modules above the backends need to know about one device type.

    ``count``: devices of this type this process can see, asked without starting their runtime
    (0: none); ``indexed``: a process uses one of them by index (``cuda:1``; local rank modulo
    ``count``). ``preference``: higher is tried first when the environment picks a device.
    ``communication``: the torch.distributed backend of a job of several processes on this device,
    None when it has none (the processes then use the CPU with gloo, with a warning).
    ``one_process_per_device``: the communication backend refuses two ranks on one device (NCCL):
    more processes than visible devices on a machine then use gloo instead, with a warning.
    ``selected_by``: the detector source that selects this device outright (its runtime owns the
    topology), None otherwise; ``owns_processes``: that runtime forms the group itself (no
    torch.distributed group is created by anyaccel). ``precisions``: mixed precisions it runs,
    most useful first. ``distributed_type``: the name of the Accelerate ``DistributedType`` of a
    job of several processes on it. ``config_name``: its name in the config file and the wizard.
    ``profiler_activity``: its ``torch.profiler.ProfilerActivity`` name, None when the profiler
    has none. ``has_storage``: its tensors expose a storage pointer (tied weights found by it).
    ``rng_names``: Accelerate ``rng_types`` names that mean this device. ``label``: what messages
    call one such device ("GPU"). ``memory``: ``(free, total)`` bytes of the device of that
    index (big-model device maps budget with it), None when torch cannot say. ``describe``: what
    ``anyaccel env`` says of the device of that index (its model and memory), None: nothing more
    than that it is there."""

    device_type: str
    count: Callable[[], int]
    indexed: bool = False
    preference: int = 0
    communication: Optional[str] = None
    one_process_per_device: bool = False
    selected_by: Optional[str] = None
    owns_processes: bool = False
    precisions: Tuple[str, ...] = ("no", "fp16", "bf16")
    distributed_type: str = "MULTI_CPU"
    config_name: Optional[str] = None
    profiler_activity: Optional[str] = None
    has_storage: bool = True
    rng_names: Tuple[str, ...] = ()
    label: str = ""
    memory: Optional[Callable[[int], Tuple[int, int]]] = None
    describe: Optional[Callable[[int], str]] = None

    @property
    def name(self) -> str:
        """How messages call one such device (``label``, else the device type)."""
        return self.label or self.device_type


if TYPE_CHECKING:
    _DEVICES: Dict[str, DeviceFacts]
_MAKING = threading.Lock()


def _devices() -> Dict[str, DeviceFacts]:
    """The registry ``{device type: facts}``, made with the built-in devices (:func:`_built_in`)
    the first time anything reads or registers one (not at import: the import budget);
    ``_DEVICES`` from then on. Local; made once under a lock."""
    return lazyclass.made_once(globals(), "_DEVICES", _MAKING,
                               lambda: {facts.device_type: facts for facts in _built_in()})


if not TYPE_CHECKING:  # (hidden from type checkers: a module __getattr__ would type every misspelt name Any)
    __getattr__, __dir__ = lazyclass.module_attributes(__name__, globals(), {"_DEVICES": _devices})


def register_device(facts: DeviceFacts) -> None:
    """Make a device type known to the environment (replaces an entry of the same type). Called
    by :func:`anyaccel.backends.register_backend`; Local."""
    _devices()[facts.device_type] = facts


def device_facts(device_type: str) -> DeviceFacts:
    """The facts of ``device_type``; ``ValueError`` naming the known types otherwise."""
    devices = _devices()
    facts = devices.get(device_type)
    if facts is None:
        raise ValueError(f"unknown device type {device_type!r}; known: {', '.join(sorted(devices))}")
    return facts


def known_devices() -> List[DeviceFacts]:
    """Every registered device type, most preferred first (the CPU last)."""
    return sorted(_devices().values(), key=lambda f: -f.preference)


def _cuda_count() -> int:  # looked up when called, so a replaced probe is the one asked
    return cuda_device_count()


def _cuda_memory(index: int) -> Tuple[int, int]:
    free, total = torch.cuda.mem_get_info(index)
    return int(free), int(total)


def _cuda_describe(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    return f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"


def _mps_count() -> int:
    return 1 if mps_available() else 0


def _xla_count() -> int:
    return 0  # selected by its runtime's launcher (selected_by), never by counting


def _cpu_count() -> int:
    return 1


def _built_in() -> Tuple[DeviceFacts, ...]:
    """The built-in devices' facts, registered when the registry is first used."""
    # fp8 on the CPU is torchao's emulation (no fp8 matmul there: for testing, anyaccel.precision_fp8 says so once)
    return (
        DeviceFacts("cpu", _cpu_count, preference=0, communication="gloo", precisions=("no", "bf16", "fp16", "fp8"),
                    config_name="cpu", profiler_activity="cpu", rng_names=("torch", "generator"), label="CPU"),
        DeviceFacts("cuda", _cuda_count, indexed=True, preference=30, communication="nccl", one_process_per_device=True,
                    precisions=("no", "fp16", "bf16", "fp8"), distributed_type="MULTI_GPU", config_name="gpu",
                    profiler_activity="cuda", rng_names=("cuda",), label="GPU", memory=_cuda_memory,
                    describe=_cuda_describe),
        DeviceFacts("mps", _mps_count, preference=20, communication=None, config_name="mps", rng_names=("mps",),
                    label="Apple MPS device"),
        DeviceFacts("xla", _xla_count, preference=40, communication="xla", selected_by="xla", owns_processes=True,
                    precisions=("no", "bf16"), distributed_type="XLA", config_name="tpu", has_storage=False,
                    rng_names=("xla",), label="TPU"),
    )
