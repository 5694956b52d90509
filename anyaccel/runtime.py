"""What one ``Accelerator`` starts, owned by one object that releases it: :class:`Runtime`.

An ``Accelerator`` is a façade over a runtime: the resolved :class:`~anyaccel.environment.Environment`,
the device backend, the wrapping strategy, its subscription to the process's hang doctor (its own
``hang_timeout`` and preemption callbacks), its preemption signal handlers, and its trackers.
:meth:`Runtime.close` releases all of them, once:

* ``end_training()`` closes it collectively: finish the asynchronous checkpoint in flight and the
  trackers, put the previous signal handlers back, wait for every rank, let the strategy forget
  what it holds, then leave the doctor (which watched that last barrier). The process group is
  *not* destroyed: it is the process's, and the next ``Accelerator`` of the process uses it again
  (a cross-validation loop, a notebook cell run twice). Destroying it here was what hung finished
  jobs (issue 29): the group is ended once, when the process ends, after gloo's worker threads are
  idle (:mod:`anyaccel.process_group`);
* garbage collection closes it locally (``weakref.finalize`` on the ``Accelerator``, so no
  ``__del__`` and no reference cycle): signal handlers and the doctor subscription are released.
  Trackers are not finished there: a tracker service may keep a process-wide current run (wandb
  does), and finishing a collected accelerator's run at whatever moment the collector runs ended
  the run of a newer accelerator (seen in tests/tracking/test_tracking.py); they are dropped with the
  runtime, and their files close with them.

Nothing process-wide holds the ``Accelerator`` itself: the signal handler and the doctor hold the
:class:`~anyaccel.preemption.Preemption` object, which holds no reference to its owner.

What is process-wide stays so, on purpose: the default process group (torch has one), the
doctor's thread with its store client (one per process; owners subscribe to it), and the fork
hooks that keep its forks safe (:mod:`anyaccel.lifetime`).
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import TYPE_CHECKING, Any, Dict, Optional

from . import doctor, ops
from .process import lifetime, process_group
from .backends import create_backend
from .process.job import resolve_job_environment
from .options import AcceleratorOptions
from .process.preemption import Preemption
from .strategies import create_strategy

if TYPE_CHECKING:  # types only: these modules import torch or are made at first use
    import torch

    from .backends.base import Backend
    from .checkpoint.async_save import AsyncSaver
    from .environment import Environment
    from .fault_tolerance.replica import Replica
    from .strategies.base import Strategy
    from .tracking import TrackerSet

__all__ = ["Runtime", "start_runtime"]


class Runtime:
    """The things one ``Accelerator`` started (see the module docstring). Build with
    :func:`start_runtime`; release with :meth:`close`."""

    def __init__(self, env: Environment, backend: Backend, device: torch.device, mixed_precision: str,
                 strategy: Strategy,
                 preemption: Preemption, subscription: Optional[doctor.Subscription],
                 replica: Optional[Replica] = None):
        self.env = env
        self.backend = backend
        self.device = device
        self.mixed_precision = mixed_precision
        self.strategy = strategy
        self.preemption = preemption
        self.subscription = subscription
        self.trackers: Optional[TrackerSet] = None  # made when first needed
        self.async_saver: Optional[AsyncSaver] = None  # the AsyncSaver of save_state(async_save=True), made at first use
        self.replica = replica  # this process's part in fault-tolerant replica groups (fault_tolerance on), else None
        self.closed = False

    def __getstate__(self) -> Dict[str, Any]:
        """Pickling (Accelerate's tests pickle an Accelerator): a copy owns nothing of this
        process — no doctor subscription, no signal handlers (see ``Preemption.__getstate__``)."""
        state = dict(self.__dict__)
        state["subscription"] = None
        state["async_saver"] = None  # its thread and group belong to this process
        state["replica"] = None  # its torchft servers belong to this process
        return state

    def close(self, collective: bool = False) -> None:
        """Release everything this runtime registered (signal handlers, doctor subscription);
        idempotent. ``collective=True`` (``end_training``; every rank calls it) also finishes the
        asynchronous checkpoint in flight and the trackers, waits for every rank and lets the
        strategy forget what it holds; the process group stays (module docstring). Local
        otherwise."""
        if self.closed:
            return
        self.closed = True
        try:
            if collective and self.async_saver is not None:  # the checkpoint in flight is written first
                saver, self.async_saver = self.async_saver, None
                saver.close()
            if collective and self.trackers is not None:
                self.trackers.finish()
            if threading.current_thread() is threading.main_thread():  # Python restores handlers there only
                self.preemption.uninstall()
            if collective:
                process_group.keep_all()  # a user's destroy_process_group() after this never runs a destructor
                ops.barrier()
                self.strategy.teardown()
        finally:
            if self.replica is not None:  # (after the barrier) the group leaves the quorum
                self.replica.close()
            if self.subscription is not None:
                self.subscription.close()


def start_runtime(options: "AcceleratorOptions") -> Runtime:
    """Resolve the environment, set the device up, create the strategy, join the process group
    and subscribe to the hang doctor, from options already resolved (:mod:`anyaccel.options`).
    Collective (joining the process group): every rank calls it."""
    group = options.process_group
    env = resolve_job_environment(cpu=options.cpu, backend=group.backend)
    for message in env.warnings:
        if env.is_local_main_process:
            warnings.warn(message, stacklevel=4)
    backend = create_backend(env)
    device = backend.setup()
    mixed = backend.check_precision(options.mixed_precision, warn=env.is_local_main_process)
    strat = create_strategy(env, backend, options.strategy, options=options.strategy_options,
                            handlers=options.handlers_by_type(), mixed_precision=mixed,
                            dynamo=options.compile_options)
    replica = _replica(options, env, strat)  # before any device mesh: the mesh learns its replica group
    group_backend = strat.process_group_backend(env.backend)
    group_env = env if group_backend == env.backend else dataclasses.replace(env, backend=group_backend)
    process_group.ensure_process_group(group_env, timeout_s=group.timeout_s)
    strat.setup_process_group()
    process_group.keep_all()  # the strategy's sub-groups too: no deallocation while the script runs ends them
    if env.world_size > 1 or process_group.is_initialized():
        lifetime.register_fork_hooks()  # DataLoader workers forked from here: see anyaccel.lifetime
        lifetime.bound_at_exit(f"rank {env.rank}")  # after the group's own atexit handler, so it runs first
    hang_timeout = options.hang_timeout
    preemption = Preemption(options.preemption_signals, env.rank, env.world_size,
                            agree_timeout=max(120.0, hang_timeout))
    if env.world_size > 1:
        preemption.coordinated = True  # through the doctor's store; on_lost turns it off again
    doctor_env = _agreed_restart_attempt(env, device, group_backend)
    if replica is not None:  # names the key of its torchft store's port (.fault_tolerance.store)
        replica.attempt = doctor_env.launch.restart_attempt
    subscription = doctor.subscribe(doctor_env, hang_timeout, poll=preemption.poll, on_lost=preemption.store_lost)
    if subscription is None:
        preemption.coordinated = env.world_size <= 1
    return Runtime(env, backend, device, mixed, strat, preemption, subscription, replica=replica)


def _agreed_restart_attempt(env: Environment, device: Any, group_backend: Optional[str]) -> Environment:
    """``env`` with the restart attempt every rank agrees on, for the keys the ranks share in a
    store that may outlive an attempt: the doctor's (named by run and attempt, so that an earlier
    attempt's keys in a reused store are never read as this one's) and, with fault tolerance, the
    one its replica group's rank 0 publishes its torchft store's port under
    (:mod:`anyaccel.fault_tolerance.store`). torch's elastic agents count restarts each on its own machine: a machine whose agent
    was started again (a host that died and came back) counts from 0 while the survivors count on,
    so the ranks would write their answers under different names and look silent to each other
    (the doctor then ends the job with exit 69). The highest count among the ranks is taken: the
    survivors' agents count every round. Collective (one all-reduce of one integer, on the group
    just formed) only where several machines' agents may restart; else local, and ``env`` as is."""
    launch = env.launch
    if env.world_size <= 1 or env.num_nodes <= 1 or launch.max_restarts <= 0 or not process_group.is_initialized():
        return env
    import torch
    import torch.distributed as dist

    on = "cpu" if group_backend == "gloo" else device
    count = torch.tensor([launch.restart_attempt], dtype=torch.int64, device=on)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    agreed = int(count.item())
    if agreed == launch.restart_attempt:
        return env
    return dataclasses.replace(env, launch=dataclasses.replace(launch, restart_attempt=agreed))


def _replica(options: AcceleratorOptions, env: Environment, strategy: Strategy) -> Optional[Replica]:
    """This process's part in fault-tolerant replica groups (``fault_tolerance`` on; torchft is
    imported later, when the group first joins), or None. The strategy's mesh is told its
    replica group (:meth:`~anyaccel.strategies.mesh.ProcessMesh.manage_replicas`): the strategy
    splits the model within the group (one process, DDP, FSDP2, tensor parallelism), torchft
    across groups. Raises
    :class:`~anyaccel.errors.FaultToleranceError` for a strategy that trains through an engine
    (DeepSpeed) or cuts the model into pipeline stages. Local."""
    if options.fault_tolerance == "off":
        return None
    from . import envvars
    from .errors import FaultToleranceError
    from .fault_tolerance.replica import Replica
    from .fault_tolerance.settings import resolve_settings
    from .strategies.capabilities import EngineTraining

    settings = resolve_settings(options.fault_tolerance, options.fault_tolerance_min_replicas)
    if settings is None:
        return None
    staged = strategy.process_mesh.size("pp") > 1
    if isinstance(strategy, EngineTraining) or staged:
        what = "pipeline stages (pp_size > 1)" if staged else f"the {strategy.name} strategy (its engine runs backward)"
        raise FaultToleranceError(
            f"fault_tolerance does not work with {what} yet: inside a replica group it averages and heals what one "
            "process, DDP, FSDP2, tensor, sequence or expert parallelism hold. Use those inside each group, or set "
            "fault_tolerance off")
    strategy.process_mesh.manage_replicas(settings.group, settings.groups)
    store = (env.main_address, env.main_port) if env.main_port is not None else None
    restarted = env.launch.restart_attempt > 0 or int(envvars.read(envvars.REPLICA_GROUP_RESTART) or 0) > 0
    return Replica(settings, env.rank, env.world_size, store, debug=bool(envvars.read(envvars.DEBUG)),
                   restarted=restarted, attempt=env.launch.restart_attempt,
                   find_unused_parameters=_find_unused_parameters(options))


def _find_unused_parameters(options: AcceleratorOptions) -> bool:
    """DDP's ``find_unused_parameters`` as the job gives it (``DistributedDataParallelKwargs``, or
    ``DDPOptions`` as the strategy's options), whatever splits the model inside a replica group:
    the average over the groups follows it (:mod:`anyaccel.fault_tolerance.averaging`). Local."""
    from .strategies.options import DDPOptions

    if isinstance(options.strategy_options, DDPOptions):
        return options.strategy_options.find_unused_parameters
    for handler in options.handlers:
        convert = getattr(handler, "to_options", None)
        given = convert() if callable(convert) else handler
        if isinstance(given, DDPOptions):
            return given.find_unused_parameters
    return False
