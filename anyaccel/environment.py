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
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
from typing import Mapping, Optional, Tuple

__all__ = [
    "DistributedType",
    "Environment",
    "EnvironmentError_",
    "resolve_environment",
    "expand_nodelist",
    "slurm_port_from_job_id",
]


class EnvironmentError_(RuntimeError):
    """The environment variables describe an impossible or inconsistent job."""


class DistributedType(str, enum.Enum):
    """How the job is distributed; names match Accelerate's ``DistributedType``."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    XLA = "XLA"

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.value


@dataclasses.dataclass(frozen=True)
class Environment:
    """Where this process sits in the job. Immutable; resolved once per ``Accelerator``.

    ``source`` tells which launcher the values came from: ``"torchrun"``, ``"slurm"``, ``"mpi"``,
    ``"xla"`` or ``"single"``.
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
    def device(self) -> str:
        """The device string, e.g. ``"cuda:1"`` or ``"cpu"``."""
        if self.device_index is None:
            return self.device_type
        return f"{self.device_type}:{self.device_index}"

    @property
    def distributed_type(self) -> DistributedType:
        if self.device_type == "xla":
            return DistributedType.XLA
        if self.world_size <= 1:
            return DistributedType.NO
        return DistributedType.MULTI_GPU if self.device_type == "cuda" else DistributedType.MULTI_CPU

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
# Small pure helpers
# --------------------------------------------------------------------------------------------


def _int(env: Mapping[str, str], key: str, default: Optional[int] = None) -> Optional[int]:
    value = env.get(key)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise EnvironmentError_(f"environment variable {key}={value!r} is not an integer") from None


def _truthy(value: Optional[str]) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


_RANGE_RE = re.compile(r"^(\d+)-(\d+)$")


def _split_top_level(text: str) -> list:
    """Split ``a[1-2],b,c[3]`` on commas that are not inside brackets."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if current:
        parts.append("".join(current))
    return [p for p in (s.strip() for s in parts) if p]


def expand_nodelist(nodelist: str) -> list:
    """Expand a SLURM host list: ``"gpu[07-08,11],cpu1"`` → ``["gpu07", "gpu08", "gpu11", "cpu1"]``.

    Zero padding is kept (``07``), several bracket groups per name are supported
    (``rack[1-2]-n[01-02]``). Raises :class:`EnvironmentError_` on malformed input.
    """
    hosts: list = []
    for item in _split_top_level(nodelist):
        hosts.extend(_expand_one(item, nodelist))
    return hosts


def _expand_one(item: str, whole: str) -> list:
    start = item.find("[")
    if start < 0:
        if "]" in item:
            raise EnvironmentError_(f"malformed SLURM_NODELIST {whole!r}: unbalanced ']'")
        return [item]
    end = item.find("]", start)
    if end < 0:
        raise EnvironmentError_(f"malformed SLURM_NODELIST {whole!r}: missing ']'")
    prefix, body, rest = item[:start], item[start + 1 : end], item[end + 1 :]
    tails = _expand_one(rest, whole) if rest else [""]
    out = []
    for part in body.split(","):
        part = part.strip()
        m = _RANGE_RE.match(part)
        if m:
            lo, hi = m.group(1), m.group(2)
            if int(hi) < int(lo):
                raise EnvironmentError_(f"malformed SLURM_NODELIST {whole!r}: range {part} goes down")
            width = len(lo)
            values = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
        elif part.isdigit():
            values = [part]
        else:
            raise EnvironmentError_(f"malformed SLURM_NODELIST {whole!r}: cannot read {part!r}")
        for v in values:
            for t in tails:
                out.append(f"{prefix}{v}{t}")
    return out


def slurm_port_from_job_id(job_id: Optional[int]) -> int:
    """The rendezvous port for a SLURM job: every task of one job computes the same value,
    different jobs sharing a node usually get different values (in 15000-31999: below Linux's
    ephemeral range)."""
    if job_id is None:
        return 29500
    return 15000 + int(job_id) % 17000


# --------------------------------------------------------------------------------------------
# Detectors: each returns a partial dict of topology fields, or None when it does not apply.
# --------------------------------------------------------------------------------------------


def _from_torchrun(env: Mapping[str, str]) -> Optional[dict]:
    if "RANK" not in env or "WORLD_SIZE" not in env:
        # torch.distributed.launch without --use-env sets only LOCAL_RANK as an argument; with
        # current torch it always exports RANK/WORLD_SIZE, which is what we read here.
        return None
    world = _int(env, "WORLD_SIZE")
    rank = _int(env, "RANK")
    local_rank = _int(env, "LOCAL_RANK", 0)
    node_rank = _int(env, "GROUP_RANK", None)
    if node_rank is None:
        node_rank = _int(env, "NODE_RANK", 0)
    group_world = _int(env, "GROUP_WORLD_SIZE", None)
    local_world = _int(env, "LOCAL_WORLD_SIZE", None) or max(1, world // (group_world or 1))
    num_nodes = group_world or max(1, -(-world // local_world))
    return dict(
        source="torchrun",
        world_size=world,
        rank=rank,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=num_nodes,
        main_address=env.get("MASTER_ADDR", "127.0.0.1"),
        main_port=_int(env, "MASTER_PORT", None),
    )


def _from_slurm(env: Mapping[str, str]) -> Optional[dict]:
    if "SLURM_JOB_ID" not in env or "SLURM_PROCID" not in env or _truthy(env.get("ANYACCEL_DISABLE_SLURM")):
        return None
    warnings = []
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    ntasks = _int(env, "SLURM_STEP_NUM_TASKS", None) or _int(env, "SLURM_NTASKS", None) or 1
    if not in_step:
        # The batch script itself: only one process runs here, whatever --ntasks says.
        if ntasks > 1:
            warnings.append(
                f"SLURM allocated {ntasks} tasks but this process was started by the batch script, "
                "not by srun, so it runs alone (1 process). Start it with `srun python ...` (or "
                "`srun anyaccel launch ...`) to use every task."
            )
        return dict(source="single", warnings=tuple(warnings))
    if ntasks <= 1:
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    hosts = expand_nodelist(nodelist) if nodelist else []
    main = env.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1")
    port = _int(env, "MASTER_PORT", None) or slurm_port_from_job_id(_int(env, "SLURM_JOB_ID", None))
    num_nodes = _int(env, "SLURM_STEP_NUM_NODES", None) or _int(env, "SLURM_NNODES", None) or max(1, len(hosts))
    local_world = _local_tasks(env, num_nodes, ntasks)
    return dict(
        source="slurm",
        world_size=ntasks,
        rank=_int(env, "SLURM_PROCID"),
        local_rank=_int(env, "SLURM_LOCALID", 0),
        local_world_size=local_world,
        node_rank=_int(env, "SLURM_NODEID", 0),
        num_nodes=num_nodes,
        main_address=main,
        main_port=port,
        warnings=tuple(warnings),
    )


def _local_tasks(env: Mapping[str, str], num_nodes: int, ntasks: int) -> int:
    """Tasks on this node: SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE look like ``2(x3),1``."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if spec:
        counts: list = []
        for part in spec.split(","):
            m = re.match(r"^(\d+)(?:\(x(\d+)\))?$", part.strip())
            if not m:
                break
            counts += [int(m.group(1))] * int(m.group(2) or 1)
        node = _int(env, "SLURM_NODEID", 0) or 0
        if node < len(counts):
            return counts[node]
    per_node = _int(env, "SLURM_NTASKS_PER_NODE", None)
    return per_node or max(1, ntasks // max(num_nodes, 1))


def _from_mpi(env: Mapping[str, str]) -> Optional[dict]:
    if _truthy(env.get("ANYACCEL_DISABLE_MPI")):
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
            raise EnvironmentError_(
                f"MPI job with {world} ranks over {num_nodes} nodes but MASTER_ADDR is not set: export "
                "MASTER_ADDR=<host of rank 0> (and optionally MASTER_PORT) through mpirun -x."
            )
        main = "127.0.0.1"
    return dict(
        source="mpi",
        world_size=world,
        rank=rank,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=num_nodes,
        main_address=main,
        main_port=_int(env, "MASTER_PORT", 29500),
    )


def _xla_requested(env: Mapping[str, str]) -> bool:
    return bool(env.get("PJRT_DEVICE") or env.get("TPU_NAME") or env.get("XRT_TPU_CONFIG") or env.get("TPU_WORKER_ID"))


def _from_xla(env: Mapping[str, str]) -> Optional[dict]:
    if not _xla_requested(env) or not _xla_installed():
        return None
    # torch-xla owns the replica topology; it is read lazily in backends.xla once the runtime is
    # up. Here we only record that XLA is the device.
    return dict(source="xla")


def _xla_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch_xla") is not None


# --------------------------------------------------------------------------------------------
# Device choice
# --------------------------------------------------------------------------------------------


def _choose_device(env: Mapping[str, str], topo: dict, force_cpu: bool) -> Tuple[str, Optional[int], Optional[str], Tuple[str, ...]]:
    """Return (device_type, device_index, backend, warnings). Never initialises CUDA."""
    from . import devices

    warnings: Tuple[str, ...] = ()
    world = topo.get("world_size", 1)
    if topo.get("source") == "xla" and not force_cpu:
        return "xla", None, "xla", warnings
    if not force_cpu:
        n_gpu = devices.cuda_device_count()
        if n_gpu > 0:
            local_rank = topo.get("local_rank", 0)
            local_world = topo.get("local_world_size", 1)
            index = local_rank % n_gpu
            backend = "nccl"
            if local_world > n_gpu:
                backend = "gloo"
                warnings = (
                    f"{local_world} processes on this node share {n_gpu} visible GPU(s); using the gloo "
                    "backend because NCCL cannot put two ranks on one GPU.",
                )
            return "cuda", index, (backend if world > 1 else None), warnings
        if devices.mps_available():
            if world <= 1:
                return "mps", None, None, warnings
            warnings = (
                f"{world} processes were started but Apple's MPS device has no multi-process communication "
                "backend: every process uses the CPU (gloo). Run a single process to train on MPS.",
            )
    return "cpu", None, ("gloo" if world > 1 else None), warnings


def resolve_environment(env: Optional[Mapping[str, str]] = None, *, cpu: Optional[bool] = None) -> Environment:
    """Read the launcher's variables (``os.environ`` by default) and return the :class:`Environment`.

    Called independently by every process; each gets its own rank, all agree on world size and main
    address/port. ``cpu=True`` (or ``ANYACCEL_USE_CPU=1``) forces the CPU even when GPUs are visible.
    A backend may be forced with ``ANYACCEL_BACKEND=gloo|nccl``. Pure: only reads ``env``.
    """
    env = os.environ if env is None else env
    force_cpu = bool(cpu) if cpu is not None else _truthy(env.get("ANYACCEL_USE_CPU"))
    topo = None
    for detector in (_from_torchrun, _from_slurm, _from_mpi, _from_xla):
        topo = detector(env)
        if topo is not None:
            break
    topo = dict(topo or {"source": "single"})
    _validate(topo)
    device_type, index, backend, dev_warnings = _choose_device(env, topo, force_cpu)
    forced_backend = env.get("ANYACCEL_BACKEND")
    if forced_backend and topo.get("world_size", 1) > 1:
        backend = forced_backend
    topo["warnings"] = tuple(topo.get("warnings", ())) + dev_warnings
    return Environment(device_type=device_type, device_index=index, backend=backend, **topo)


def _validate(topo: dict) -> None:
    world = topo.get("world_size", 1)
    rank = topo.get("rank", 0)
    source = topo.get("source")
    if world is None or world < 1:
        raise EnvironmentError_(f"{source}: world size {world} must be at least 1")
    if rank is None or not 0 <= rank < world:
        raise EnvironmentError_(f"{source}: rank {rank} is outside 0..{world - 1} (world size {world})")
    local_rank, local_world = topo.get("local_rank", 0), topo.get("local_world_size", 1)
    if not 0 <= local_rank < max(local_world, 1):
        raise EnvironmentError_(
            f"{source}: local rank {local_rank} is outside 0..{local_world - 1} (processes on this node)"
        )
