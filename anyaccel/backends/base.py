"""The Backend interface: everything anyaccel needs to know about one kind of device.

One subclass per device type, one file each (``cpu.py``, ``cuda.py``, ``mps.py``, ``xla.py``),
registered in :mod:`anyaccel.backends`. The ``Accelerator`` creates one backend per instance from
the resolved :class:`~anyaccel.environment.Environment` (:func:`anyaccel.backends.create_backend`);
``ops``, ``data``, ``checkpoint``, ``precision`` and ``memory`` ask it instead of testing device
types.

Two kinds of members:

* **per job** (instance methods; the backend knows the environment): selecting the device, moving a
  model, feeding a prepared loader's batches to the device, autocast and the gradient scaler,
  synchronising, memory statistics, preparing an object for saving.
* **per process** (class methods; usable without an ``Accelerator``, e.g. by ``set_seed`` or
  ``free_memory``): RNG state, seeding, emptying caches. They act only when the device runtime has
  been started in this process (see :func:`anyaccel.backends.started_backends`).

The collective transport a backend's tensors travel on is a :class:`Transport`
(:mod:`anyaccel.backends.transport`).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Dict, Iterable, Optional, Tuple

import torch

from ..environment.devices import device_facts, send_to_device

__all__ = ["Backend"]


class Backend:
    """Default behaviour, right for devices with a plain PyTorch runtime; subclasses override.

    Create with :func:`anyaccel.backends.create_backend`; call :meth:`setup` once before use.
    """

    #: torch's device type string ("cpu", "cuda", ...), also the registry key.
    device_type: ClassVar[str] = ""
    #: device type passed to ``torch.autocast``.
    autocast_device_type: ClassVar[str] = ""
    #: True when the backend starts its own worker processes (``notebook_launcher`` delegates).
    spawns_processes: ClassVar[bool] = False
    #: the strategy used when none is asked for (None: DDP for several processes, else single)
    default_strategy: ClassVar[Optional[str]] = None

    def __init__(self, env: Any):
        self.env = env
        self.device: Optional[torch.device] = None

    @property
    def precisions(self) -> Tuple[str, ...]:
        """Mixed precisions this device can run (its :class:`~anyaccel.devices.DeviceFacts`)."""
        try:
            return device_facts(self.device_type).precisions
        except ValueError:  # a backend registered without facts
            return ("no", "fp16", "bf16")

    # ---- per process ------------------------------------------------------------------------
    @classmethod
    def refine_environment(cls, env: Any) -> Any:
        """Return ``env`` completed with what only the device runtime knows (XLA's replica
        topology). Local; called once by each ``Accelerator`` before :meth:`setup`."""
        return env

    @classmethod
    def get_rng_state(cls) -> Optional[Any]:
        """This process's RNG state on this device type, or None when it has none. Local."""
        return None

    @classmethod
    def set_rng_state(cls, state: Any) -> None:
        """Restore what :meth:`get_rng_state` returned. Local."""

    @classmethod
    def manual_seed(cls, seed: int) -> None:
        """Seed this device type's RNG (``torch.manual_seed`` covers the CPU). Local."""

    @classmethod
    def empty_cache(cls) -> None:
        """Return cached device memory to the driver. Local."""

    # ---- per job ----------------------------------------------------------------------------
    def setup(self) -> torch.device:
        """Select this process's device (``set_device`` where the runtime has one) and return it.
        Local; called once by the ``Accelerator``."""
        self.device = torch.device(self.env.device)
        return self.device

    def move_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` on this backend's device; returns the model. Local."""
        return model.to(self.device)

    def feed(self, batches: Iterable[Any]) -> Iterable[Any]:
        """How a prepared loader's batches reach the device: wraps the iterable of this rank's
        host batches. Local; the caller counts what it yields (so positions are what the training
        loop consumed, whatever a background thread read ahead)."""
        device = self.device
        return (send_to_device(batch, device, non_blocking=True) for batch in batches)

    def synchronize(self) -> None:
        """Wait until the queued work on this process's device is done. Local."""

    def check_precision(self, precision: str, warn: bool = True) -> str:
        """Raise ``ValueError`` naming ``precision`` when this device cannot run it; return it."""
        if precision not in self.precisions:
            raise ValueError(f"mixed_precision={precision!r} is not supported on {self.device_type} devices; "
                             f"choose one of {', '.join(self.precisions)}")
        return precision

    def fp8_support(self) -> Tuple[str, str]:
        """How this device trains in fp8 (``mixed_precision="fp8"``), and what it is, for messages:
        ``"matmul"`` (it multiplies in fp8), ``"emulate"`` (only torchao's emulation runs here, the
        default: the CPU, for testing) or ``"none"`` (no fp8 matmul, and emulation would be slower
        than its bf16: refused unless asked for). Default ``"none"``. Local."""
        return "none", f"{self.device_type} devices have no fp8 matmul"

    def make_scaler(self, precision: str, **kwargs: Any) -> Optional[torch.amp.GradScaler]:
        """The fp16 gradient scaler for this device, or None when the precision needs none."""
        if precision != "fp16":
            return None
        return torch.amp.GradScaler(self.autocast_device_type or self.device_type, **kwargs)

    def memory_stats(self) -> Dict[str, int]:
        """Bytes allocated now and at peak on this process's device (empty when unknown). Local."""
        return {}

    def reset_peak_memory(self) -> None:
        """Start a new peak for :meth:`memory_stats`. Local."""

    def host_copy(self, obj: Any, is_main: bool) -> Any:
        """``obj`` ready for ``torch.save`` by the main process. Called by every process that
        calls ``Accelerator.save`` (on XLA, moving to the host runs pending graphs that may hold
        collectives, so every replica must take part). Default: ``obj`` itself."""
        return obj

    def spawn(self, function: Callable[..., Any], args: Tuple[Any, ...], nprocs: Optional[int]) -> Any:
        """Start ``nprocs`` processes running ``function(*args)`` (backends with
        ``spawns_processes``). Called once by the launching process."""
        raise NotImplementedError(f"the {self.device_type} backend does not start processes itself")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device})"

