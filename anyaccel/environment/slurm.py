"""SLURM's variables, read once: the one parser used by environment detection and by the
``anyaccel launch`` planner.

:func:`read_slurm` turns the ``SLURM_*`` variables of a process into a frozen :class:`SlurmJob`.
Pure: reads only the mapping it is given. Standard library only.
"""

from __future__ import annotations

import dataclasses
import re
from typing import List, Mapping, Optional, Tuple

from .. import envvars
from ..errors import JobEnvironmentError

__all__ = ["SlurmJob", "read_slurm", "expand_nodelist", "slurm_port_from_job_id"]


@dataclasses.dataclass(frozen=True)
class SlurmJob:
    """What SLURM says about this process.

    ``in_step``: started by ``srun`` (a job step), not by the batch script itself. ``ntasks`` and
    ``nnodes`` are the step's when ``in_step``, else the allocation's. ``tasks_on_node``: tasks of
    this step on this node. ``hosts``: the expanded node list (first host = main address).
    ``gpus_on_node``: GPUs the step has on this node, all tasks together (``SLURM_STEP_GPUS``,
    else ``SLURM_GPUS_ON_NODE``; None when SLURM gave no GPUs or does not say), whatever each task
    can see after ``--gpus-per-task`` / ``--gpu-bind``."""

    job_id: int
    in_step: bool
    ntasks: int
    nnodes: int
    node_id: int
    procid: int
    localid: int
    tasks_on_node: int
    hosts: Tuple[str, ...]
    gpus_on_node: Optional[int] = None

    @property
    def tasks_are_workers(self) -> bool:
        """Several tasks per node in an srun step: each task is one worker process."""
        return self.in_step and self.ntasks > self.nnodes

    def main_address(self, env: Mapping[str, str]) -> Optional[str]:
        """``MASTER_ADDR`` when set, else the first host of the node list (None when empty)."""
        return env.get("MASTER_ADDR") or (self.hosts[0] if self.hosts else None)

    def main_port(self, env: Mapping[str, str]) -> int:
        """``MASTER_PORT`` when set, else :func:`slurm_port_from_job_id`."""
        return _int(env, "MASTER_PORT") or slurm_port_from_job_id(self.job_id)


def read_slurm(env: Mapping[str, str]) -> Optional[SlurmJob]:
    """The SLURM job this process belongs to, or None (no job, or ``ANYACCEL_DISABLE_SLURM=1``).
    Raises :class:`~anyaccel.errors.JobEnvironmentError` for a malformed node list or number."""
    if "SLURM_JOB_ID" not in env or envvars.read(envvars.DISABLE_SLURM, env):
        return None
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    hosts = tuple(expand_nodelist(nodelist)) if nodelist else ()
    if in_step:
        ntasks = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") or 1
        nnodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES") or max(1, len(hosts))
    else:
        ntasks = _int(env, "SLURM_NTASKS") or 1
        nnodes = _int(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or max(1, len(hosts))
    node_id = _int(env, "SLURM_NODEID") or 0
    return SlurmJob(
        job_id=_int(env, "SLURM_JOB_ID") or 0,
        in_step=in_step,
        ntasks=ntasks,
        nnodes=nnodes,
        node_id=node_id,
        procid=_int(env, "SLURM_PROCID") or 0,
        localid=_int(env, "SLURM_LOCALID") or 0,
        tasks_on_node=_tasks_on_node(env, node_id, nnodes, ntasks),
        hosts=hosts,
        gpus_on_node=_gpus_on_node(env) if in_step else None,
    )


def _int(env: Mapping[str, str], *keys: str) -> Optional[int]:
    """The first of ``keys`` that is set, as an int (None when none is set)."""
    for key in keys:
        value = env.get(key)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise JobEnvironmentError(f"environment variable {key}={value!r} is not an integer") from None
    return None


def _tasks_on_node(env: Mapping[str, str], node_id: int, nnodes: int, ntasks: int) -> int:
    """SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE look like ``2(x3),1``."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if spec:
        counts: List[int] = []
        for part in spec.split(","):
            m = re.match(r"^(\d+)(?:\(x(\d+)\))?$", part.strip())
            if not m:
                break
            counts += [int(m.group(1))] * int(m.group(2) or 1)
        if node_id < len(counts):
            return counts[node_id]
    return _int(env, "SLURM_NTASKS_PER_NODE") or max(1, ntasks // max(nnodes, 1))


def _gpus_on_node(env: Mapping[str, str]) -> Optional[int]:
    """The step's GPUs on this node: the IDs in ``SLURM_STEP_GPUS`` (``0,1,2,3``; ranges ``0-3``
    counted too), else ``SLURM_GPUS_ON_NODE``. None when neither says."""
    ids = env.get("SLURM_STEP_GPUS", "").strip()
    if ids:
        count = 0
        for part in ids.split(","):
            m = _RANGE_RE.match(part.strip())
            count += int(m.group(2)) - int(m.group(1)) + 1 if m else 1
        return count
    return _int(env, "SLURM_GPUS_ON_NODE")


def slurm_port_from_job_id(job_id: Optional[int]) -> int:
    """The rendezvous port for a SLURM job: every task of one job computes the same value,
    different jobs sharing a node usually get different values (in 15000-31999: below Linux's
    ephemeral range)."""
    if job_id is None:
        return 29500
    return 15000 + int(job_id) % 17000


_RANGE_RE = re.compile(r"^(\d+)-(\d+)$")


def _split_top_level(text: str) -> List[str]:
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


def expand_nodelist(nodelist: str) -> List[str]:
    """Expand a SLURM host list: ``"gpu[07-08,11],cpu1"`` → ``["gpu07", "gpu08", "gpu11", "cpu1"]``.

    Zero padding is kept (``07``), several bracket groups per name are supported
    (``rack[1-2]-n[01-02]``). Raises :class:`~anyaccel.errors.JobEnvironmentError` on malformed input.
    """
    hosts: List[str] = []
    for item in _split_top_level(nodelist):
        hosts.extend(_expand_one(item, nodelist))
    return hosts


def _expand_one(item: str, whole: str) -> List[str]:
    start = item.find("[")
    if start < 0:
        if "]" in item:
            raise JobEnvironmentError(f"malformed SLURM_NODELIST {whole!r}: unbalanced ']'")
        return [item]
    end = item.find("]", start)
    if end < 0:
        raise JobEnvironmentError(f"malformed SLURM_NODELIST {whole!r}: missing ']'")
    prefix, body, rest = item[:start], item[start + 1 : end], item[end + 1 :]
    tails = _expand_one(rest, whole) if rest else [""]
    out = []
    for part in body.split(","):
        part = part.strip()
        m = _RANGE_RE.match(part)
        if m:
            lo, hi = m.group(1), m.group(2)
            if int(hi) < int(lo):
                raise JobEnvironmentError(f"malformed SLURM_NODELIST {whole!r}: range {part} goes down")
            width = len(lo)
            values = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
        elif part.isdigit():
            values = [part]
        else:
            raise JobEnvironmentError(f"malformed SLURM_NODELIST {whole!r}: cannot read {part!r}")
        for v in values:
            for t in tails:
                out.append(f"{prefix}{v}{t}")
    return out
