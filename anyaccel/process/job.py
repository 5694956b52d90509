"""Where this process stands in the job: :func:`resolve_job_environment` and :class:`JobView`.

:func:`resolve_job_environment` is the one way an ``Accelerator`` (through :func:`anyaccel.runtime.start_runtime`)
and Accelerate's ``PartialState`` (:mod:`anyaccel.compat.state`) turn the launcher's variables into the frozen
:class:`~anyaccel.environment.Environment` they use: the detectors' answer, the launcher's ``--cpu``, a backend
the user chose, completed by the device backend. :class:`JobView` is what every object that stands for a
process answers from that environment (ranks, main process, world size), written once: the ``Accelerator``
and the state views both are one. Local: nothing here communicates.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .. import envvars
from ..backends import backend_class
from ..environment import Environment, resolve_environment

__all__ = ["JobView", "resolve_job_environment"]


def resolve_job_environment(cpu: Optional[bool] = None, backend: Optional[str] = None) -> Environment:
    """The :class:`Environment` of this process as ``Accelerator`` uses it: the launcher's
    variables (:func:`~anyaccel.environment.resolve_environment`), ``cpu`` defaulting to
    ``anyaccel launch --cpu``, ``backend`` (a communication backend
    the user chose, e.g. ``"gloo"``) for a multi-process job, completed by the device backend. Local: reads the environment only."""
    launcher = envvars.worker_settings()
    env = resolve_environment(cpu=cpu if cpu is not None else launcher.cpu)
    if backend and env.world_size > 1:
        env = dataclasses.replace(env, backend=backend)
    refined: Environment = backend_class(env.device_type).refine_environment(env)
    return refined



class JobView:
    """Where this process stands in the job, read from its :class:`Environment` (``_env``):
    what ``Accelerator``, ``PartialState`` and ``AcceleratorState`` all answer, written once.
    Local; every answer is fixed for the life of the process."""

    _env: Environment

    @property
    def environment(self) -> Environment:
        """The resolved, immutable :class:`~anyaccel.environment.Environment`. Local."""
        return self._env

    @property
    def num_processes(self) -> int:
        """How many processes the job has (the world size; 1 without a launcher). Local."""
        return self._env.world_size

    @property
    def process_index(self) -> int:
        """This process's rank in the job, ``0`` to ``num_processes - 1`` (0 is the main process). Local."""
        return self._env.rank

    @property
    def local_process_index(self) -> int:
        """This process's rank on its machine, ``0`` to the processes per machine ``- 1`` (the GPU it
        uses on a GPU machine). Local."""
        return self._env.local_rank

    @property
    def is_main_process(self) -> bool:
        """True on the one process of the job with rank 0 (where to print, log, write shared files). Local."""
        return self._env.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        """True on the process with local rank 0 of each machine (one per machine: per-machine
        downloads, node-local files). Local."""
        return self._env.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        """True on the process with the highest rank (``num_processes - 1``). Local."""
        return self._env.is_last_process

    @property
    def use_distributed(self) -> bool:
        """True when the job has more than one process (a process group is used). Local."""
        return self._env.is_distributed
