"""Where a process sits in its job, read from each launcher's own variables: one small pure class
per launcher, in a registry that :func:`anyaccel.environment.resolve_environment` walks in order
(first match wins).

A detector maps the environment variables to a :class:`Topology` (where this process sits: ranks,
sizes, main address; a plain dict with some of its fields is accepted from detectors of your own),
or None when its launcher did not start this process. Each detector also reads its launcher's
*facts* about the run (:meth:`Detector.facts`: run id, restart attempt, maximum restarts, SLURM job
and requeue ids), gathered from every detector into one :class:`LaunchFacts` that the frozen
:class:`~anyaccel.environment.Environment` carries (``env.launch``). Detectors only read the mapping
they are given; they are the only code below the launch planner that reads launcher variables, so
the rest of anyaccel asks the ``Environment`` (or :func:`launch_facts` where no ``Environment``
exists yet, e.g. in a worker before the user's script runs).

Add your own (a cluster scheduler we do not know) with :func:`register_detector`::

    class MyScheduler(Detector):
        name = "mysched"
        def detect(self, env):
            if "MYSCHED_RANK" not in env:
                return None
            return Topology(source=self.name, rank=int(env["MYSCHED_RANK"]), world_size=int(env["MYSCHED_SIZE"]),
                            main_address=env["MYSCHED_HEAD"], main_port=29500)

    register_detector(MyScheduler(), before="slurm")
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union, overload

from .. import envvars, lazyclass
from . import network
from ..errors import JobEnvironmentError

__all__ = ["Detector", "TorchrunDetector", "SlurmDetector", "MpiDetector", "XlaDetector", "detectors",
           "register_detector", "Topology", "LaunchFacts", "detect_topology", "launch_facts"]


@lazyclass.dataclass(frozen=True)
class Topology:
    """Where this process sits in its job, as one detector read it (the fields of the same names
    of :class:`~anyaccel.environment.Environment`), plus two hints for the device choice that the
    ``Environment`` does not keep: ``gpus_on_node`` (GPUs the launcher gave this node's tasks, all
    together) and ``local_world_guessed`` (no launcher said how many processes share this machine)."""

    source: str = "single"
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    main_address: str = "127.0.0.1"
    main_port: Optional[int] = None
    warnings: Tuple[str, ...] = ()
    gpus_on_node: Optional[int] = None
    local_world_guessed: bool = False

    @classmethod
    def of(cls, value: Union["Topology", Mapping[str, Any]]) -> "Topology":
        """``value`` as a Topology (detectors of your own may return a dict); ``TypeError`` naming
        an unknown key."""
        if isinstance(value, Topology):
            return value
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise TypeError(f"a detector returned the unknown topology keys {unknown}; known: {sorted(known)}")
        fields = dict(value)
        fields["warnings"] = tuple(fields.get("warnings", ()))
        return cls(**fields)

    def placement(self) -> Dict[str, Any]:
        """The fields the ``Environment`` keeps (everything but the device-choice hints)."""
        out = dataclasses.asdict(self)
        out.pop("gpus_on_node")
        out.pop("local_world_guessed")
        return out


@lazyclass.dataclass(frozen=True)
class LaunchFacts:
    """What the launchers say about the run itself, beyond ranks: one frozen object on
    ``Environment.launch``. Every field has a neutral default (not launched by that launcher).

    ``run_id``: torch elastic's ``TORCHELASTIC_RUN_ID`` (set: torch's agent started this process
    and runs a TCP store the process group can reuse). ``restart_attempt``: how many times the
    job was restarted before this attempt (``TORCHELASTIC_RESTART_COUNT``, else SLURM's
    ``SLURM_RESTART_COUNT``, the requeue count). ``max_restarts``: ``TORCHELASTIC_MAX_RESTARTS``.
    ``error_file``: where torch's agent wants a failing worker's report (``TORCHELASTIC_ERROR_FILE``).
    ``slurm_job_id`` / ``slurm_step_id``: ``SLURM_JOB_ID`` / ``SLURM_STEP_ID``. ``slurm_requeue_id``:
    the id ``scontrol requeue`` takes (``<array job>_<task>`` for an array task, else the job id)."""

    run_id: Optional[str] = None
    restart_attempt: int = 0
    max_restarts: int = 0
    error_file: Optional[str] = None
    slurm_job_id: Optional[str] = None
    slurm_step_id: Optional[str] = None
    slurm_requeue_id: Optional[str] = None

    @property
    def started_by_elastic_agent(self) -> bool:
        """torch's elastic agent (``anyaccel launch``, ``torchrun``) started this process."""
        return self.run_id is not None

    @property
    def restart_follows(self) -> bool:
        """A failure of this attempt makes torch's agent restart the job."""
        return self.restart_attempt < self.max_restarts

    @property
    def run_name(self) -> str:
        """A name all processes of this run (attempt aside) agree on: the elastic run id, else
        ``slurm-<job>.<step>``, else ``"job"``."""
        if self.run_id:
            return self.run_id
        if self.slurm_job_id:
            return f"slurm-{self.slurm_job_id}.{self.slurm_step_id or ''}"
        return "job"


@overload
def _int(env: Mapping[str, str], key: str, default: int) -> int: ...
@overload
def _int(env: Mapping[str, str], key: str, default: None = None) -> Optional[int]: ...
def _int(env: Mapping[str, str], key: str, default: Optional[int] = None) -> Optional[int]:
    value = env.get(key)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise JobEnvironmentError(f"environment variable {key}={value!r} is not an integer") from None


def _required_int(env: Mapping[str, str], key: str) -> int:
    """``env[key]`` as an integer; :class:`JobEnvironmentError` when it is unset or empty."""
    value = _int(env, key)
    if value is None:
        raise JobEnvironmentError(f"environment variable {key} is empty or unset; the launcher must set it to an integer")
    return value


class Detector:
    """One launcher's variables → a :class:`Topology` (or a dict of its fields), or None when that
    launcher did not start us; and that launcher's facts about the run (:class:`LaunchFacts`
    fields), read whether or not it decided the topology."""

    name: str = ""

    def detect(self, env: Mapping[str, str]) -> Optional[Union[Topology, Dict[str, Any]]]:
        raise NotImplementedError

    def facts(self, env: Mapping[str, str]) -> Dict[str, Any]:
        """The :class:`LaunchFacts` fields this launcher sets (none by default)."""
        return {}


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

    def detect(self, env: Mapping[str, str]) -> Optional[Topology]:
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        world, rank = _required_int(env, "WORLD_SIZE"), _required_int(env, "RANK")
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
                if node_rank is not None:
                    nodes = max(2, node_rank + 1)  # the same lower bound on every machine that has a node rank
        local_world = max(1, local_world)  # (a world size of 0 is reported by the validation)
        if local_rank is None:
            local_rank = rank % local_world
        if node_rank is None:
            node_rank = rank // local_world
        return Topology(
            source=self.name,
            world_size=world,
            rank=rank,
            local_rank=local_rank,
            local_world_size=local_world,
            node_rank=node_rank,
            num_nodes=max(nodes or -(-world // local_world), node_rank + 1),
            main_address=env.get("MASTER_ADDR", "127.0.0.1"),
            main_port=_int(env, "MASTER_PORT", None),
            local_world_guessed=not known,
        )

    def facts(self, env: Mapping[str, str]) -> Dict[str, Any]:
        """``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``,
        ``TORCHELASTIC_ERROR_FILE`` (set by torch's elastic agent for its workers)."""
        out: Dict[str, Any] = {}
        if env.get("TORCHELASTIC_RUN_ID"):
            out["run_id"] = env["TORCHELASTIC_RUN_ID"]
        if env.get("TORCHELASTIC_RESTART_COUNT"):
            out["restart_attempt"] = _int(env, "TORCHELASTIC_RESTART_COUNT", 0)
        if env.get("TORCHELASTIC_MAX_RESTARTS"):
            out["max_restarts"] = _int(env, "TORCHELASTIC_MAX_RESTARTS", 0)
        if env.get("TORCHELASTIC_ERROR_FILE"):
            out["error_file"] = env["TORCHELASTIC_ERROR_FILE"]
        return out


class SlurmDetector(Detector):
    """An ``srun`` step: ranks from ``SLURM_PROCID``/``SLURM_LOCALID``, the main address from the
    first host of the node list, the port from the job id unless ``MASTER_PORT`` is set. The batch
    script itself (no ``srun``) is one process, with a warning when more tasks were allocated —
    never a job waiting for tasks that were not started."""

    name = "slurm"

    def detect(self, env: Mapping[str, str]) -> Optional[Topology]:
        if "SLURM_PROCID" not in env:
            return None
        from .slurm import read_slurm  # only under SLURM: the import budget

        job = read_slurm(env)
        if job is None:
            return None
        if not job.in_step:
            warnings: Tuple[str, ...] = ()
            if job.ntasks > 1:
                warnings = (
                    f"SLURM allocated {job.ntasks} tasks but this process was started by the batch script, "
                    "not by srun, so it runs alone (1 process). Start it with `srun python ...` (or "
                    "`srun anyaccel launch ...`) to use every task.",
                )
            return Topology(source="single", warnings=warnings)
        if job.ntasks <= 1:
            return None
        return Topology(
            source=self.name,
            world_size=job.ntasks,
            rank=job.procid,
            local_rank=job.localid,
            local_world_size=job.tasks_on_node,
            node_rank=job.node_id,
            num_nodes=job.nnodes,
            main_address=job.main_address(env) or "127.0.0.1",
            main_port=job.main_port(env),
            gpus_on_node=job.gpus_on_node,
        )

    def facts(self, env: Mapping[str, str]) -> Dict[str, Any]:
        """``SLURM_JOB_ID``, ``SLURM_STEP_ID``, ``SLURM_ARRAY_JOB_ID`` + ``SLURM_ARRAY_TASK_ID``,
        ``SLURM_RESTART_COUNT`` (read even with ``ANYACCEL_DISABLE_SLURM=1``, which concerns ranks:
        a job run by a launcher of its own is still requeued and named by SLURM)."""
        job = env.get("SLURM_JOB_ID")
        if not job:
            return {}
        array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
        return dict(slurm_job_id=job, slurm_step_id=env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID"),
                    slurm_requeue_id=f"{array}_{task}" if array and task else job,
                    restart_attempt=_int(env, "SLURM_RESTART_COUNT", 0))


class MpiDetector(Detector):
    """Open MPI (``OMPI_COMM_WORLD_*``) and MPICH / Intel MPI (``PMI_RANK``/``PMI_SIZE``,
    ``MPI_LOCALRANKID``). ``MASTER_ADDR`` defaults to ``127.0.0.1`` only when every rank is on this
    node; otherwise it must be given."""

    name = "mpi"

    def detect(self, env: Mapping[str, str]) -> Optional[Topology]:
        if envvars.read(envvars.DISABLE_MPI, env):
            return None
        if "OMPI_COMM_WORLD_SIZE" in env:
            world, rank = _required_int(env, "OMPI_COMM_WORLD_SIZE"), _int(env, "OMPI_COMM_WORLD_RANK", 0)
            local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0)
            local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world)
            node_rank = _int(env, "OMPI_COMM_WORLD_NODE_RANK", None)
        elif "PMI_SIZE" in env:
            world, rank = _required_int(env, "PMI_SIZE"), _int(env, "PMI_RANK", 0)
            mpich_local_rank = _int(env, "MPI_LOCALRANKID", None)
            local_rank = _int(env, "PMI_LOCAL_RANK", rank) if mpich_local_rank is None else mpich_local_rank
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
        return Topology(source=self.name, world_size=world, rank=rank, local_rank=local_rank,
                        local_world_size=local_world, node_rank=node_rank, num_nodes=num_nodes,
                        main_address=main, main_port=_int(env, "MASTER_PORT", 29500))


class XlaDetector(Detector):
    """XLA (``PJRT_DEVICE``/``TPU_*`` with torch-xla installed). torch-xla owns the replica
    topology; it is read from its runtime by the XLA backend once the runtime is up. Here we only
    record that XLA is the device."""

    name = "xla"

    def detect(self, env: Mapping[str, str]) -> Optional[Topology]:
        wanted = env.get("PJRT_DEVICE") or env.get("TPU_NAME") or env.get("XRT_TPU_CONFIG") or env.get("TPU_WORKER_ID")
        if not wanted or importlib.util.find_spec("torch_xla") is None:
            return None
        return Topology(source=self.name)


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


def detect_topology(env: Optional[Mapping[str, str]] = None,
                    detectors: Optional[Sequence[Detector]] = None) -> Optional[Topology]:
    """The topology of the first detector (in registry order) whose launcher started this
    process, or None (one process). ``env``: ``os.environ`` by default. Local; pure apart from
    that default. Raises :class:`~anyaccel.errors.JobEnvironmentError` for malformed variables."""
    env = os.environ if env is None else env
    for detector in (_DETECTORS if detectors is None else detectors):
        found = detector.detect(env)
        if found is not None:
            return Topology.of(found)
    return None


def launch_facts(env: Optional[Mapping[str, str]] = None,
                 detectors: Optional[Sequence[Detector]] = None) -> LaunchFacts:
    """The launchers' facts about this run, from every detector (an earlier detector's value wins:
    torch elastic's restart count over SLURM's requeue count). ``env``: ``os.environ`` by default.
    Local; pure apart from that default. ``resolve_environment`` puts the result on
    ``Environment.launch``; call this directly only where no ``Environment`` exists yet."""
    env = os.environ if env is None else env
    merged: Dict[str, Any] = {}
    for detector in (_DETECTORS if detectors is None else detectors):
        for key, value in detector.facts(env).items():
            merged.setdefault(key, value)
    return LaunchFacts(**merged)
