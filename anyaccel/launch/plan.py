"""What ``anyaccel launch`` will do, decided before anything starts: a frozen :class:`LaunchPlan`.

:func:`resolve_plan` is a pure function of the command-line values, the configuration file, the
environment variables and the number of visible GPUs; what a device allows (one process on Apple
MPS, torch-xla starting the TPU processes) is read from the device registry's facts
(:func:`anyaccel.backends.config_device`, imported when a plan is made). It spawns nothing, so
every rule below is unit-tested without processes.

Precedence, for every setting: **explicit flag > configuration file > detected default**. Which
settings exist, their flags and keys are the option table's (:mod:`anyaccel.optionspec`): the merge
takes every key the same way, so a new option needs no line here. :func:`resolve_plan` runs named
phases in order — merge, SLURM, device, configuration (built once), processes, rendezvous, worker
environment — and ``notebook_launcher`` builds its plan with it too.

Why this module is longer than ~450 lines: the phases are one decision read top to bottom (each
reads what the one before decided), with the request and the plan they turn into each other;
splitting them over files would hide that order.

Detected defaults: one process per visible GPU (``--gpu_ids`` narrows them), otherwise one CPU
process; ``--num_processes N`` on a CPU-only machine starts ``N`` real CPU ranks. A note says when
tensor-parallel groups (``tp_size`` x ``cp_size``) would span machines.

SLURM (inside an ``srun`` step, unless ``ANYACCEL_DISABLE_SLURM=1``):

* several tasks per node (``srun --ntasks-per-node=K anyaccel launch ...`` with K > 1): every task
  *is* a worker, so the script runs in-process with the rank SLURM gave it (mode ``"in_process"``);
  nothing is spawned twice;
* one task per node: each task is that node's agent (mode ``"agent"``), with the machine rank
  ``SLURM_NODEID``, the number of machines ``SLURM_NNODES`` and the main address the first host of
  the node list;
* a batch script that calls ``anyaccel launch`` without ``srun`` on a multi-node allocation runs on
  the first node only (a note says so), and asking for several machines there is an error instead
  of a rendezvous that waits forever.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .. import envvars, optionspec
from ..errors import JobEnvironmentError, PlanError
from ..config.strategy_keys import parallelism_sizes
from ..environment.slurm import SlurmJob, read_slurm

__all__ = ["LaunchRequest", "LaunchPlan", "PlanError", "resolve_plan", "slurm_step"]


@dataclasses.dataclass(frozen=True)
class LaunchRequest:
    """What was asked for, before anything is decided: the target and, in ``given``, every option
    set on the command line (or by ``notebook_launcher``'s arguments) by option name — the rows of
    the option table that have a flag (:mod:`anyaccel.optionspec`). An option not given reads as
    ``None`` (``request.num_processes``). Make one with :meth:`of`."""

    target: str
    is_module: bool = False
    script_args: Tuple[str, ...] = ()
    given: Tuple[Tuple[str, Any], ...] = ()
    quiet: bool = False
    multi_gpu: bool = False  # Accelerate's --multi_gpu: GPUs were asked for

    @classmethod
    def of(cls, target: str, *, is_module: bool = False, script_args: Tuple[str, ...] = (), quiet: bool = False,
           multi_gpu: bool = False, **given: Any) -> "LaunchRequest":
        """A request with the options ``given`` by name (``None``: not given); an unknown name is
        a ``TypeError``."""
        for name in given:
            if name not in _FLAG_ROWS:
                raise TypeError(f"LaunchRequest.of() got an unknown option {name!r}; known: {', '.join(_FLAG_ROWS)}")
        return cls(target, is_module, tuple(script_args), tuple((k, v) for k, v in given.items() if v is not None),
                   quiet, multi_gpu)

    def __getattr__(self, name: str) -> Any:
        if name in _FLAG_ROWS:
            return dict(self.given).get(name)
        raise AttributeError(f"LaunchRequest has no option {name!r}")

    def options(self) -> Dict[str, Any]:
        """The options given, by name."""
        return dict(self.given)


_FLAG_ROWS = {row.name: row for row in optionspec.options_with("flag")}
#: the main process's port on several machines when none is given (torchrun's); with fault tolerance
#: on, machine 0 serves the Lighthouse there
DEFAULT_MAIN_PORT = 29500


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Everything the runner needs; nothing is left to decide later.

    ``mode``: ``"agent"`` (torch's elastic agent starts ``nproc_per_node`` workers here),
    ``"in_process"`` (this process is the worker: an ``srun`` task) or ``"xla"`` (torch-xla spawns
    the TPU processes). ``main_process_port`` is None only for a single machine without a port:
    the runner then binds a free loopback port. ``worker_env`` is added to the environment of
    every worker. ``sources`` says where each setting came from (flag, config file, SLURM, default).
    """

    target: str
    is_module: bool
    script_args: Tuple[str, ...]
    mode: str
    device: str
    num_processes: int
    num_machines: int
    machine_rank: int
    nproc_per_node: int
    main_process_ip: str
    main_process_port: Optional[int]
    rdzv_backend: str
    run_id: str
    max_restarts: int
    monitor_interval: float
    mixed_precision: str
    gradient_accumulation_steps: int
    worker_env: Tuple[Tuple[str, str], ...]
    config_path: Optional[str]
    sources: Tuple[Tuple[str, str], ...]
    notes: Tuple[str, ...] = ()
    strategy: str = "auto"
    preemption_grace: float = 120.0
    debug: bool = False
    quiet: bool = False
    fault_tolerance: str = "off"  # off, on (start a Lighthouse), or a Lighthouse's HOST:PORT
    fault_tolerance_min_replicas: int = 1
    replica_group: Optional[int] = None  # this plan runs one replica group (set by anyaccel.launch.replica_groups)
    replica_group_size: int = 1  # processes per replica group (parallelism_config's dp_shard x ...; 1: one each)
    replica_groups: int = 1  # replica groups of the job (fault_tolerance on), on every machine together

    @property
    def single_machine(self) -> bool:
        return self.num_machines == 1

    @property
    def replica_groups_here(self) -> int:
        """The replica groups this machine's launch starts (fault tolerance): an equal share of the job's."""
        return 1 if self.replica_group is not None else self.replica_groups // max(1, self.num_machines)

    @property
    def first_replica_group(self) -> int:
        """The number of this machine's first replica group (machine ``k`` runs groups ``k*n .. k*n+n-1``)."""
        return self.machine_rank * self.replica_groups_here

    def env_dict(self) -> Dict[str, str]:
        return dict(self.worker_env)

    def source(self, key: str) -> str:
        return dict(self.sources).get(key, "default")

    def summary(self) -> str:
        """One line for the launcher's banner."""
        where = "this machine" if self.single_machine else \
            f"machine {self.machine_rank} of {self.num_machines}, main {self.main_process_ip}:{self.main_process_port}"
        per = f", {self.nproc_per_node} here" if not self.single_machine else ""
        mp = f", mixed precision {self.mixed_precision}" if self.mixed_precision != "no" else ""
        strategy = f", strategy {self.strategy}" if self.strategy != "auto" else ""
        return (f"{self.num_processes} process{'es' if self.num_processes != 1 else ''} on {self.device} "
                f"({where}{per}){mp}{strategy}")


# --------------------------------------------------------------------------------------------
# SLURM
# --------------------------------------------------------------------------------------------


def slurm_step(env: Mapping[str, str]) -> Optional[SlurmJob]:
    """The SLURM job this launcher runs in (:func:`anyaccel.slurm.read_slurm`), or None — also
    inside a worker of another launcher (``RANK``/``WORLD_SIZE`` set): that launcher already
    decided the topology. A malformed SLURM variable is a :class:`PlanError`."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return None
    try:
        return read_slurm(env)
    except JobEnvironmentError as exc:
        raise PlanError(str(exc)) from None


# --------------------------------------------------------------------------------------------
# The resolution
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Draft:
    """The plan while it is being decided: the merged settings by configuration key, where each
    came from (flag, config file, SLURM, default) and the notes for the user."""

    merged: Dict[str, Any]
    sources: Dict[str, str]
    notes: List[str]
    mode: str = "agent"


def resolve_plan(request: LaunchRequest, config: Any = None, env: Optional[Mapping[str, str]] = None,
                 gpu_count: int = 0, config_path: Optional[str] = None, notes: Sequence[str] = ()) -> LaunchPlan:
    """Combine flags, the configuration file (its settings as a mapping, a
    :class:`~anyaccel.config.schema.Config`, or None) and what was detected (``env``,
    ``gpu_count`` visible GPUs) into a :class:`LaunchPlan`, in named phases: merge (flag > file >
    default), SLURM, device, the configuration (built once, every value and rule checked once),
    processes, rendezvous, worker environment.

    Runs in the launcher only (``anyaccel launch``, ``anyaccel test`` and ``notebook_launcher``).
    Raises :class:`PlanError` (a one-paragraph message naming the value and where it came from)
    for impossible combinations. Pure: reads its arguments only.
    """
    env = os.environ if env is None else env
    draft = _merge(request, config, notes)
    step = _slurm(draft, request, env)
    device, force_cpu, usable_gpus, facts = _device(draft, request, env, gpu_count)
    cfg = _config(draft, config_path)
    nproc, nproc_per_node = _processes(draft, cfg, device, usable_gpus, facts)
    main_ip, port, rdzv = _rendezvous(draft, cfg, env)
    group, groups, group_size = _fault_tolerance(draft, cfg, nproc, nproc_per_node, env)
    run_id = f"anyaccel-{step.job_id}" if step is not None and step.in_step and \
        draft.sources.get("num_machines") == "SLURM" else "anyaccel"  # every machine must use the same id
    worker_env = _worker_env(draft, request, cfg, env, device, force_cpu, nproc_per_node)
    if group is not None:  # this launch is one replica group: its workers are told which (and how many)
        worker_env.update({envvars.REPLICA_GROUP.name: str(group), envvars.REPLICA_GROUPS.name: str(groups)})
    if request.num_processes is None and draft.sources["num_processes"] == "default" and device == "cpu" \
            and nproc == 1 and draft.mode == "agent":
        draft.notes.append("running 1 CPU process; pass --num_processes N for N CPU processes.")
    return LaunchPlan(
        target=request.target, is_module=request.is_module, script_args=tuple(request.script_args), mode=draft.mode,
        device=device, num_processes=nproc, num_machines=cfg.num_machines, machine_rank=cfg.machine_rank,
        nproc_per_node=nproc_per_node, main_process_ip=main_ip, main_process_port=port, rdzv_backend=rdzv,
        run_id=run_id, max_restarts=cfg.max_restarts, monitor_interval=cfg.monitor_interval,
        mixed_precision=cfg.mixed_precision, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        worker_env=tuple(sorted(worker_env.items())), strategy=effective_strategy_of(cfg),
        preemption_grace=cfg.preemption_grace, config_path=config_path, sources=tuple(sorted(draft.sources.items())),
        notes=tuple(draft.notes), debug=bool(request.debug), quiet=request.quiet, fault_tolerance=cfg.fault_tolerance,
        fault_tolerance_min_replicas=cfg.fault_tolerance_min_replicas, replica_group=group, replica_groups=groups,
        replica_group_size=group_size)


def _merge(request: LaunchRequest, config: Any, notes: Sequence[str]) -> _Draft:
    """Phase 1, merge: every configuration key takes its flag's value when given, else the file's,
    else its default (the option table's rows; a section such as ``parallelism_config`` is merged
    key by key, so a flag overrides one size and keeps the file's others)."""
    from ..config.schema import KEY_ROWS

    given = request.options()
    file_values: Dict[str, Any] = dict(config.to_dict() if hasattr(config, "to_dict") else config or {})
    draft = _Draft({}, {}, list(notes))
    for row in KEY_ROWS:
        key = row.key or row.name
        flags = {r.key: given[r.name] for r in optionspec.section_rows(key) if r.name in given}
        if flags:  # a section's flags: over the file's section
            value, where = {**(file_values.get(key) or {}), **flags}, "flag"
        elif row.name in given and row.flag:
            value, where = given[row.name], "flag"
        elif key in file_values:
            value, where = file_values[key], "config file"
        else:
            value, where = row.default, "default"
        draft.merged[key], draft.sources[key] = value, where
    if request.cpu:  # --cpu is the file's `device: cpu`
        draft.merged["device"], draft.sources["device"] = "cpu", "flag"
    return draft


def _slurm(draft: _Draft, request: LaunchRequest, env: Mapping[str, str]) -> Optional[SlurmJob]:
    """Phase 2, SLURM: inside an ``srun`` step SLURM decides the topology; a batch script
    without ``srun`` runs on its first node (with a note), never waiting for machines."""
    step = slurm_step(env)
    merged, sources = draft.merged, draft.sources
    if step is not None and not step.in_step and step.nnodes > 1:
        if merged["num_machines"] > 1:
            raise PlanError(
                f"num_machines is {merged['num_machines']} ({_src(sources, 'num_machines')}) but this "
                f"`anyaccel launch` was started by the SLURM batch script itself, not by srun, so no other "
                f"machine will ever join and the job would wait forever. Start one launcher per node: "
                f"`srun --ntasks-per-node=1 anyaccel launch ...` (or set ANYACCEL_DISABLE_SLURM=1 if you "
                f"start the other machines yourself)."
            )
        draft.notes.append(
            f"SLURM allocated {step.nnodes} node(s) and {step.ntasks} task(s), but this launcher was started by "
            f"the batch script, not by srun, so only this machine is used. Use `srun --ntasks-per-node=1 "
            f"anyaccel launch ...` to use every node."
        )
    elif step is not None and step.in_step and step.ntasks > 1:
        draft.mode = _apply_slurm(step, request, merged, sources, env, draft.notes)
    return step


def _device(draft: _Draft, request: LaunchRequest, env: Mapping[str, str],
            gpu_count: int) -> Tuple[str, bool, int, Any]:
    """Phase 3, device: the device kind (``auto``: GPUs when visible, else the CPU), the GPUs it
    may use, and what the device registry says of it; ``(device, forced cpu, usable GPUs, facts)``."""
    from ..backends import config_device  # the device registry (imports torch)

    merged, sources = draft.merged, draft.sources
    device = merged["device"]
    force_cpu = device == "cpu"  # asked for; "auto" without GPUs leaves MPS possible for one process
    if request.multi_gpu and gpu_count == 0 and not force_cpu:
        raise PlanError(
            f"--multi_gpu asks for one process per GPU, but no CUDA GPU is visible here "
            f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '<unset>')}), and anyaccel does not quietly "
            "start CPU processes instead. Pass --cpu (with --num_processes N) to run on the CPU, or fix the GPU setup "
            "(`anyaccel env` shows what was found).")
    if device == "auto":
        device = "gpu" if gpu_count > 0 else "cpu"
    if device == "gpu" and gpu_count == 0:
        raise PlanError(
            f"device is gpu ({_src(sources, 'device')}) but no CUDA GPU is visible "
            f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '<unset>')}). Pass --cpu to run on the "
            "CPU, or fix the GPU setup (`anyaccel env` shows what was found)."
        )
    usable_gpus = 0
    if device == "gpu":
        usable_gpus = gpu_count
        if merged["gpu_ids"] != "all":
            ids = [int(i) for i in str(optionspec.check(optionspec.option("gpu_ids"), merged["gpu_ids"])).split(",")]
            if "CUDA_VISIBLE_DEVICES" not in env and max(ids) >= gpu_count:
                raise PlanError(
                    f"--gpu_ids {merged['gpu_ids']} ({_src(sources, 'gpu_ids')}) names GPU {max(ids)}, but this "
                    f"machine has {gpu_count} GPU(s) (ids 0 to {gpu_count - 1})."
                )
            usable_gpus = len(ids)
    elif merged["gpu_ids"] != "all" and sources.get("gpu_ids") == "flag":
        draft.notes.append(f"--gpu_ids {merged['gpu_ids']} is ignored: the job runs on the {device}.")
    facts = config_device(device)  # what the device registry knows of it (None: auto)
    if facts is not None and facts.communication is None and merged["num_processes"] not in (None, 1):
        raise PlanError(  # a device without a communication backend (Apple MPS) runs one process
            f"num_processes is {merged['num_processes']} ({_src(sources, 'num_processes')}) but {facts.name} runs "
            "one process; use --num_processes 1, or --cpu for several CPU processes."
        )
    if merged["num_processes"] is None:
        per_machine = 0 if facts is not None and facts.owns_processes else usable_gpus or 1  # 0: torch-xla decides
        n = merged["num_machines"]
        merged["num_processes"] = per_machine * n if per_machine and isinstance(n, int) else None
    merged["device"] = device if facts is not None else "auto"
    return device, force_cpu, usable_gpus, facts


def _config(draft: _Draft, config_path: Optional[str]) -> Any:
    """Phase 4, the configuration: built once from the merged settings, which checks every value
    (by its option row) and the rules between keys; a problem names where the value came from."""
    from ..config.schema import Config, ConfigError

    merged = dict(draft.merged)
    merged["compute_environment"] = "several_machines" if merged["num_machines"] != 1 else "this_machine"
    if draft.mode == "in_process":  # srun's tasks need not divide evenly over its nodes (2 + 1 is fine)
        merged["num_processes"] = None
    try:
        return Config(**merged)
    except ConfigError as exc:
        key = exc.key or ""
        where = _src(draft.sources, key)
        if draft.sources.get(key) == "config file" and config_path:
            where += f" {config_path}"
        raise PlanError(f"{exc.message} ({key} {where})") from None


def _processes(draft: _Draft, cfg: Any, device: str, usable_gpus: int, facts: Any) -> Tuple[int, int]:
    """Phase 5, processes: the total and this machine's share; the mode for a device whose own
    runtime starts them (torch-xla: ``xla``)."""
    n_machines = cfg.num_machines
    nproc = (draft.merged["num_processes"] if draft.mode == "in_process" else cfg.num_processes) or 0
    if draft.mode == "in_process":
        nproc_per_node = 1
    elif facts is not None and facts.owns_processes:
        draft.mode = "xla"  # the device's own launcher (torch-xla's) starts the processes
        nproc_per_node = nproc // n_machines if nproc else 0
    else:
        nproc_per_node = nproc // n_machines
    if device == "gpu" and draft.mode == "agent" and nproc_per_node > usable_gpus:
        draft.notes.append(
            f"{nproc_per_node} processes per machine share {usable_gpus} GPU(s); they fall back to the gloo "
            "backend (NCCL needs one GPU per process)."
        )
    sizes = parallelism_sizes(cfg) or {}
    if (inner := sizes.get("tp_size", 1) * sizes.get("cp_size", 1)) > 1 and nproc_per_node % inner:
        draft.notes.append(f"tp_size x cp_size = {inner} does not divide the {nproc_per_node} processes of a machine: "
                           "tensor-parallel groups will span machines (every layer then waits on the network).")
    return nproc, nproc_per_node


def _rendezvous(draft: _Draft, cfg: Any, env: Mapping[str, str]) -> Tuple[str, Optional[int], str]:
    """Phase 6, rendezvous: one machine listens on loopback (a free port unless one was asked
    for); several meet at the main machine's address and port, except the replica groups of a
    fault-tolerant launch on several machines (not told its group): each group meets on its own
    machine, and the main address and port are where machine 0 serves the Lighthouse."""
    sources = draft.sources
    if cfg.num_machines == 1:
        port = cfg.main_process_port if sources["main_process_port"] != "default" else None
        if sources.get("main_process_ip") == "flag" and cfg.main_process_ip not in (None, "127.0.0.1", "localhost"):
            draft.notes.append(f"--main_process_ip {cfg.main_process_ip} is ignored on one machine (the rendezvous "
                               "uses 127.0.0.1).")
        if sources.get("rdzv_backend") == "flag":
            draft.notes.append(f"--rdzv_backend {cfg.rdzv_backend} is ignored on one machine (a loopback store is "
                               "used).")
        return "127.0.0.1", port, "static"
    if cfg.fault_tolerance != "off" and _told_replica_group(env) is None:
        if sources.get("rdzv_backend") == "flag" and cfg.rdzv_backend != "static":
            draft.notes.append(f"--rdzv_backend {cfg.rdzv_backend} is ignored: with fault tolerance each replica group "
                               "meets on its own machine (a loopback store), and its agent restarts it there.")
        return cfg.main_process_ip, cfg.main_process_port or DEFAULT_MAIN_PORT, "static"
    if cfg.rdzv_backend == "static" and cfg.max_restarts > 0:
        raise PlanError(
            f"max_restarts {cfg.max_restarts} ({_src(sources, 'max_restarts')}) with {cfg.num_machines} machines needs "
            "--rdzv_backend c10d: torch's static rendezvous keeps one store, so a restarted group would read the "
            "previous attempt's addresses and fail to connect. Add --rdzv_backend c10d (the rendezvous then "
            "assigns the machine ranks; --machine_rank 0 still hosts its store), or use --max_restarts 0."
        )
    return cfg.main_process_ip, cfg.main_process_port or DEFAULT_MAIN_PORT, cfg.rdzv_backend


def _told_replica_group(env: Mapping[str, str]) -> Optional[Tuple[str, str]]:
    """``(group, groups)`` where the environment tells this launch it is one replica group (both
    ``ANYACCEL_REPLICA_GROUP`` and ``ANYACCEL_REPLICA_GROUPS`` set: one SLURM job step per group),
    else None. Local, pure."""
    group, groups = envvars.read(envvars.REPLICA_GROUP, env), envvars.read(envvars.REPLICA_GROUPS, env)
    return (group, groups) if group is not None and groups is not None else None


def _fault_tolerance(draft: _Draft, cfg: Any, nproc: int, nproc_per_node: int, env: Mapping[str, str]
                     ) -> Tuple[Optional[int], int, int]:
    """Phase 6b, fault tolerance (``fault_tolerance`` not off): ``(this launch's replica group or
    None, groups, processes per group)``; ``(None, 1, 1)`` when off. Either this launch *is* one
    replica group (``ANYACCEL_REPLICA_GROUP`` and ``ANYACCEL_REPLICA_GROUPS`` set: one SLURM job
    step per group, every process of the launch in it, the Lighthouse's ``HOST:PORT`` given), or
    it starts every group of its machine (:mod:`anyaccel.launch.replica_groups`, one agent each):
    with ``parallelism_config`` its ``dp_replicate`` dimension (torchft manages it: the groups
    share no torch group), each group the other sizes' processes (FSDP2's ``dp_shard``, ...);
    without, one process per group. On several machines each runs an equal share of the groups
    (a group stays on one machine), and ``fault_tolerance on`` serves the Lighthouse on machine 0
    at the main process's address and port (no job-wide rendezvous uses them). What this release
    cannot do is refused here."""
    if cfg.fault_tolerance == "off":
        return None, 1, 1
    where = _src(draft.sources, "fault_tolerance")
    from ..fault_tolerance.settings import torchft_missing

    missing = torchft_missing()
    if missing:
        raise PlanError(f"{missing} ({where})")
    given = _told_replica_group(env)
    if given is not None:  # this launch is one replica group
        if cfg.fault_tolerance == "on":
            raise PlanError(f"fault_tolerance on ({where}) starts a Lighthouse for the groups of this launch, but "
                            f"{envvars.REPLICA_GROUP.name}={given[0]} says this launch is one group of {given[1]}: "
                            "give the address of the job's Lighthouse instead (--fault_tolerance HOST:PORT)")
        return int(given[0]), int(given[1]), nproc
    if draft.mode != "agent":
        raise PlanError(f"fault_tolerance {cfg.fault_tolerance} ({where}) needs anyaccel launch to start the processes; "
                        f"inside srun with several tasks per node it cannot (run one srun step per replica group, each "
                        f"`anyaccel launch --fault_tolerance HOST:PORT`, with {envvars.REPLICA_GROUP.name} and "
                        f"{envvars.REPLICA_GROUPS.name} set: examples/slurm/fault_tolerance.sbatch), or set it to off")
    sizes = parallelism_sizes(cfg) or {}
    machines = cfg.num_machines
    groups = int(sizes.get("dp_replicate_size") or 1) if sizes else nproc_per_node * machines
    if sizes and (groups < 2 or int(sizes.get("pp_size") or 1) > 1):
        raise PlanError(f"fault_tolerance {cfg.fault_tolerance} ({where}) with parallelism_config makes its dp_replicate "
                        f"dimension the replica groups: set dp_replicate_size to the number of groups (2 or more; it is "
                        f"{groups}), and pp_size to 1 (pipeline stages are not supported yet)")
    if sizes and groups % machines:
        raise PlanError(f"fault_tolerance {cfg.fault_tolerance} ({where}) runs an equal share of the replica groups on "
                        f"each machine (a group does not span machines): dp_replicate_size {groups} does not divide "
                        f"over {machines} machines; make it a multiple of num_machines")
    if machines > 1 and draft.sources.get("machine_rank", "default") == "default":
        raise PlanError(f"fault_tolerance {cfg.fault_tolerance} ({where}) on {machines} machines: each machine starts "
                        "its share of the replica groups by its machine rank, and none was given (a second machine "
                        "taking rank 0 would start groups that already run and train on their data); pass "
                        "--machine_rank K on machine K (0 on the one at --main_process_ip)")
    if not sizes and effective_strategy_of(cfg) != "auto":
        raise PlanError(f"fault_tolerance {cfg.fault_tolerance} ({where}) makes every process a replica group of its "
                        f"own, and the {effective_strategy_of(cfg)} strategy ({_src(draft.sources, 'strategy')}) "
                        "cannot split one process; leave the strategy to its default, or give parallelism_config "
                        "with dp_replicate_size = the number of groups (FSDP2 inside each group: dp_shard_size)")
    if cfg.fault_tolerance_min_replicas > groups:
        raise PlanError(f"fault_tolerance_min_replicas {cfg.fault_tolerance_min_replicas} "
                        f"({_src(draft.sources, 'fault_tolerance_min_replicas')}) is more than the {groups} "
                        "replica groups: no step could commit; lower it or start more groups")
    return None, groups, nproc_per_node // (groups // machines)


def _worker_env(draft: _Draft, request: LaunchRequest, cfg: Any, env: Mapping[str, str], device: str,
                force_cpu: bool, nproc_per_node: int) -> Dict[str, str]:
    """Phase 7, what the workers are told: every option of the table that reaches the worker
    (its variable), from the configuration; then the device's and the threads' variables."""
    told: Dict[str, Any] = {}
    for row in optionspec.options_with("worker"):
        if not row.variable:
            continue
        if row.section == "parallelism_config":  # a size: all of them once the section is set (1 where not given)
            told[row.name] = (parallelism_sizes(cfg) or {}).get(row.name)
        elif row.section:  # a setting of a section (deepspeed_config): as given
            told[row.name] = (getattr(cfg, row.section) or {}).get(row.key)
        elif row.key:
            told[row.name] = getattr(cfg, row.key)
    told.update(cpu=force_cpu, debug=bool(request.debug), strategy=effective_strategy_of(cfg))
    worker_env: Dict[str, str] = envvars.worker_env(**told)
    if device == "gpu" and cfg.gpu_ids != "all":
        worker_env["CUDA_VISIBLE_DEVICES"] = cfg.gpu_ids
    if request.num_cpu_threads_per_process is not None:
        worker_env["OMP_NUM_THREADS"] = str(request.num_cpu_threads_per_process)
    elif "OMP_NUM_THREADS" not in env and nproc_per_node > 1:
        worker_env["OMP_NUM_THREADS"] = "1"  # as torchrun: N processes must not each take every core
    if draft.mode == "in_process":
        if request.main_process_ip:
            worker_env["MASTER_ADDR"] = request.main_process_ip
        if request.main_process_port:
            worker_env["MASTER_PORT"] = str(request.main_process_port)
    return worker_env


def effective_strategy_of(cfg: Any) -> str:
    """The strategy the configuration asks for, ``auto`` when decided at run time (options alone
    ask for theirs: ``parallelism_config``: nd; ``fsdp_config`` alone: fsdp)."""
    from ..config.schema import effective_strategy

    return effective_strategy(cfg) or "auto"


def _src(sources: Mapping[str, str], key: str) -> str:
    """Where a value came from, for messages: "from --num_processes", "from the config file", ..."""
    where = sources.get(key, "default")
    if where == "flag":
        return f"from {_flag_of(key)}"
    if where == "default":
        return "by default"
    return f"from the {where}" if where == "config file" else f"from {where}"


def _flag_of(key: str) -> str:
    """The flag(s) that set configuration key ``key``, for messages."""
    if key == "device":
        return "--cpu"
    flags = [row.flag for row in optionspec.section_rows(key) if row.flag]
    if flags:  # a section's flags share a prefix (--parallelism_config_*, --fsdp_*), or are its group's
        prefix = os.path.commonprefix(flags)
        return f"{prefix}* flags" if len(prefix) > 2 else f"the {key} flags ({', '.join(flags[:2])}, ...)"
    row = next((r for r in optionspec.options_with("flag") if r.key == key), None)
    return row.flag if row is not None and row.flag else key


def _apply_slurm(
    step: SlurmJob, request: LaunchRequest, merged: dict, sources: dict, env: Mapping[str, str], notes: list
) -> str:
    """Fill the topology from an srun step with several tasks; returns the mode."""
    if request.num_machines is not None and request.num_machines != step.nnodes:
        raise PlanError(
            f"--num_machines {request.num_machines} but this srun step runs on {step.nnodes} node(s) "
            f"(SLURM_NNODES). Drop --num_machines inside srun, or change `srun --nodes`."
        )
    if request.machine_rank is not None and request.machine_rank != step.node_id:
        raise PlanError(
            f"--machine_rank {request.machine_rank} but SLURM runs this task on node {step.node_id} "
            "(SLURM_NODEID). Drop --machine_rank inside srun."
        )
    if step.tasks_are_workers:
        requested = merged["num_processes"]
        if requested is not None and requested != step.ntasks:
            where = _src(sources, "num_processes")
            if sources["num_processes"] == "flag":
                raise PlanError(
                    f"--num_processes {requested} but srun started {step.ntasks} tasks (SLURM_NTASKS), and with "
                    f"several tasks per node every task is one process. Either drop --num_processes, or run "
                    f"`srun --ntasks {requested} ...`, or start one task per node (`srun --ntasks-per-node=1 "
                    f"anyaccel launch --num_processes {requested} ...`) and let the launcher start the processes."
                )
            notes.append(
                f"num_processes {requested} ({where}) is ignored: srun started {step.ntasks} tasks and each is "
                "one process."
            )
        merged["num_processes"] = step.ntasks
        merged["num_machines"] = step.nnodes
        merged["machine_rank"] = step.node_id
        if step.nnodes > 1 and not merged.get("main_process_ip"):
            merged["main_process_ip"] = step.main_address(env)
        for key in ("num_processes", "num_machines", "machine_rank"):
            sources[key] = "SLURM"
        return "in_process"
    # one task per node: this task is the node's agent
    merged["num_machines"] = step.nnodes
    merged["machine_rank"] = step.node_id
    sources["num_machines"] = sources["machine_rank"] = "SLURM"
    if request.main_process_ip is None:
        merged["main_process_ip"] = step.main_address(env)
        sources["main_process_ip"] = "SLURM"
    if request.main_process_port is None:
        merged["main_process_port"] = step.main_port(env)
        sources["main_process_port"] = "SLURM"
    if not merged["main_process_ip"]:
        raise PlanError(
            "SLURM_NODELIST is empty, so the main node is unknown; pass --main_process_ip <host of node 0>."
        )
    return "agent"
