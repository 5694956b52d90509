"""The distributed environment, resolved once into one immutable object.

Every process calls :func:`resolve_environment` (``Accelerator()`` does it for you). It reads
environment variables only, is a pure function of the mapping it is given, and never initialises
CUDA, so a later ``fork`` (notebook launcher) still works.

Sources, first match wins:

1. **torchrun / torch elastic** (``anyaccel launch``, ``torchrun``, ``torch.distributed.launch``):
   ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
   ``MASTER_ADDR``, ``MASTER_PORT``.
2. **SLURM ``srun``**: ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS``, ``SLURM_NODEID``,
   ``SLURM_NNODES``, ``SLURM_NODELIST`` (first host, ranges such as ``gpu[07-08,11]`` expanded, is
   the main address). Without ``MASTER_PORT`` the port is derived from ``SLURM_JOB_ID`` so that all
   tasks of one job agree and two jobs on one node do not collide. A batch script (``sbatch``) that
   runs Python directly, without ``srun``, is *not* a multi-process job: it resolves to one process
   with a warning instead of waiting forever for tasks that were never started.
3. **Open MPI / MPICH / Intel MPI (PMI)**: ``OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE`` or
   ``PMI_RANK/PMI_SIZE`` (+ ``MPI_LOCALRANKID``). ``MASTER_ADDR`` defaults to ``127.0.0.1`` only when
   every rank is on this node; otherwise it must be given.
4. **XLA** (``PJRT_DEVICE``/``TPU_*`` with torch-xla installed): world size is owned by torch-xla.
5. Otherwise one process.

Set ``ANYACCEL_DISABLE_SLURM=1`` to ignore SLURM variables (e.g. an interactive job running a
launcher of its own) and ``ANYACCEL_DISABLE_MPI=1`` likewise for MPI.

The sources are the detectors of :mod:`anyaccel.detectors` (a registry you can extend); the
device is chosen here from the probes of :mod:`anyaccel.devices`.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any, Mapping, Optional, Sequence, Tuple

from .. import envvars, lazyclass
from .detectors import Detector, LaunchFacts, Topology, detect_topology, launch_facts
from ..errors import JobEnvironmentError

__all__ = ["DistributedType", "Environment", "resolve_environment"]


class DistributedType(str, enum.Enum):
    """How the job is distributed; names match Accelerate's ``DistributedType``.

    anyaccel produces ``NO``, ``MULTI_CPU``, ``MULTI_GPU``, ``XLA`` (from the environment) and
    ``FSDP`` (``AcceleratorState.distributed_type`` under ``strategy="fsdp"``). The other members
    exist so that scripts comparing against them keep working; anyaccel never reports them."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    XLA = "XLA"
    FSDP = "FSDP"
    DEEPSPEED = "DEEPSPEED"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_XPU = "MULTI_XPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.value


@lazyclass.dataclass(frozen=True)
class Environment:
    """Where this process sits in the job. Immutable; resolved once per ``Accelerator``.

    ``source`` tells which launcher the values came from: ``"torchrun"``, ``"slurm"``, ``"mpi"``,
    ``"xla"`` or ``"single"``. ``launch``: the launchers' facts about the run (run id, restart
    attempt, maximum restarts, SLURM job and requeue ids; :class:`~anyaccel.detectors.LaunchFacts`),
    read once here so that nothing else reads launcher variables.
    """

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    main_address: str = "127.0.0.1"
    main_port: Optional[int] = None
    device_type: str = "cpu"
    device_index: Optional[int] = None
    backend: Optional[str] = None
    source: str = "single"
    warnings: Tuple[str, ...] = ()
    launch: LaunchFacts = dataclasses.field(default_factory=LaunchFacts)  # (made when first used, not at import)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_rank == 0

    @property
    def is_last_process(self) -> bool:
        return self.rank == self.world_size - 1

    @property
    def device(self) -> str:
        """The device string, e.g. ``"cuda:1"`` or ``"cpu"``."""
        if self.device_index is None:
            return self.device_type
        return f"{self.device_type}:{self.device_index}"

    @property
    def distributed_type(self) -> DistributedType:
        """Accelerate's name for this job: ``NO`` for one process, else the device's (its
        :class:`~anyaccel.devices.DeviceFacts`; a device whose runtime owns its processes, XLA,
        names the job even with one process)."""
        from .devices import device_facts

        try:
            facts = device_facts(self.device_type)
        except ValueError:  # a device type registered without facts
            return DistributedType.NO if self.world_size <= 1 else DistributedType.MULTI_CPU
        if self.world_size <= 1 and not facts.owns_processes:
            return DistributedType.NO
        return DistributedType(facts.distributed_type)

    def describe(self) -> str:
        """A one-paragraph human summary (used by ``anyaccel env`` and error messages)."""
        port = self.main_port if self.main_port is not None else "-"
        lines = [
            f"source={self.source} world_size={self.world_size} rank={self.rank} "
            f"local_rank={self.local_rank}/{self.local_world_size} node={self.node_rank}/{self.num_nodes}",
            f"main={self.main_address}:{port} device={self.device} backend={self.backend or '-'}",
        ]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Device choice
# --------------------------------------------------------------------------------------------


def _choose_device(env: Mapping[str, str], topo: Topology,
                   force_cpu: bool) -> Tuple[str, Optional[int], Optional[str], Tuple[str, ...]]:
    """Return (device_type, device_index, backend, warnings) from the device facts of
    :mod:`anyaccel.devices`, most preferred device first. Never starts a device runtime."""
    from . import devices

    world = topo.world_size
    warnings: Tuple[str, ...] = ()
    backend: Optional[str]
    cpu = devices.device_facts("cpu")
    for facts in ([] if force_cpu else devices.known_devices()):
        if facts is cpu:
            break
        if facts.selected_by is not None:  # its runtime's launcher decides (XLA)
            if topo.source == facts.selected_by:
                return facts.device_type, None, facts.communication, ()
            continue
        count = facts.count()
        if count <= 0:
            continue
        index = topo.local_rank % count if facts.indexed else None
        if world <= 1:
            return facts.device_type, index, None, ()
        if facts.communication is None:
            warnings = (
                f"{world} processes were started but the {facts.name} has no multi-process communication "
                f"backend: every process uses the CPU ({cpu.communication}). Run a single process to train on "
                f"the {facts.name}.",
            )
            break
        backend, warnings = facts.communication, ()
        if facts.one_process_per_device and _shares_devices(env, topo, facts, count):
            backend = cpu.communication
            warnings = (
                f"{topo.local_world_size} processes on this node share {count} visible {facts.name}(s); using the "
                f"{backend} backend because {facts.communication.upper()} cannot put two ranks on one {facts.name}. "
                f"If each process has {facts.name}s of its own that the others cannot see (a launcher that binds "
                f"{facts.name}s to processes), set ANYACCEL_BACKEND={facts.communication}.",
            )
        return facts.device_type, index, backend, warnings
    return cpu.device_type, None, (cpu.communication if world > 1 else None), warnings


def _shares_devices(env: Mapping[str, str], topo: Topology, facts: Any, count: int) -> bool:
    """More processes on this node than devices in view: either they share devices, or the
    launcher gave each its own and hid the others (SLURM ``--gpus-per-task`` / ``--gpu-bind``: then
    the step has a device per task on this node). Not assumed when no launcher said how many
    processes share the machine, nor when ``ANYACCEL_BACKEND`` asks for the device's backend."""
    local_world = topo.local_world_size
    bound = topo.gpus_on_node is not None and topo.gpus_on_node >= local_world
    return (local_world > count and not bound and not topo.local_world_guessed
            and envvars.read(envvars.BACKEND, env) != facts.communication)


def resolve_environment(env: Optional[Mapping[str, str]] = None, *, cpu: Optional[bool] = None,
                        detectors: Optional[Sequence[Detector]] = None) -> Environment:
    """Read the launcher's variables (``os.environ`` by default) and return the :class:`Environment`.

    Called independently by every process; each gets its own rank, all agree on world size and main
    address/port. ``cpu=True`` (or ``ANYACCEL_USE_CPU=1``) forces the CPU even when GPUs are visible.
    A backend may be forced with ``ANYACCEL_BACKEND=gloo|nccl``. ``detectors`` replaces the
    registered ones (:func:`anyaccel.detectors.detectors`). Local and pure: only reads ``env``. Raises
    :class:`~anyaccel.errors.JobEnvironmentError` when the variables describe an impossible job.
    """
    from .detectors import detectors as registered

    env = os.environ if env is None else env
    force_cpu = bool(cpu) if cpu is not None else envvars.read(envvars.USE_CPU, env)
    asked = registered() if detectors is None else detectors
    topo = detect_topology(env, asked) or Topology()
    _validate(topo)
    device_type, index, backend, dev_warnings = _choose_device(env, topo, force_cpu)
    forced_backend = envvars.read(envvars.BACKEND, env)
    if forced_backend and topo.world_size > 1:
        backend = forced_backend
    placement = topo.placement()
    placement["warnings"] = topo.warnings + dev_warnings
    return Environment(device_type=device_type, device_index=index, backend=backend,
                       launch=launch_facts(env, asked), **placement)


def _validate(topo: Topology) -> None:
    world, rank, source = topo.world_size, topo.rank, topo.source
    if world is None or world < 1:
        raise JobEnvironmentError(f"{source}: world size {world} must be at least 1")
    if rank is None or not 0 <= rank < world:
        raise JobEnvironmentError(f"{source}: rank {rank} is outside 0..{world - 1} (world size {world})")
    local_rank, local_world = topo.local_rank, topo.local_world_size
    if not 0 <= local_rank < max(local_world, 1):
        raise JobEnvironmentError(
            f"{source}: local rank {local_rank} is outside 0..{local_world - 1} (processes on this node)"
        )
