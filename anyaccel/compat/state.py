"""``PartialState`` and ``AcceleratorState``: Accelerate's state objects, as read-only views.

Accelerate keeps the job's state in process-wide Borg singletons that every ``Accelerator`` shares
(and that leak between loops). Here a state is a small *view* over the frozen
:class:`~anyaccel.environment.Environment`: creating one is cheap, two views of one job answer
the same, and nothing is shared through them.

* ``PartialState()`` works in any launched process, with or without an ``Accelerator``: it
  resolves the environment exactly as ``Accelerator()`` does
  (:func:`anyaccel.job.resolve_job_environment`),
  selects this process's device and joins the process group (collective the first time, like
  ``Accelerator()``; later calls only read).
* ``accelerator.state`` is the ``AcceleratorState`` of that ``Accelerator`` (its mixed precision,
  its strategy's distributed type). ``AcceleratorState()`` built directly resolves like
  ``PartialState`` and takes mixed precision from ``anyaccel launch`` (else ``"no"``).

Attributes cannot be assigned (``AttributeError``): the job is what the launcher started. Two
exceptions, because Accelerate's own scripts assign them: ``debug`` (Accelerate's shape checks:
anyaccel always checks the shapes of its collectives, see :mod:`anyaccel.ops`, so ``debug = True``
changes nothing and ``debug = False`` warns), and ``AcceleratorState.distributed_type``, which
warns and then changes only what that ``Accelerator`` *reports* (its ``distributed_type``, and
``join_uneven_inputs``, which reads it as Accelerate's does) — never how it wraps models or runs.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Optional

import torch

from .. import envvars, ops
from ..process import process_group
from ..training.accumulation import GradientState  # Accelerate's module path: accelerate.state.GradientState
from ..backends import create_backend
from ..environment import DistributedType, Environment
from ..process.job import JobView, resolve_job_environment  # where a process stands: the core's, shared with Accelerator

__all__ = ["JobView", "PartialState", "AcceleratorState", "GradientState", "resolve_job_environment", "is_initialized"]


def split(inputs: Any, n: int, i: int, pad: bool) -> Any:
    """Rank ``i``'s contiguous share of ``inputs`` (list, tuple, tensor, dict of them) among
    ``n``: the first ranks get one more element when it does not divide; ``pad`` repeats the last
    element so every share has the same length. Local."""
    if isinstance(inputs, dict):
        return {k: split(v, n, i, pad) for k, v in inputs.items()}
    length = len(inputs)
    base, extra = divmod(length, n)
    start = i * base + min(i, extra)
    size = base + (1 if i < extra else 0)
    part = inputs[start: start + size]
    if pad and extra and size < base + 1 and length:
        if isinstance(inputs, torch.Tensor):
            part = torch.cat([part, inputs[-1:]], dim=0)
        elif isinstance(part, list):
            part = part + list(inputs[-1:])
        else:
            part = part + type(part)(inputs[-1:])
    return part


class _View(JobView):
    """What every state answers; subclasses fill ``_env`` and ``_device`` in ``__init__``."""

    _device: torch.device
    _frozen = False

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "debug":
            if not value:
                warnings.warn("anyaccel always checks that ranks call the same collective with matching shapes "
                              "(a small header exchanged with each call); debug=False does not turn that off — pass "
                              "check=False to the ops on a hot path instead", stacklevel=2)
            return
        if name == "distributed_type" and isinstance(self, AcceleratorState):
            warnings.warn(f"AcceleratorState.distributed_type set to {value}: this changes what this Accelerator "
                          "reports (accelerator.distributed_type, and join_uneven_inputs, which then runs without "
                          "Join as Accelerate does) — not how models are wrapped or how the job runs", stacklevel=2)
            object.__setattr__(self, "_distributed_type", DistributedType(value))
            return
        if self._frozen:
            raise AttributeError(
                f"{type(self).__name__}.{name} cannot be set: the state is a read-only view of the job the launcher "
                "started (and of the Accelerator's arguments); change the launch or Accelerator(...) instead")
        object.__setattr__(self, name, value)

    def _freeze(self) -> None:
        object.__setattr__(self, "_frozen", True)

    # ---- who am I ---------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def num_nodes(self) -> int:
        return self._env.num_nodes

    @property
    def distributed_type(self) -> DistributedType:
        return self._env.distributed_type

    @property
    def backend(self) -> Optional[str]:
        """The torch.distributed backend (``"gloo"``, ``"nccl"``), None for one process."""
        return self._env.backend

    @property
    def initialized(self) -> bool:
        return True

    @property
    def debug(self) -> bool:
        """Always True: anyaccel's collectives always check shapes (see the module docstring)."""
        return True

    @property
    def fork_launched(self) -> bool:
        return False

    def __repr__(self) -> str:
        return (f"Distributed environment: {self.distributed_type.value}{'  Backend: ' + self.backend if self.backend else ''}\n"
                f"Num processes: {self.num_processes}\nProcess index: {self.process_index}\n"
                f"Local process index: {self.local_process_index}\nDevice: {self.device}\n")

    # ---- doing things on some processes ------------------------------------------------------
    def wait_for_everyone(self) -> None:
        """Barrier: returns on each rank once every rank has called it. Collective."""
        ops.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only (one line per node). Local."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False):
        """Each rank gets a contiguous share of ``inputs`` (list, tuple, tensor or dict of them):
        the first ranks get one more element when it does not divide; ``apply_padding`` repeats
        the last element so that every share has the same length. Local (no communication)."""
        yield split(inputs, self.num_processes, self.process_index, apply_padding)

    @contextlib.contextmanager
    def main_process_first(self):
        """Rank 0 runs the block first, the others after it. Collective: every rank enters it."""
        with self._first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self):
        """Local rank 0 of each node runs the block first, the others after it. Collective."""
        with self._first(self.is_local_main_process):
            yield

    @contextlib.contextmanager
    def _first(self, first: bool):
        if not first:
            self.wait_for_everyone()
        yield
        if first:
            self.wait_for_everyone()

    def _only(self, function: Optional[Callable], runs: bool) -> Callable:
        def decorate(fn: Callable) -> Callable:
            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                return fn(*args, **kwargs) if runs else None

            return wrapper

        return decorate(function) if function is not None else decorate

    def on_main_process(self, function: Optional[Callable] = None) -> Callable:
        """Decorator: ``function`` runs on rank 0 only; the others get None. Local."""
        return self._only(function, self.is_main_process)

    def on_local_main_process(self, function: Optional[Callable] = None) -> Callable:
        """Decorator: ``function`` runs on local rank 0 of each node only; the others get None. Local."""
        return self._only(function, self.is_local_main_process)

    def on_last_process(self, function: Optional[Callable] = None) -> Callable:
        """Decorator: ``function`` runs on the last rank (``num_processes - 1``) only; the others
        get None. Local."""
        return self._only(function, self.is_last_process)

    def on_process(self, function: Optional[Callable] = None, process_index: Optional[int] = None) -> Callable:
        """Decorator: ``function`` runs on rank ``process_index`` only; the others get None. Local."""
        return self._only(function, self.process_index == _index(process_index, "process_index"))

    def on_local_process(self, function: Optional[Callable] = None, local_process_index: Optional[int] = None) -> Callable:
        """Decorator: ``function`` runs on local rank ``local_process_index`` of each node only;
        the others get None. Local."""
        return self._only(function, self.local_process_index == _index(local_process_index, "local_process_index"))

    def destroy_process_group(self, group: Any = None) -> None:
        """Leave the default process group if anyaccel created it, or ``group``: torch forgets it (a
        new one can be joined) and the object lives until the process ends (a destructor run here
        could hang: :mod:`anyaccel.process_group`). Local."""
        if group is None:
            process_group.destroy_process_group()
        else:
            process_group.retire(group)

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        """Nothing to reset: anyaccel keeps no process-wide state (Accelerate's scripts call this
        between ``Accelerator`` objects; here each one is independent already)."""


def is_initialized() -> bool:
    """Accelerate's ``accelerate.state.is_initialized()`` (diffusers' scripts ask it before reading
    ``AcceleratorState().deepspeed_plugin``): always True in anyaccel, whose state objects are
    views of the resolved environment that work in any process, with or without an
    ``Accelerator`` (``PartialState().initialized`` is True too). Local."""
    return True


def _index(value: Optional[int], name: str) -> int:
    if value is None:
        raise TypeError(f"on_process needs {name}=<int> (which rank runs the function)")
    return int(value)


class PartialState(_View):
    """This process's place in the job, usable before or without an ``Accelerator``.

    Every process calls it; the first call in a multi-process job selects the device and joins
    the process group (collective, like ``Accelerator()``), later ones only read. ``cpu=True``
    forces the CPU. Other Accelerate keywords (``backend``, ``timeout``) are applied to the group
    when this call creates it. (The group gets the environment's backend: FSDP with CPU offload on
    GPUs needs ``cuda:nccl,cpu:gloo``, so create that ``Accelerator`` before any ``PartialState``.)"""

    def __init__(self, cpu: bool = False, backend: Optional[str] = None, timeout: Any = None, **kwargs: Any):
        if kwargs:
            raise TypeError(f"PartialState() got unknown arguments {sorted(kwargs)}; it accepts cpu, backend, timeout")
        env = resolve_job_environment(cpu=cpu or None, backend=backend)
        device = create_backend(env).setup()
        process_group.ensure_process_group(env, timeout_s=timeout.total_seconds() if timeout is not None else None)
        object.__setattr__(self, "_env", env)
        object.__setattr__(self, "_device", torch.device(device))
        self._freeze()


class AcceleratorState(PartialState):
    """The state of an ``Accelerator``: :class:`PartialState` plus its mixed precision and the
    distributed type of its strategy (``FSDP`` under ``strategy="fsdp"``). ``accelerator.state``
    returns the one of that accelerator; ``AcceleratorState()`` resolves the job like
    ``PartialState()`` with mixed precision from ``anyaccel launch`` (else ``"no"``). Local
    (collective only when it creates the process group)."""

    def __init__(self, mixed_precision: Optional[str] = None, cpu: bool = False, **kwargs: Any):
        super().__init__(cpu=cpu, **kwargs)
        object.__setattr__(self, "_frozen", False)
        from .. import precision

        self._mixed_precision = precision.normalize(mixed_precision or envvars.worker_settings().mixed_precision)
        self._strategy_type = None
        self._plugins = {}
        self._distributed_type = None
        self._freeze()

    @classmethod
    def of(cls, env: Environment, device: Any, mixed_precision: str, strategy: Any,
           plugins: Optional[dict] = None) -> "AcceleratorState":
        """The view for an ``Accelerator`` that already resolved and joined (no work); ``strategy``
        is its :class:`~anyaccel.strategies.base.Strategy`, which says what distributed type to
        report. Local."""
        self = object.__new__(cls)
        for name, value in (("_env", env), ("_device", torch.device(device)), ("_mixed_precision", mixed_precision),
                            ("_strategy_type", strategy.distributed_type), ("_plugins", dict(plugins or {}))):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_distributed_type", None)
        self._freeze()
        return self

    @property
    def mixed_precision(self) -> str:
        return self._mixed_precision

    @property
    def distributed_type(self) -> DistributedType:
        """The strategy's (``FSDP`` under ``strategy="fsdp"``, else the environment's); or what was
        assigned (see the module docstring)."""
        if self._distributed_type is not None:
            return self._distributed_type
        return self._strategy_type or self._env.distributed_type

    @property
    def fsdp_plugin(self) -> Any:
        return self._plugins.get("fsdp")

    @property
    def dynamo_plugin(self) -> Any:
        return self._plugins.get("dynamo")

    @property
    def deepspeed_plugin(self) -> Any:
        """The ``DeepSpeedPlugin`` given to the accelerator (``Accelerator(deepspeed_plugin=...)``), or None."""
        return self._plugins.get("deepspeed")

    @property
    def use_ipex(self) -> bool:
        return False

    def __repr__(self) -> str:
        return super().__repr__() + f"\nMixed precision type: {self.mixed_precision}\n"
