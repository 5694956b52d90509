"""What ``anyaccel launch`` will do, decided before anything starts: a frozen :class:`LaunchPlan`.

:func:`resolve_plan` is a pure function of the command-line values, the configuration file, the
environment variables and the number of visible GPUs; what a device allows (one process on Apple
MPS, torch-xla starting the TPU processes) is read from the device registry's facts
(:func:`anyaccel.backends.config_device`, imported when a plan is made). It spawns nothing, so
every rule below is unit-tested without processes.

Precedence, for every setting: **explicit flag > configuration file > detected default**.

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
from typing import Any, Dict, Mapping, Optional, Tuple

from .. import envvars
from ..errors import JobEnvironmentError, PlanError
from ..slurm import SlurmJob, read_slurm

__all__ = ["LaunchRequest", "LaunchPlan", "PlanError", "resolve_plan", "slurm_step"]


@dataclasses.dataclass(frozen=True)
class LaunchRequest:
    """The command line, with ``None`` for every flag that was not given."""

    target: str
    is_module: bool = False
    script_args: Tuple[str, ...] = ()
    num_processes: Optional[int] = None
    num_machines: Optional[int] = None
    machine_rank: Optional[int] = None
    main_process_ip: Optional[str] = None
    main_process_port: Optional[int] = None
    mixed_precision: Optional[str] = None
    cpu: bool = False
    gpu_ids: Optional[str] = None
    gradient_accumulation_steps: Optional[int] = None
    max_restarts: Optional[int] = None
    monitor_interval: Optional[float] = None
    rdzv_backend: Optional[str] = None
    num_cpu_threads_per_process: Optional[int] = None
    strategy: Optional[str] = None
    fsdp_options: Tuple[Tuple[str, Any], ...] = ()  # --fsdp_* flags given, by config key
    parallelism_options: Tuple[Tuple[str, int], ...] = ()  # --parallelism_config_* flags given, by config key
    dynamo_backend: Optional[str] = None
    dynamo_mode: Optional[str] = None
    hang_timeout: Optional[float] = None
    preemption_signals: Optional[str] = None
    preemption_grace: Optional[float] = None
    debug: bool = False
    quiet: bool = False


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

    @property
    def single_machine(self) -> bool:
        return self.num_machines == 1

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

_FLAG = {
    "num_processes": "--num_processes",
    "num_machines": "--num_machines",
    "machine_rank": "--machine_rank",
    "main_process_ip": "--main_process_ip",
    "main_process_port": "--main_process_port",
    "mixed_precision": "--mixed_precision",
    "gpu_ids": "--gpu_ids",
    "gradient_accumulation_steps": "--gradient_accumulation_steps",
    "max_restarts": "--max_restarts",
    "monitor_interval": "--monitor_interval",
    "rdzv_backend": "--rdzv_backend",
    "device": "--cpu",
    "strategy": "--strategy",
    "fsdp_config": "--fsdp_* flags",
    "parallelism_config": "--parallelism_config_* flags",
    "dynamo_backend": "--dynamo_backend",
    "dynamo_mode": "--dynamo_mode",
    "hang_timeout": "--hang_timeout",
    "preemption_signals": "--preemption_signals",
    "preemption_grace": "--preemption_grace",
}


def resolve_plan(
    request: LaunchRequest,
    config: Any = None,
    env: Optional[Mapping[str, str]] = None,
    gpu_count: int = 0,
    config_path: Optional[str] = None,
) -> LaunchPlan:
    """Combine flags, the configuration file (a :class:`~anyaccel.config.schema.Config` or None) and
    what was detected (``env``, ``gpu_count`` visible GPUs) into a :class:`LaunchPlan`.

    Runs in the launcher only. Raises :class:`PlanError` (a one-paragraph message naming the value
    and where it came from) for impossible combinations. Pure: reads its arguments only.
    """
    import os

    from ..backends import config_device  # the device registry (imports torch)
    from ..config.schema import Config, ConfigError, effective_strategy, parallelism_sizes

    env = os.environ if env is None else env
    base = config if config is not None else Config()
    from_file = config is not None
    sources: Dict[str, str] = {}
    notes = []

    def pick(key: str, flag_value: Any) -> Any:
        if flag_value is not None:
            sources[key] = "flag"
            return flag_value
        sources[key] = "config file" if from_file else "default"
        return getattr(base, key)

    merged = {
        key: pick(key, getattr(request, key))
        for key in (
            "num_machines", "machine_rank", "main_process_ip", "main_process_port", "mixed_precision",
            "gpu_ids", "gradient_accumulation_steps", "max_restarts", "monitor_interval", "rdzv_backend",
            "strategy", "dynamo_backend", "dynamo_mode", "hang_timeout", "preemption_signals", "preemption_grace",
        )
    }  # fmt: skip
    fsdp_flags = dict(request.fsdp_options)
    merged["fsdp_config"] = pick("fsdp_config", {**(base.fsdp_config or {}), **fsdp_flags} if fsdp_flags else None)
    nd_flags = dict(request.parallelism_options)  # flags override the file's sizes one by one
    merged["parallelism_config"] = pick("parallelism_config",
                                        {**(base.parallelism_config or {}), **nd_flags} if nd_flags else None)
    explicit_nproc = request.num_processes
    merged["num_processes"] = pick("num_processes", request.num_processes)
    merged["device"] = pick("device", "cpu" if request.cpu else None)

    # ---- SLURM decides the topology when this is an srun step ------------------------------
    step = slurm_step(env)
    mode = "agent"
    if step is not None and not step.in_step and step.nnodes > 1:
        if merged["num_machines"] > 1:
            raise PlanError(
                f"num_machines is {merged['num_machines']} ({_src(sources, 'num_machines')}) but this "
                f"`anyaccel launch` was started by the SLURM batch script itself, not by srun, so no other "
                f"machine will ever join and the job would wait forever. Start one launcher per node: "
                f"`srun --ntasks-per-node=1 anyaccel launch ...` (or set ANYACCEL_DISABLE_SLURM=1 if you "
                f"start the other machines yourself)."
            )
        notes.append(
            f"SLURM allocated {step.nnodes} node(s) and {step.ntasks} task(s), but this launcher was started by "
            f"the batch script, not by srun, so only this machine is used. Use `srun --ntasks-per-node=1 "
            f"anyaccel launch ...` to use every node."
        )
    elif step is not None and step.in_step and step.ntasks > 1:
        mode = _apply_slurm(step, request, merged, sources, env, notes)

    # ---- device and number of processes ----------------------------------------------------
    device = merged["device"]
    force_cpu = device == "cpu"  # asked for; "auto" without GPUs leaves MPS possible for one process
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
            ids = [int(i) for i in str(merged["gpu_ids"]).split(",")]
            if "CUDA_VISIBLE_DEVICES" not in env and max(ids) >= gpu_count:
                raise PlanError(
                    f"--gpu_ids {merged['gpu_ids']} ({_src(sources, 'gpu_ids')}) names GPU {max(ids)}, but this "
                    f"machine has {gpu_count} GPU(s) (ids 0 to {gpu_count - 1})."
                )
            usable_gpus = len(ids)
    elif merged["gpu_ids"] != "all" and sources.get("gpu_ids") == "flag":
        notes.append(f"--gpu_ids {merged['gpu_ids']} is ignored: the job runs on the {device}.")
    facts = config_device(device)  # what the device registry knows of it (None: auto)
    if facts is not None and facts.communication is None and merged["num_processes"] not in (None, 1):
        raise PlanError(  # a device without a communication backend (Apple MPS) runs one process
            f"num_processes is {merged['num_processes']} ({_src(sources, 'num_processes')}) but {facts.name} runs "
            "one process; use --num_processes 1, or --cpu for several CPU processes."
        )
    owns_processes = facts is not None and facts.owns_processes  # its runtime starts the processes (TPU)

    n_machines = merged["num_machines"]
    if merged["num_processes"] is None:
        per_machine = usable_gpus if usable_gpus > 0 else 1
        if owns_processes:
            per_machine = 0  # the device's runtime (torch-xla) decides
        merged["num_processes"] = per_machine * n_machines if per_machine else None
    merged["compute_environment"] = "several_machines" if n_machines > 1 else "this_machine"
    merged["device"] = device if facts is not None else "auto"
    checked = dict(merged)
    if mode == "in_process":  # srun's tasks need not divide evenly over its nodes (2 + 1 is fine)
        checked["num_processes"] = None
    try:
        cfg = Config(**{**base.to_dict(), **checked})
    except ConfigError as exc:
        key = exc.key or ""
        raise PlanError(f"{exc.message} ({key} {_src(sources, key)})") from None

    nproc = (merged["num_processes"] if mode == "in_process" else cfg.num_processes) or 0
    if mode == "in_process":
        nproc_per_node = 1
    elif owns_processes:
        mode = "xla"  # the device's own launcher (torch-xla's) starts the processes
        nproc_per_node = nproc // n_machines if nproc else 0
    else:
        nproc_per_node = nproc // n_machines
    if device == "gpu" and mode == "agent" and nproc_per_node > usable_gpus:
        notes.append(
            f"{nproc_per_node} processes per machine share {usable_gpus} GPU(s); they fall back to the gloo "
            "backend (NCCL needs one GPU per process)."
        )

    # ---- rendezvous -----------------------------------------------------------------------
    if n_machines == 1:
        main_ip = "127.0.0.1"  # one machine: the rendezvous is bound to loopback only
        port = cfg.main_process_port if sources["main_process_port"] != "default" else None
        rdzv = "static"
        if sources.get("main_process_ip") == "flag" and cfg.main_process_ip not in (None, "127.0.0.1", "localhost"):
            notes.append(f"--main_process_ip {cfg.main_process_ip} is ignored on one machine (the rendezvous uses 127.0.0.1).")
        if sources.get("rdzv_backend") == "flag":
            notes.append(f"--rdzv_backend {cfg.rdzv_backend} is ignored on one machine (a loopback store is used).")
    else:
        main_ip = cfg.main_process_ip
        port = cfg.main_process_port or 29500
        rdzv = cfg.rdzv_backend
        if rdzv == "static" and cfg.max_restarts > 0:
            raise PlanError(
                f"max_restarts {cfg.max_restarts} ({_src(sources, 'max_restarts')}) with {n_machines} machines needs "
                "--rdzv_backend c10d: torch's static rendezvous keeps one store, so a restarted group would read the "
                "previous attempt's addresses and fail to connect. Add --rdzv_backend c10d (the rendezvous then "
                "assigns the machine ranks; --machine_rank 0 still hosts its store), or use --max_restarts 0."
            )
    # the SLURM job id names the run only when SLURM set the machines (machines launched by hand
    # may each sit in a job of their own; every machine must use the same id)
    run_id = f"anyaccel-{step.job_id}" if step is not None and step.in_step and sources.get("num_machines") == "SLURM" \
        else "anyaccel"

    # ---- what the workers are told ---------------------------------------------------------
    # options alone ask for their strategy (parallelism_config: nd; fsdp_config alone: fsdp): the
    # registry's rule, which Config already checked (a contradiction raised above)
    strategy = effective_strategy(cfg) or "auto"
    sizes = parallelism_sizes(cfg) or {}
    if (inner := sizes.get("tp_size", 1) * sizes.get("cp_size", 1)) > 1 and nproc_per_node % inner:
        notes.append(f"tp_size x cp_size = {inner} does not divide the {nproc_per_node} processes of a machine: "
                     "tensor-parallel groups will span machines (every layer then waits on the network).")
    worker_env: Dict[str, str] = envvars.worker_env(
        use_cpu=force_cpu, mixed_precision=cfg.mixed_precision,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, debug=request.debug,
        strategy=None if strategy == "auto" else strategy, fsdp_config=cfg.fsdp_config,
        dynamo_backend=None if cfg.dynamo_backend == "no" else cfg.dynamo_backend, dynamo_mode=cfg.dynamo_mode,
        hang_timeout=cfg.hang_timeout, preemption_signals=cfg.preemption_signals, **sizes,
    )
    if device == "gpu" and cfg.gpu_ids != "all":
        worker_env["CUDA_VISIBLE_DEVICES"] = cfg.gpu_ids
    if request.num_cpu_threads_per_process is not None:
        worker_env["OMP_NUM_THREADS"] = str(request.num_cpu_threads_per_process)
    elif "OMP_NUM_THREADS" not in env and nproc_per_node > 1:
        worker_env["OMP_NUM_THREADS"] = "1"  # as torchrun: N processes must not each take every core
    if mode == "in_process":
        if request.main_process_ip:
            worker_env["MASTER_ADDR"] = request.main_process_ip
        if request.main_process_port:
            worker_env["MASTER_PORT"] = str(request.main_process_port)

    if explicit_nproc is None and sources["num_processes"] == "default" and device == "cpu" and nproc == 1 and mode == "agent":
        notes.append("running 1 CPU process; pass --num_processes N for N CPU processes.")
    return LaunchPlan(
        target=request.target,
        is_module=request.is_module,
        script_args=tuple(request.script_args),
        mode=mode,
        device=device,
        num_processes=nproc,
        num_machines=n_machines,
        machine_rank=cfg.machine_rank,
        nproc_per_node=nproc_per_node,
        main_process_ip=main_ip,
        main_process_port=port,
        rdzv_backend=rdzv,
        run_id=run_id,
        max_restarts=cfg.max_restarts,
        monitor_interval=cfg.monitor_interval,
        mixed_precision=cfg.mixed_precision,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        worker_env=tuple(sorted(worker_env.items())),
        strategy=strategy,
        preemption_grace=cfg.preemption_grace,
        config_path=config_path,
        sources=tuple(sorted(sources.items())),
        notes=tuple(notes),
        debug=request.debug,
        quiet=request.quiet,
    )


def _src(sources: Mapping[str, str], key: str) -> str:
    """Where a value came from, for messages: "from --num_processes", "from the config file", ..."""
    where = sources.get(key, "default")
    if where == "flag":
        return f"from {_FLAG.get(key, key)}"
    if where == "default":
        return "by default"
    return f"from the {where}" if where == "config file" else f"from {where}"


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
