"""Carry out a :class:`~anyaccel.launch.plan.LaunchPlan` on torch's own elastic agent.

The launcher process (one per machine) calls :func:`run_plan`; it returns the exit status.

* ``agent`` mode: torch's elastic agent (:mod:`anyaccel.launch.elastic`) starts ``nproc_per_node``
  workers, each ``python -u -m anyaccel.launch.bootstrap TARGET ARGS...``. When a worker fails, the agent stops the others (SIGTERM, then SIGKILL after a few seconds) and
  this function prints the root cause once; SIGINT/SIGTERM on the launcher stop every worker.
* ``in_process`` mode (an ``srun`` task that is itself one worker): the script runs here.
* ``xla`` mode: torch-xla's spawn starts the TPU processes (through :mod:`anyaccel.backends.xla`).
"""

from __future__ import annotations

import os
import sys
from typing import Any, List, Tuple

from ..errors import CLIError
from .plan import LaunchPlan

__all__ = ["run_plan", "worker_args"]

_PREFIX = "anyaccel launch"


def _say(plan: LaunchPlan, message: str) -> None:
    if not plan.quiet:
        print(f"{_PREFIX}: {message}", file=sys.stderr, flush=True)


def worker_args(plan: LaunchPlan) -> List[str]:
    """The arguments after ``python`` for every worker."""
    return ["-u", "-m", "anyaccel.launch.bootstrap", *(["-m"] if plan.is_module else []), plan.target, *plan.script_args]


def run_plan(plan: LaunchPlan) -> int:
    """Run the job described by ``plan`` from this machine's launcher; returns the exit status."""
    for note in plan.notes:
        _say(plan, f"note: {note}")
    if plan.mode == "agent":
        return _run_agent(plan)
    os.environ.update(plan.env_dict())  # this process is (or spawns) the worker
    if plan.mode == "in_process":
        return _run_in_process(plan)
    return _run_xla(plan)


def _preempted(signal_name: str, exit_codes: Any) -> int:
    """The launcher's exit after a preemption signal when every worker saved (75) or had finished (0)."""
    from ..process.preemption import PREEMPTED_EXIT_CODE

    if PREEMPTED_EXIT_CODE not in exit_codes.values():
        print(f"{_PREFIX}: {signal_name} arrived after the training loop; every worker finished normally",
              file=sys.stderr, flush=True)
        return 0
    print(f"{_PREFIX}: {signal_name}: every worker saved a checkpoint and stopped (exit {PREEMPTED_EXIT_CODE}); "
          "run the same command again to resume from it", file=sys.stderr, flush=True)
    return PREEMPTED_EXIT_CODE


def _run_in_process(plan: LaunchPlan) -> int:
    from . import bootstrap

    return bootstrap.main((["-m"] if plan.is_module else []) + [plan.target, *plan.script_args])


def _run_xla(plan: LaunchPlan) -> int:  # pragma: no cover - needs a TPU
    from ..backends import xla

    _say(plan, f"starting {plan.nproc_per_node or 'one per XLA device'} process(es) with torch-xla")
    try:
        xla.spawn(_xla_worker, (plan.target, plan.script_args, plan.is_module), plan.nproc_per_node or None)
    except ValueError as exc:  # e.g. a process count torch-xla cannot do
        raise CLIError(str(exc)) from None
    return 0


def _xla_worker(target: str, args: Tuple[str, ...], is_module: bool) -> None:  # pragma: no cover - TPU
    from . import bootstrap

    bootstrap.run_target(target, args, is_module)


def _run_agent(plan: LaunchPlan) -> int:
    from .elastic import ElasticJob, JobFailed, JobPreempted, RendezvousFailed, run_elastic

    job = ElasticJob(
        nproc_per_node=plan.nproc_per_node, num_nodes=plan.num_machines, node_rank=plan.machine_rank,
        main_address=plan.main_process_ip, main_port=plan.main_process_port, rdzv_backend=plan.rdzv_backend,
        run_id=plan.run_id, max_restarts=plan.max_restarts, monitor_interval=plan.monitor_interval,
        start_method="spawn", worker_env=plan.worker_env, debug=plan.debug, preemption_grace=plan.preemption_grace,
        sweep=True,  # this process is the launcher alone: every process left below it is ended
    )  # fmt: skip
    if plan.debug or not plan.single_machine:
        _say(plan, plan.summary())
        if not plan.single_machine:
            _say(plan, f"waiting for all {plan.num_machines} machines to join at {plan.main_process_ip}:"
                       f"{plan.main_process_port}")
    try:
        run_elastic(job, sys.executable, *worker_args(plan))
        return 0
    except JobFailed as failed:
        from ..process.preemption import PREEMPTED_EXIT_CODE

        if failed.failures and all(f.exitcode == PREEMPTED_EXIT_CODE for f in failed.failures):  # signalled directly
            return _preempted("a preemption signal", {f.local_rank: f.exitcode for f in failed.failures})
        print(f"{_PREFIX}: error: {failed.report}", file=sys.stderr, flush=True)
        return 1
    except JobPreempted as stop:
        return _preempted(stop.signal_name, stop.exit_codes)
    except OSError as exc:
        if plan.num_machines == 1:  # the one-machine port asked for is taken
            raise CLIError(
                f"cannot listen on 127.0.0.1:{plan.main_process_port} ({exc.strerror or exc}); another job "
                "probably uses that port. Leave out --main_process_port (and main_process_port in the config "
                "file) to get a free port."
            ) from None
        raise CLIError(  # e.g. this machine's own host name does not resolve (torch looks it up)
            f"the rendezvous at {plan.main_process_ip}:{plan.main_process_port} could not start on this machine "
            f"({type(exc).__name__}: {exc}). Check that this machine's host name resolves (`getent hosts "
            "$(hostname)`) and that the main address and port are right."
        ) from None
    except RendezvousFailed as exc:  # the group could not be formed
        text = str(exc)
        if "EADDRINUSE" in text or "address already in use" in text:
            hint = f"port {plan.main_process_port} is already used on this machine: pick another --main_process_port"
        else:
            hint = (f"check that every machine runs the same command with --num_machines {plan.num_machines}, "
                    f"--main_process_ip {plan.main_process_ip} and --main_process_port {plan.main_process_port} "
                    "(its own --machine_rank), that machine 0 is up and that the port is reachable")
        raise CLIError(f"could not form the group at {exc.endpoint} (machine {plan.machine_rank} of "
                       f"{plan.num_machines}): {type(exc.cause).__name__}: {text[:400]}. {hint[0].upper()}{hint[1:]}.",
                       exit_code=1) from None
    except KeyboardInterrupt as exc:
        sig = getattr(exc, "signal", None)
        if sig is None:
            raise
        print(f"{_PREFIX}: {exc}", file=sys.stderr, flush=True)
        return 128 + sig
