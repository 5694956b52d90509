"""``notebook_launcher`` and ``debug_launcher``: run a *function* on several processes.

A function defined in a notebook cell cannot be pickled, so the workers are **forked** from the
calling process: on one machine without restarts (``max_restarts=0``, the default) by the calling
process itself (:mod:`anyaccel.launch.forked`: torch's elastic agent took most of the start-up);
with ``max_restarts`` > 0 or on several machines (``num_nodes``) by torch's elastic agent
(``start_method="fork"``). Both give the workers the same variables and report failures the same
way. On a TPU, torch-xla's own spawn starts the processes (:func:`anyaccel.backends.xla.spawn`).

Everything that would make a fork unsafe is checked before anything starts, with a message that
says what to change: an ``Accelerator`` already created in this process, CUDA already initialised,
a process group already joined, more processes than GPUs.

The function runs in every worker; an exception in one is re-raised here as
:class:`~anyaccel.errors.WorkerFailedError` with its rank and traceback (the other workers
are stopped). The return value of rank 0 is returned (it must be picklable).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, Callable, Dict, Optional, Sequence, Union

from .. import envvars, optionspec
from ..backends import backend_class
from ..environment import resolve_environment
from ..errors import LauncherError, PlanError, WorkerFailedError
from . import failures as _failures
from ..process.preemption import PREEMPTED_EXIT_CODE
from .bootstrap import note_exit
from .plan import LaunchPlan

# What each worker's `Accelerator()` loads when it is made (its options, its runtime), loaded here in the
# kernel, before the fork: the forked workers share it instead of each importing it after the fork.
# (`from anyaccel import Accelerator` does not load it: the import budget.)
from .. import checkpoint as _checkpoint, runtime as _runtime  # noqa: E402,F401
from ..doctor import giveup as _giveup  # noqa: E402,F401
from ..strategies import base as _strategy_base  # noqa: E402,F401
from ..compat import arguments as _arguments, version_gate as _version_gate  # noqa: E402,F401

_failures.add_plumbing(__file__)

__all__ = ["notebook_launcher", "debug_launcher", "WorkerFailedError", "LauncherError"]


def notebook_launcher(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_processes: Optional[int] = None,
    mixed_precision: str = "no",
    use_port: Union[int, str, None] = None,
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    max_restarts: int = 0,
    monitor_interval: float = 0.02,
    gradient_accumulation_steps: Optional[int] = None,
) -> Any:
    """Run ``function(*args)`` on ``num_processes`` processes of this machine (the caller's
    process forks them) and return rank 0's return value. Local: called once, in the notebook's
    process (one per machine with several machines), never inside the workers.

    ``num_processes`` counts the processes *on this machine* (as in Accelerate); default: one per
    visible GPU, else 1. With one process (and one machine) the function simply runs here.
    On a CPU-only machine ``num_processes=2`` gives two real CPU ranks (gloo). Several machines:
    call it on each with the same ``master_addr``/``use_port``/``num_nodes`` and its ``node_rank``
    (the machine with rank 0 gets rank 0's return value, the others None). Without ``use_port`` a
    single machine uses a free loopback port.
    ``max_restarts`` > 0 (restarts after a failure): torch's elastic agent watches the workers.

    On a TPU, torch-xla's spawn runs the function (``num_processes`` None: one process per
    device) and returns nothing (None).

    Create the ``Accelerator`` *inside* ``function``. Raises :class:`LauncherError` before starting
    anything when that is violated, when CUDA is already initialised here, or when there are more
    processes than GPUs; raises :class:`WorkerFailedError` (rank, traceback, ``original``) when a
    worker raises; ``KeyboardInterrupt`` when interrupted (every worker is stopped).
    """
    from ..environment import devices

    mixed_precision = optionspec.check(optionspec.option("mixed_precision"), mixed_precision, "mixed_precision")
    backend = _spawning_backend()
    if backend is not None:
        _check_parent(use_cpu=True)
        worker_env = _worker_env(mixed_precision, False, gradient_accumulation_steps, num_processes)
        with envvars.set_temporarily(worker_env):
            return backend.spawn(function, tuple(args), num_processes)
    gpus = devices.cuda_device_count()
    if num_processes is None:
        num_processes = gpus or 1
    num_processes = optionspec.check(optionspec.option("num_processes"), num_processes, "num_processes")
    if num_processes == 1 and num_nodes == 1:
        with envvars.set_temporarily(_worker_env(mixed_precision, False, gradient_accumulation_steps, 1)):
            return function(*args)
    if gpus and num_processes > gpus:
        raise LauncherError(
            f"num_processes={num_processes} but this machine has {gpus} visible GPU(s); use "
            f"num_processes={gpus} (or fewer), or debug_launcher(function, num_processes={num_processes}) for CPU processes."
        )
    _check_parent(use_cpu=False)
    return _launch_forked(
        function, tuple(args), num_processes, mixed_precision, use_port, master_addr, node_rank, num_nodes,
        rdzv_backend, max_restarts, monitor_interval, use_cpu=False, accumulation=gradient_accumulation_steps,
    )  # fmt: skip


def debug_launcher(function: Callable[..., Any], args: Sequence[Any] = (), num_processes: int = 2) -> Any:
    """Run ``function(*args)`` on ``num_processes`` forked CPU processes (gloo) of this machine,
    even when GPUs are present, and return rank 0's result: for debugging distributed code on a
    laptop. Same checks and error reporting as :func:`notebook_launcher`. Local: called once, in the
    parent process, which forks the workers."""
    num_processes = optionspec.check(optionspec.option("num_processes"), num_processes, "num_processes")
    _check_parent(use_cpu=True)
    return _launch_forked(function, tuple(args), num_processes, "no", None, "127.0.0.1", 0, 1, "static", 0, 0.1,
                          use_cpu=True, accumulation=None)


# --------------------------------------------------------------------------------------------
# Checks before anything starts
# --------------------------------------------------------------------------------------------


def _live_accelerators() -> int:
    """How many ``Accelerator`` objects are alive in this process (0 when never imported)."""
    module = sys.modules.get("anyaccel.accelerator")
    if module is None:
        return 0
    return len(module._live_instances)


def _check_parent(use_cpu: bool) -> None:
    from ..environment import devices

    if _live_accelerators():
        raise LauncherError(
            "an Accelerator already exists in this process (a cell created `Accelerator()` before calling the "
            "launcher). The workers are forked from this process and must each create their own: move "
            "`accelerator = Accelerator()` inside the training function, then restart the kernel (or `del` the "
            "Accelerator) and call the launcher again."
        )
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        raise LauncherError(
            "a torch.distributed process group already exists in this process; forked workers cannot join "
            "a new one. Restart the kernel and do not call init_process_group (or create an Accelerator) "
            "outside the training function."
        )
    if not use_cpu and devices.cuda_initialized():
        raise LauncherError(
            "CUDA is already initialised in this process, and a forked process cannot use CUDA after that. "
            "Likely cause: a cell ran CUDA code before the launcher, e.g. `model.cuda()`, `model.to('cuda')`, "
            "`torch.randn(..., device='cuda')` or `torch.cuda.current_device()` (`torch.cuda.is_available()` "
            "and `device_count()` are harmless). Fix: restart the kernel and create models and tensors on the "
            "GPU only inside the training function."
        )


def _spawning_backend() -> Any:
    """The backend when this machine's device starts its own processes (XLA), else None."""
    try:
        env = resolve_environment(os.environ)
    except Exception:  # an inconsistent environment is reported by the workers' Accelerator
        return None
    cls = backend_class(env.device_type)
    return cls(env) if cls.spawns_processes else None


# --------------------------------------------------------------------------------------------
# The launch
# --------------------------------------------------------------------------------------------


def _worker_env(mixed_precision: str, use_cpu: bool, accumulation: Optional[int], nproc: Optional[int]) -> Dict[str, str]:
    """What the processes of the one-process and TPU paths are told (the forked ones get their
    plan's :attr:`~anyaccel.launch.plan.LaunchPlan.worker_env`)."""
    env = envvars.worker_env(cpu=use_cpu, mixed_precision=mixed_precision,
                             gradient_accumulation_steps=int(accumulation) if accumulation else None)
    if nproc and nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"
    return env


def _run_in_worker(function: Callable[..., Any], args: tuple) -> Any:
    """Body of every forked worker: plain signal handling, death with the calling process, the
    user's function, then the end of the worker under the exit bound (:mod:`anyaccel.lifetime`:
    the process groups are ended once gloo's threads are idle; a forked child exits with
    ``os._exit``, so ``atexit`` handlers do not run)."""
    from ..process import lifetime
    from . import failures

    # the notebook's kernel killed (even before this line ran): the worker goes too
    lifetime.die_with_parent(signal.SIGKILL, parent=_KERNEL["pid"])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGHUP", "SIGQUIT"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    failed = True
    try:
        value = function(*args)
        note_exit(0)
        failed = False
        return value
    except KeyboardInterrupt as exc:
        note_exit(130, exc)
        raise SystemExit(130) from None
    except BaseException as exc:
        code = (exc.code or 0) if isinstance(exc, SystemExit) else 1
        note_exit(code if isinstance(code, int) else 1, exc)
        failed = code not in (0, None)
        if isinstance(exc, SystemExit) and (code in (None, 0) or code == PREEMPTED_EXIT_CODE):
            raise
        rank = _failures.worker_rank() or 0
        if not failures.record_failure(exc, rank):
            sys.stderr.write(f"[anyaccel] rank {rank} failed:\n{failures.user_traceback(exc)}")
        raise SystemExit(1) from None
    finally:
        rank = _failures.worker_rank()
        lifetime.end_of_script(f"rank {rank}" if rank is not None else "worker", failed=failed,
                               on_expire=lambda message: failures.record_failure(TimeoutError(message), rank))
        sys.stdout.flush()
        sys.stderr.flush()



def notebook_plan(nproc: int, mixed_precision: str, use_port: Union[int, str, None], master_addr: str,
                  node_rank: int, num_nodes: int, rdzv_backend: str, max_restarts: int, monitor_interval: float,
                  use_cpu: bool, accumulation: Optional[int], gpu_count: int = 0) -> LaunchPlan:
    """The :class:`~anyaccel.launch.plan.LaunchPlan` of a notebook launch: the same builder as
    ``anyaccel launch`` (:func:`~anyaccel.launch.plan.resolve_plan`), with the launcher's
    arguments as the options given (``nproc`` per machine, as Accelerate counts them) and the
    function as the target. Each value is checked by its option's row, naming the argument."""
    from .plan import LaunchRequest, resolve_plan

    if num_nodes < 1 or not 0 <= node_rank < num_nodes:
        raise ValueError(f"node_rank={node_rank} must be in 0..num_nodes-1 (num_nodes={num_nodes})")
    port = int(use_port) if use_port not in (None, "") else None
    if num_nodes > 1 and port is None:
        raise ValueError("several machines (num_nodes > 1) need use_port: the same port on every machine")
    given = dict(num_processes=nproc * num_nodes, num_machines=num_nodes, machine_rank=node_rank,
                 main_process_ip=master_addr, main_process_port=port, rdzv_backend=rdzv_backend,
                 max_restarts=max_restarts, monitor_interval=monitor_interval, mixed_precision=mixed_precision,
                 gradient_accumulation_steps=int(accumulation) if accumulation else None, cpu=use_cpu or None,
                 debug=bool(envvars.read(envvars.DEBUG)) or None)
    checked = {name: optionspec.check(optionspec.option(name), value, _ARGUMENT.get(name, name))
               for name, value in given.items() if value is not None}
    request = LaunchRequest.of("<notebook function>", quiet=True, **checked)
    try:
        # a notebook's processes are its own, whatever SLURM allocated around the kernel
        return resolve_plan(request, None, {**os.environ, envvars.DISABLE_SLURM.name: "1"}, gpu_count)
    except PlanError as exc:
        raise LauncherError(str(exc)) from None


#: the launcher's argument names of the options it sets (for messages)
_ARGUMENT = {"num_machines": "num_nodes", "machine_rank": "node_rank", "main_process_ip": "master_addr",
             "main_process_port": "use_port", "cpu": "use_cpu"}


def _shutdown_timeout() -> float:
    """Seconds the stopped workers get before SIGKILL: torch's agent's setting, as on the elastic path."""
    return float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 5))


def _make_registries() -> None:
    """Make, here in the kernel, the registries every worker's ``Accelerator()`` reads first (the
    strategies', the backends', the devices': made on first use, not at import, since the import
    budget): once before the fork, not again after it in each worker. Local."""
    from ..backends import _registry as backends_registry
    from ..environment.devices import known_devices
    from ..strategies import _registry as strategies_registry

    strategies_registry()
    backends_registry()
    known_devices()


#: the process that forks the workers (the notebook's kernel), read by each worker right after the fork
_KERNEL: Dict[str, Optional[int]] = {"pid": None}


def _launch_forked(
    function: Callable[..., Any], args: tuple, nproc: int, mixed_precision: str, use_port: Union[int, str, None],
    master_addr: str, node_rank: int, num_nodes: int, rdzv_backend: str, max_restarts: int,
    monitor_interval: float, use_cpu: bool, accumulation: Optional[int],
) -> Any:  # fmt: skip
    from ..process import lifetime
    from ..environment import devices
    from .elastic import ElasticJob, JobFailed, RendezvousFailed, run_elastic
    from .forked import run_forked

    # no full collection of the notebook's heap while it forks, nor in the children (lifetime's docstring)
    with lifetime.frozen_heap():
        _KERNEL["pid"] = os.getpid()  # the forked workers' parent
        _make_registries()
        plan = notebook_plan(nproc, mixed_precision, use_port, master_addr, node_rank, num_nodes, rdzv_backend,
                             max_restarts, monitor_interval, use_cpu, accumulation,
                             gpu_count=0 if use_cpu else devices.cuda_device_count())
        port = plan.main_process_port
        job = ElasticJob(
            nproc_per_node=plan.nproc_per_node, num_nodes=plan.num_machines, node_rank=plan.machine_rank,
            main_address=plan.main_process_ip, main_port=port, rdzv_backend=plan.rdzv_backend,
            max_restarts=plan.max_restarts, monitor_interval=plan.monitor_interval, start_method="fork",
            worker_env=plan.worker_env, debug=plan.debug,
        )  # fmt: skip
        kind = "CPU" if use_cpu or not devices.cuda_device_count() else "GPU"
        print(f"Launching on {nproc * num_nodes} {kind} process(es).", flush=True)
        try:
            if plan.num_machines == 1 and plan.max_restarts == 0:  # no torch elastic agent (anyaccel.launch.forked)
                values = run_forked(plan.nproc_per_node, dict(plan.worker_env), _run_in_worker, function, args, port,
                                    plan.monitor_interval, _shutdown_timeout(), job.preemption_grace)
            else:
                values = run_elastic(job, _run_in_worker, function, args, restore_signal_handlers=True)
        except OSError as exc:
            raise LauncherError(f"cannot listen on 127.0.0.1:{port} ({exc.strerror or exc}); pass another use_port, "
                                "or none for a free port") from None
        except RendezvousFailed as exc:
            raise LauncherError(f"could not form the group at {exc.endpoint} (machine {node_rank} of {num_nodes}): "
                                f"{exc}. Call the launcher on every machine with the same master_addr, use_port and "
                                f"num_nodes (and its own node_rank), and check that the port is reachable.") from None
        except JobFailed as failed:
            root = _failures.root_cause(failed.failures)
            original = root.exception() if root is not None else None
            raise WorkerFailedError(failed.report, root.rank if root else -1, root.traceback if root else None,
                                    original) from original
        return values.get(0)
