"""Where a process sits in its job, read from each launcher's own variables: one small pure class
per launcher, in a registry that :func:`anyaccel.environment.resolve_environment` walks in order
(first match wins).

A detector maps the environment variables to a *topology*: a dict with some of ``source``,
``world_size``, ``rank``, ``local_rank``, ``local_world_size``, ``node_rank``, ``num_nodes``,
``main_address``, ``main_port``, ``warnings`` (the other fields of
:class:`~anyaccel.environment.Environment` keep their defaults), or None when its launcher did not
start this process. Detectors only read the mapping they are given.

Add your own (a cluster scheduler we do not know) with :func:`register_detector`::

    class MyScheduler(Detector):
        name = "mysched"
        def detect(self, env):
            if "MYSCHED_RANK" not in env:
                return None
            return dict(source=self.name, rank=int(env["MYSCHED_RANK"]), world_size=int(env["MYSCHED_SIZE"]),
                        main_address=env["MYSCHED_HEAD"], main_port=29500)

    register_detector(MyScheduler(), before="slurm")
"""

from __future__ import annotations

import importlib.util
from typing import List, Mapping, Optional

from . import envvars, network
from .errors import JobEnvironmentError
from .slurm import read_slurm

__all__ = ["Detector", "TorchrunDetector", "SlurmDetector", "MpiDetector", "XlaDetector", "detectors",
           "register_detector"]


def _int(env: Mapping[str, str], key: str, default: Optional[int] = None) -> Optional[int]:
    value = env.get(key)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise JobEnvironmentError(f"environment variable {key}={value!r} is not an integer") from None


class Detector:
    """One launcher's variables → a topology dict, or None when that launcher did not start us."""

    name: str = ""

    def detect(self, env: Mapping[str, str]) -> Optional[dict]:
        raise NotImplementedError


class TorchrunDetector(Detector):
    """torchrun / torch elastic / ``torch.distributed.launch`` / ``anyaccel launch``: ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``. Launchers that set fewer of them are read as follows:

    * ``MASTER_ADDR`` unset or a loopback address: every rank is on this machine (``LOCAL_RANK``
      defaults to ``RANK``);
    * else without ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (a Kubernetes training operator sets
      ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): ``NNODES`` / ``GROUP_WORLD_SIZE``
      machines when set (ranks in blocks per machine), else one process per machine (pod);
    * ``LOCAL_RANK`` with a node rank but no local size or node count: several machines of unknown
      size (the device choice then does not assume that GPUs are shared)."""

    name = "torchrun"

    def detect(self, env: Mapping[str, str]) -> Optional[dict]:
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        world, rank = _int(env, "WORLD_SIZE"), _int(env, "RANK")
        nodes = _int(env, "GROUP_WORLD_SIZE", None) or _int(env, "NNODES", None) or _int(env, "PET_NNODES", None)
        node_rank = _int(env, "GROUP_RANK", None)
        if node_rank is None:
            node_rank = _int(env, "NODE_RANK", None)
        local_world = _int(env, "LOCAL_WORLD_SIZE", None)
        local_rank = _int(env, "LOCAL_RANK", None)
        known = True
        if local_world is None and network.names_this_machine(env.get("MASTER_ADDR", "127.0.0.1")):
            local_world, nodes = max(1, world), 1
        elif local_world is None:
            if nodes:
                local_world = -(-world // nodes)
            elif local_rank is None:
                local_world = 1  # one process per machine (pod)
            else:  # LOCAL_RANK alone: one machine, unless a node rank says there are several
                local_world = world
                known = node_rank is None
                if not known:
                    nodes = max(2, node_rank + 1)  # the same lower bound on every machine that has a node rank
        local_world = max(1, local_world)  # (a world size of 0 is reported by the validation)
        if local_rank is None:
            local_rank = rank % local_world
        if node_rank is None:
            node_rank = rank // local_world
        topo = dict(
            source=self.name,
            world_size=world,
            rank=rank,
            local_rank=local_rank,
            local_world_size=local_world,
            node_rank=node_rank,
            num_nodes=max(nodes or -(-world // local_world), node_rank + 1),
            main_address=env.get("MASTER_ADDR", "127.0.0.1"),
            main_port=_int(env, "MASTER_PORT", None),
        )
        if not known:  # read by the device choice, not kept in the Environment
            topo["local_world_guessed"] = True
        return topo


class SlurmDetector(Detector):
    """An ``srun`` step: ranks from ``SLURM_PROCID``/``SLURM_LOCALID``, the main address from the
    first host of the node list, the port from the job id unless ``MASTER_PORT`` is set. The batch
    script itself (no ``srun``) is one process, with a warning when more tasks were allocated —
    never a job waiting for tasks that were not started."""

    name = "slurm"

    def detect(self, env: Mapping[str, str]) -> Optional[dict]:
        if "SLURM_PROCID" not in env:
            return None
        job = read_slurm(env)
        if job is None:
            return None
        if not job.in_step:
            warnings = ()
            if job.ntasks > 1:
                warnings = (
                    f"SLURM allocated {job.ntasks} tasks but this process was started by the batch script, "
                    "not by srun, so it runs alone (1 process). Start it with `srun python ...` (or "
                    "`srun anyaccel launch ...`) to use every task.",
                )
            return dict(source="single", warnings=warnings)
        if job.ntasks <= 1:
            return None
        topo = dict(
            source=self.name,
            world_size=job.ntasks,
            rank=job.procid,
            local_rank=job.localid,
            local_world_size=job.tasks_on_node,
            node_rank=job.node_id,
            num_nodes=job.nnodes,
            main_address=job.main_address(env) or "127.0.0.1",
            main_port=job.main_port(env),
        )
        if job.gpus_on_node is not None:  # read by the device choice, not kept in the Environment
            topo["gpus_on_node"] = job.gpus_on_node
        return topo


class MpiDetector(Detector):
    """Open MPI (``OMPI_COMM_WORLD_*``) and MPICH / Intel MPI (``PMI_RANK``/``PMI_SIZE``,
    ``MPI_LOCALRANKID``). ``MASTER_ADDR`` defaults to ``127.0.0.1`` only when every rank is on this
    node; otherwise it must be given."""

    name = "mpi"

    def detect(self, env: Mapping[str, str]) -> Optional[dict]:
        if envvars.read(envvars.DISABLE_MPI, env):
            return None
        if "OMPI_COMM_WORLD_SIZE" in env:
            world, rank = _int(env, "OMPI_COMM_WORLD_SIZE"), _int(env, "OMPI_COMM_WORLD_RANK", 0)
            local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0)
            local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world)
            node_rank = _int(env, "OMPI_COMM_WORLD_NODE_RANK", None)
        elif "PMI_SIZE" in env:
            world, rank = _int(env, "PMI_SIZE"), _int(env, "PMI_RANK", 0)
            local_rank = _int(env, "MPI_LOCALRANKID", None)
            if local_rank is None:
                local_rank = _int(env, "PMI_LOCAL_RANK", rank)
            local_world = _int(env, "MPI_LOCALNRANKS", None) or _int(env, "PMI_LOCAL_SIZE", world)
            node_rank = None
        else:
            return None
        if world <= 1:
            return None
        local_world = max(1, local_world)
        if node_rank is None:
            node_rank = rank // local_world
        num_nodes = max(1, -(-world // local_world))
        main = env.get("MASTER_ADDR")
        if main is None:
            if num_nodes > 1:
                raise JobEnvironmentError(
                    f"MPI job with {world} ranks over {num_nodes} nodes but MASTER_ADDR is not set: export "
                    "MASTER_ADDR=<host of rank 0> (and optionally MASTER_PORT) through mpirun -x."
                )
            main = "127.0.0.1"
        return dict(source=self.name, world_size=world, rank=rank, local_rank=local_rank,
                    local_world_size=local_world, node_rank=node_rank, num_nodes=num_nodes,
                    main_address=main, main_port=_int(env, "MASTER_PORT", 29500))


class XlaDetector(Detector):
    """XLA (``PJRT_DEVICE``/``TPU_*`` with torch-xla installed). torch-xla owns the replica
    topology; it is read from its runtime by the XLA backend once the runtime is up. Here we only
    record that XLA is the device."""

    name = "xla"

    def detect(self, env: Mapping[str, str]) -> Optional[dict]:
        wanted = env.get("PJRT_DEVICE") or env.get("TPU_NAME") or env.get("XRT_TPU_CONFIG") or env.get("TPU_WORKER_ID")
        if not wanted or importlib.util.find_spec("torch_xla") is None:
            return None
        return dict(source=self.name)


_DETECTORS: List[Detector] = [TorchrunDetector(), SlurmDetector(), MpiDetector(), XlaDetector()]


def detectors() -> List[Detector]:
    """The registered detectors, in the order they are asked."""
    return list(_DETECTORS)


def register_detector(detector: Detector, before: Optional[str] = None) -> None:
    """Add ``detector`` (asked before the one named ``before``, else last; a detector with the same
    name is replaced)."""
    _DETECTORS[:] = [d for d in _DETECTORS if d.name != detector.name]
    names = [d.name for d in _DETECTORS]
    if before is not None and before not in names:
        raise ValueError(f"register_detector(before={before!r}): no such detector; known: {', '.join(names)}")
    _DETECTORS.insert(names.index(before) if before is not None else len(_DETECTORS), detector)
