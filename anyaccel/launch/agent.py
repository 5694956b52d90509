"""The one place anyaccel relies on torch elastic's agent internals: a ``LocalElasticAgent``
subclass and the few lines of ``torch.distributed.launcher.api.launch_agent`` that start it.

anyaccel needs three things torch's agent does not offer as options, for checkpoint-on-preemption.
torch's agent turns SIGTERM into a shutdown that gives the workers a few seconds before SIGKILL,
and it does not catch SIGUSR1 unless told (its default action would kill the launcher). Here: a
preemption signal (SIGTERM, SIGUSR1) repeated while the first one is handled is ignored (SLURM
may signal the launcher and the workers); after a preemption signal the workers get the grace
period instead of the usual shutdown timeout, so no worker is killed in the middle of its
checkpoint, and every worker's exit status is recorded for the report; a worker that exits with 75
on its own (it got the signal, or another machine's rank did) is not restarted, whatever
``max_restarts`` says. Before, these were monkeypatches of torch's classes for the
duration of a run; now :class:`PreemptingAgent` overrides the members below in a subclass that
only anyaccel constructs, and nothing of torch is modified.

What this module relies on, each checked by ``tests/launch/test_elastic.py`` against the
installed torch (:data:`CONTRACT` lists them; the test names the member that changed):

* ``LocalElasticAgent._start_workers(worker_group)``: starts the workers (and installs torch's
  signal handlers); overridden to install ours before and after (so SIGUSR1 never has its default,
  fatal action while the workers run, without torch's ``TORCHELASTIC_SIGNALS_TO_HANDLE``).
* ``LocalElasticAgent._shutdown(death_sig[, timeout])``: stops the workers; overridden for the
  grace (torch 2.9 has no ``timeout`` and closes with a fixed 30 s: after a preemption signal the
  process context is closed with the grace first, through ``PContext.close(death_sig, timeout)``).
* ``LocalElasticAgent._monitor_workers(worker_group) -> RunResult`` with ``.failures[rank].exitcode``
  and the attribute ``_remaining_restarts``: overridden to stop restarts after a checkpoint, and to
  say, in one line, which worker failed and that the workers are restarted (torch only logs it).
* ``LocalElasticAgent._pcontext``: the process context, read for the workers' exit statuses
  (``subprocess_handlers[rank].proc.returncode`` or ``_pc.processes[i].exitcode``).
* ``SignalException(msg, sigval)`` and ``ChildFailedError(name, failures)``: public.

Beyond torch's agent, the launcher ends **every** process of the job each time its agent has
stopped the workers (they finished, one failed, before a restart, on a signal): with a launch id
(``sweep``), the processes that carry it are SIGKILLed (:mod:`anyaccel.launch.reaper`).

Called by the launching process only (Local).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import signal
from typing import Any, Callable, Dict, Optional, Tuple, Union

__all__ = ["Preemption", "AgentConfig", "launch_agent", "agent_class", "CONTRACT"]

PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")  # the launcher forwards these and waits for the workers' checkpoint
HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")

# (member of LocalElasticAgent, parameters it must accept): what the subclass overrides or reads
CONTRACT: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("_start_workers", ("worker_group",)),
    ("_shutdown", ("death_sig",)),  # and ``timeout`` since torch 2.10 (used when present)
    ("_monitor_workers", ("worker_group",)),
)


class Preemption:
    """The launcher's side of checkpoint-on-preemption for one run: ``grace`` seconds for the
    workers after SIGTERM/SIGUSR1; ``signal`` (the first preemption signal received) and
    ``exit_codes`` (local rank → status after that shutdown) are filled in by the agent."""

    def __init__(self, grace: float):
        self.grace = grace
        self.signal: Optional[int] = None
        self.exit_codes: Dict[int, Optional[int]] = {}

    def handler(self, signum: int, frame: Any) -> None:
        """Signal handler of the agent: a repeat of a preemption signal while the first is being
        handled is ignored (SLURM may signal the launcher and the workers); any other signal
        raises torch's ``SignalException``, which makes the agent stop the workers."""
        from torch.distributed.elastic.multiprocessing import SignalException

        if signal.Signals(signum).name in PREEMPTION_SIGNALS:
            if self.signal is not None:
                return
            self.signal = signum
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    def install(self) -> None:
        """Install :meth:`handler` for every signal the agent handles (main thread only)."""
        for name in HANDLED_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                try:
                    signal.signal(sig, self.handler)
                except (ValueError, OSError):  # not the main thread
                    return


@functools.lru_cache(maxsize=None)
def agent_class() -> type:
    """``PreemptingAgent``, the ``LocalElasticAgent`` subclass (made on first use: importing torch
    elastic costs time that ``anyaccel --help`` should not pay)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from ..process.preemption import PREEMPTED_EXIT_CODE

    _SHUTDOWN_TAKES_TIMEOUT = _shutdown_takes_timeout()

    class PreemptingAgent(LocalElasticAgent):  # type: ignore[misc]
        """torch's agent with anyaccel's preemption rules (module docstring)."""

        def __init__(self, *args: Any, preemption: Preemption, shutdown_timeout: int = 30,
                     sweep: Optional[str] = None, label: str = "", **kwargs: Any):
            if _SHUTDOWN_TAKES_TIMEOUT:
                kwargs["shutdown_timeout"] = shutdown_timeout
            super().__init__(*args, **kwargs)  # (torch 2.9 has no shutdown_timeout: its 30 s apply)
            self.preemption = preemption
            self.sweep = sweep  # the launch id whose processes end at each shutdown (anyaccel.launch.reaper)
            self.label = label

        def _start_workers(self, worker_group: Any) -> Any:
            self.preemption.install()  # before: torch's process context leaves SIGUSR1 alone
            pids = super()._start_workers(worker_group)
            self.preemption.install()  # after: it installed its own for SIGTERM, SIGINT, SIGHUP, SIGQUIT
            return pids

        def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: Optional[int] = None) -> None:
            this = self.preemption
            preempted = this.signal is not None and int(death_sig) == this.signal
            context = getattr(self, "_pcontext", None)
            if preempted:
                timeout = int(max(this.grace, timeout or 0))
            if _SHUTDOWN_TAKES_TIMEOUT:  # torch >= 2.10; no timeout given: torch's default, as before
                super()._shutdown(death_sig, **({} if timeout is None else {"timeout": timeout}))
            else:  # torch 2.9: _shutdown(death_sig) closes with a fixed 30 s; close with the grace first
                if preempted and context is not None:
                    context.close(death_sig, timeout)
                super()._shutdown(death_sig)
            if preempted and context is not None:
                this.exit_codes = exit_codes(context)
            if self.sweep:
                from .reaper import end_processes

                end_processes(self.sweep)

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            failed = getattr(result, "failures", None) or {}
            if any(f.exitcode == PREEMPTED_EXIT_CODE for f in failed.values()):
                self._remaining_restarts = 0  # the workers checkpointed for a preemption: no restart
            elif failed and self._remaining_restarts > 0:
                say_restart(self.label, failed, worker_group.spec.max_restarts - self._remaining_restarts + 1,
                            worker_group.spec.max_restarts)
            return result

    return PreemptingAgent


def say_restart(label: str, failed: Dict[int, Any], attempt: int, max_restarts: int) -> None:
    """One line on stderr: which worker failed and that the workers start again (restart
    ``attempt`` of ``max_restarts``). Local to the launcher."""
    import sys

    def how(code: Optional[int]) -> str:
        if code is not None and code < 0 and -code in signal.valid_signals():
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with {code}"

    if len(failed) == 1:
        (rank, failure), = failed.items()
        what = f"worker rank {rank} {how(failure.exitcode)}"
    else:  # which one failed first is the worker's report's to say ([anyaccel] rank r failed ...)
        what = "workers " + ", ".join(f"rank {r} {how(f.exitcode)}" for r, f in sorted(failed.items()))
    print(f"anyaccel launch: {label}{what}; starting the workers again (restart {attempt} of {max_restarts})",
          file=sys.stderr, flush=True)


def _shutdown_takes_timeout() -> bool:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    return "timeout" in inspect.signature(LocalElasticAgent._shutdown).parameters


def exit_codes(context: Any) -> Dict[int, Optional[int]]:
    """Exit status of every worker of a closed torch process context (subprocess or multiprocessing)."""
    handlers = getattr(context, "subprocess_handlers", None)
    if handlers:
        return {int(rank): h.proc.returncode for rank, h in handlers.items()}
    pc = getattr(context, "_pc", None)
    return {i: p.exitcode for i, p in enumerate(getattr(pc, "processes", []) or [])}


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """What :func:`launch_agent` needs (the fields of torch's ``LaunchConfig`` anyaccel sets)."""

    nproc_per_node: int
    num_nodes: int
    run_id: str
    rdzv_backend: str
    rdzv_endpoint: str
    rdzv_configs: Dict[str, Any]
    max_restarts: int
    monitor_interval: float
    start_method: str
    shutdown_timeout: int
    master: Tuple[Optional[str], Optional[int]] = (None, None)  # the static rendezvous's address and port
    local_addr: Optional[str] = None
    role: str = "anyaccel"
    sweep: Optional[str] = None  # a launch id: its processes are ended at each shutdown (anyaccel.launch.reaper)
    label: str = ""  # put before the launcher's lines about restarts ("replica group 1: ")


def _accepted(callable_: Callable[..., Any], **kwargs: Any) -> Dict[str, Any]:
    """The keyword arguments ``callable_`` accepts in this torch (``shutdown_timeout`` is recent)."""
    names = inspect.signature(callable_).parameters
    return {k: v for k, v in kwargs.items() if k in names}


def launch_agent(config: AgentConfig, entrypoint: Union[str, Callable[..., Any]], args: Tuple[Any, ...],
                 preemption: Preemption) -> Dict[int, Any]:
    """Run the workers of this machine on :func:`agent_class` and return ``{local rank: value}``
    (what torch's ``launch_agent`` does, minus its metrics, events and health-check server).

    Raises torch's ``ChildFailedError`` when the workers failed, ``SignalException`` when the
    launcher got a signal (the rendezvous is then left open, as torch does), rendezvous errors as
    torch raises them. Local."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    parameters = RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
        min_nodes=config.num_nodes, max_nodes=config.num_nodes, local_addr=config.local_addr,
        **config.rdzv_configs,
    )  # fmt: skip
    spec = WorkerSpec(
        role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint, args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(parameters), max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval, master_addr=config.master[0], master_port=config.master[1],
        **_accepted(WorkerSpec, local_addr=config.local_addr),
    )  # fmt: skip
    cls = agent_class()
    agent = cls(spec=spec, logs_specs=DefaultLogsSpecs(), start_method=config.start_method, preemption=preemption,
                shutdown_timeout=config.shutdown_timeout, sweep=config.sweep, label=config.label)
    shutdown_rendezvous = True
    try:
        result = agent.run()
        if result.is_failed():
            name = entrypoint if isinstance(entrypoint, str) else getattr(entrypoint, "__qualname__", "worker")
            raise ChildFailedError(name=os.path.basename(str(name)), failures=result.failures)
        return result.return_values
    except SignalException:
        shutdown_rendezvous = False  # as torch: closing it would end the run id for good
        raise
    finally:
        if shutdown_rendezvous:
            spec.rdzv_handler.shutdown()
