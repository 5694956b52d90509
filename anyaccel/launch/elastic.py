"""One way to run workers on torch's elastic agent, shared by ``anyaccel launch`` and
``notebook_launcher``.

:func:`run_elastic` takes an :class:`ElasticJob` (the machine's share of the job: processes,
rendezvous, restarts, how workers start) and an entry point (a command line or a function), sets
up the rendezvous, runs the workers on torch's agent with every setting explicit (torch's
``LaunchConfig`` defaults differ from torchrun's CLI) through :mod:`anyaccel.launch.agent` (the one
module that knows torch's agent internals) and returns the workers' return values. A worker failure is raised as
:class:`JobFailed` carrying the failures read back from every rank (root cause first); the
callers turn it into their own message. Called by the launching process, once per machine.

On one machine the rendezvous is a TCP store bound to 127.0.0.1 on a free port (or the port asked
for), served by a small handler registered with torch's rendezvous registry that makes a fresh
store for every restart: two jobs never collide, nothing listens on the network, and a restarted
gloo group never reads the previous attempt's addresses (torch's static rendezvous reuses one store
and gloo then failed with "connectFullMesh ... Connection refused"). On several machines, torch's
static (or c10d) rendezvous at ``main_address:main_port``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import signal
import socket
import tempfile
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

from .. import envvars
from ..environment import network
from . import failures
from .agent import PREEMPTION_SIGNALS  # PREEMPTION_SIGNALS re-exported: the launcher's signals

__all__ = ["ElasticJob", "JobFailed", "JobPreempted", "RendezvousFailed", "run_elastic", "loopback_store",
           "quiet_torch_logs", "PREEMPTION_SIGNALS"]

@dataclasses.dataclass(frozen=True)
class ElasticJob:
    """This machine's share of a job. ``main_port=None`` on one machine: a free loopback port."""

    nproc_per_node: int
    num_nodes: int = 1
    node_rank: int = 0
    main_address: str = "127.0.0.1"
    main_port: Optional[int] = None
    rdzv_backend: str = "static"
    run_id: str = "anyaccel"
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "spawn"  # "fork" for notebook functions (they cannot be pickled)
    worker_env: Tuple[Tuple[str, str], ...] = ()
    debug: bool = False
    preemption_grace: float = 120.0  # seconds the workers get to checkpoint after SIGTERM/SIGUSR1
    sweep: bool = False  # this process is the launcher alone: every process of the launch ends with it (reaper)

    @property
    def single_machine(self) -> bool:
        return self.num_nodes == 1


class JobFailed(Exception):
    """A worker failed; ``failures`` lists what every failed rank reported (see
    :mod:`anyaccel.launch.failures`), ``report`` is the one message for the user."""

    def __init__(self, found: List[Any], report: str):
        super().__init__(report)
        self.failures = found
        self.report = report


class JobPreempted(Exception):
    """The launcher received a preemption signal and every worker, given the grace period, saved a
    checkpoint and exited 75 (or had already finished, 0). ``exit_codes``: local rank → status."""

    def __init__(self, signal_name: str, exit_codes: Dict[int, Optional[int]]):
        super().__init__(f"{signal_name}: workers' exit codes {exit_codes}")
        self.signal_name = signal_name
        self.exit_codes = dict(exit_codes)


class RendezvousFailed(Exception):
    """The group could not be formed; the message names the endpoint."""

    def __init__(self, message: str, endpoint: str, cause: BaseException):
        super().__init__(message)
        self.endpoint = endpoint
        self.cause = cause


# --------------------------------------------------------------------------------------------
# The one-machine rendezvous
# --------------------------------------------------------------------------------------------


def loopback_store(port: Optional[int]) -> Tuple[Any, int]:
    """Bind 127.0.0.1:``port`` (0 or None = any free port) and serve a torch ``TCPStore`` on it.

    Returns ``(store, port)``; the server lives as long as the store object. Nothing listens on
    other interfaces (torch's own stores listen on all of them). Raises ``OSError`` when the port
    is taken."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port or 0))
        sock.listen(512)
        port = sock.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now
    return store, port


LOOPBACK_BACKEND = "anyaccel-loopback"


def _loopback_handler(params: Any) -> Any:
    """Factory registered with torch's rendezvous registry (see ``_LoopbackRendezvous``)."""
    return _loopback_class()(params.run_id, params.config.get("first_store"))


@functools.lru_cache(maxsize=None)
def _loopback_class() -> type:
    from torch.distributed import PrefixStore
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo

    class _LoopbackRendezvous(RendezvousHandler):
        """The rendezvous of a one-machine job: a fresh TCP store on 127.0.0.1 per round."""

        def __init__(self, run_id: str, first_store: Optional[Tuple[Any, int]]):
            self._run_id = run_id
            self._next = first_store
            self._store: Any = None
            self._closed = False

        def get_backend(self) -> str:
            return LOOPBACK_BACKEND

        @property
        def use_agent_store(self) -> bool:
            return True

        def next_rendezvous(self) -> Any:
            self._store = None  # the previous round's server goes away with its workers
            store, port = self._next if self._next is not None else loopback_store(None)
            self._next = None
            self._store = store
            return RendezvousInfo(PrefixStore(self._run_id, store), 0, 1, RendezvousStoreInfo("127.0.0.1", port))

        def is_closed(self) -> bool:
            return self._closed

        def set_closed(self) -> None:
            self._closed = True

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return self._run_id

        def shutdown(self) -> bool:
            self._store = self._next = None
            return True

    return _LoopbackRendezvous


def _rendezvous(job: ElasticJob) -> Tuple[str, str, str, Dict[str, Any]]:
    """``(backend, endpoint, run_id, rdzv_configs)`` of the rendezvous. On one machine
    the first store is bound now, so a busy port fails here with ``OSError``."""
    timeout = envvars.read(envvars.RDZV_TIMEOUT)
    if job.single_machine:
        from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

        first = loopback_store(job.main_port)
        try:
            rendezvous_handler_registry.register(LOOPBACK_BACKEND, _loopback_handler)
        except ValueError:  # already registered (a second launch in this process)
            pass
        configs: Dict[str, Any] = {"first_store": first, "timeout": timeout}
        return LOOPBACK_BACKEND, f"127.0.0.1:{first[1]}", f"anyaccel-{uuid.uuid4().hex[:12]}", configs
    endpoint = network.host_port(job.main_address, job.main_port)  # "[::1]" as given on the command line, or "::1"
    configs = {"timeout": timeout}
    if job.rdzv_backend == "static":
        configs["rank"] = job.node_rank
    elif job.rdzv_backend == "c10d":
        # machine 0 hosts the store (torch would guess from host names, and a name that resolves to
        # 127.0.0.1 makes no machine host it); a machine started long before machine 0 keeps
        # waiting for the rendezvous timeout, not torch's 60 s read timeout
        configs["is_host"] = job.node_rank == 0
        configs["read_timeout"] = int(timeout)
    return job.rdzv_backend, endpoint, job.run_id, configs


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------

_TORCH_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


def quiet_torch_logs(debug: bool) -> None:
    """The agent logs every failure and every SIGTERM it sends; anyaccel reports failures itself,
    once, so those logs are shown only with ``--debug``."""
    level = logging.INFO if debug else logging.CRITICAL
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(_TORCH_LOGGERS):
            logging.getLogger(name).setLevel(level)


@contextlib.contextmanager
def _signal_handlers_restored() -> Iterator[None]:
    """torch's agent installs handlers for SIGTERM/SIGINT/...; put the caller's back afterwards
    (otherwise a later interrupt of a notebook raises torch's SignalException)."""
    saved = {}
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1"):
        sig = getattr(signal, name, None)
        if sig is not None:
            with contextlib.suppress(ValueError, OSError):
                saved[sig] = signal.getsignal(sig)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            with contextlib.suppress(ValueError, OSError, TypeError):  # not the main thread
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _job_error(exc: BaseException, job: ElasticJob, side: str, endpoint: Any, preemption: Any) -> BaseException:
    """What :func:`run_elastic` raises for an exception of torch's agent: :class:`JobFailed` for a
    failed worker (its report read from ``side``), :class:`RendezvousFailed`, :class:`JobPreempted`
    when every worker saved (or had finished) after a preemption signal, else ``KeyboardInterrupt``
    with ``.signal``. Local."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(exc, ChildFailedError):
        found = failures.failures_from(exc, side)
        return JobFailed(found, failures.report(found, job.nproc_per_node * job.num_nodes, job.node_rank))
    if not isinstance(exc, SignalException):  # the rendezvous's errors
        return RendezvousFailed(" ".join(str(exc).split()).rstrip("."), endpoint, exc)
    from ..process.preemption import PREEMPTED_EXIT_CODE

    codes = preemption.exit_codes if preemption.signal == int(exc.sigval) else {}
    if codes and all(c in (0, PREEMPTED_EXIT_CODE) for c in codes.values()):  # saved, or already done
        return JobPreempted(signal.Signals(exc.sigval).name, codes)
    late = " (after the grace period, killed with SIGKILL)" if -signal.SIGKILL in codes.values() else ""
    interrupt = KeyboardInterrupt(f"stopped by {signal.Signals(exc.sigval).name}; every worker was stopped{late}")
    interrupt.signal = int(exc.sigval)  # type: ignore[attr-defined]
    return interrupt


def _local_addr(job: ElasticJob) -> Optional[str]:
    """With the c10d rendezvous the workers' ``MASTER_ADDR`` is the address the machine-0 agent
    gives for itself: by default its fully qualified host name, which other machines may not
    resolve (or which resolves to loopback). Give :func:`anyaccel.network.address_for_peers`."""
    if job.single_machine or job.rdzv_backend != "c10d":
        return None
    return network.address_for_peers(job.main_address) or None


def _static_master(job: ElasticJob, backend: str) -> Tuple[Optional[str], Optional[int]]:
    """The workers' ``MASTER_ADDR``/``MASTER_PORT`` with torch's static rendezvous (its store's
    endpoint); other rendezvous give them through the store."""
    if backend != "static":
        return None, None
    if job.main_port is None:
        raise ValueError(f"the static rendezvous at {job.main_address} needs a port: give --main_process_port")
    return job.main_address.strip().strip("[]"), job.main_port


def _rendezvous_env(job: ElasticJob, backend: str) -> Dict[str, str]:
    """Variables torch's agent reads while this job runs. With the c10d rendezvous between machines,
    torch shares one TCP store server made by the rank-0 agent in its first round and publishes its
    address in that round only: an agent that joins a later round (a machine restarted after it
    died) waits for that address for good, and the surviving agent for the newcomer's role
    (``DynamicRendezvousHandler.next_rendezvous``, torch 2.9-2.13). Torch's documented opt-out makes
    the rank-0 agent publish a fresh address in every round (the workers' rank 0 hosts the store).
    Only when a later round can happen (``max_restarts`` > 0), and never over a value the user set:
    without restarts the store stays in the agent, which outlives a stopped or crashed worker."""
    if job.single_machine or backend != "c10d" or job.max_restarts < 1 or _SHARE_STORE in os.environ:
        return {}
    return {_SHARE_STORE: "1"}


_SHARE_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # torch's own variable (torch/distributed/elastic/agent)


def run_elastic(job: ElasticJob, entrypoint: Union[str, Callable[..., Any]], *args: Any,
                restore_signal_handlers: bool = False) -> Dict[int, Any]:
    """Run ``entrypoint`` (a program such as ``sys.executable`` with ``args`` as its command line,
    or a function called with ``args``) in ``job.nproc_per_node`` workers of this machine;
    return ``{local rank: return value}`` (functions only).

    Workers see ``job.worker_env``, ``ANYACCEL_AGENT_PID`` (they exit if this process dies),
    ``ANYACCEL_FAILURE_DIR`` (where a failing rank leaves its report) and, with ``job.sweep``,
    ``ANYACCEL_LAUNCH_ID`` (every process that carries it ends with the launch: :mod:`.reaper`). Raises :class:`JobFailed`
    when a worker fails (the others are stopped), :class:`RendezvousFailed` when the group cannot
    be formed, ``OSError`` when the requested one-machine port is taken, :class:`JobPreempted`
    after SIGTERM/SIGUSR1 (the workers had ``job.preemption_grace`` seconds to checkpoint; no
    restart), ``KeyboardInterrupt`` (with ``.signal``) for other signals (every worker is stopped)."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    from .agent import AgentConfig, Preemption, launch_agent

    quiet_torch_logs(job.debug)
    backend, endpoint, run_id, rdzv_configs = _rendezvous(job)
    config = AgentConfig(
        nproc_per_node=job.nproc_per_node, num_nodes=job.num_nodes, run_id=run_id, rdzv_backend=backend,
        rdzv_endpoint=endpoint, rdzv_configs=rdzv_configs, max_restarts=job.max_restarts,
        monitor_interval=job.monitor_interval, start_method=job.start_method,
        shutdown_timeout=int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 5)),
        master=_static_master(job, backend), local_addr=_local_addr(job),
    )  # fmt: skip
    side = tempfile.mkdtemp(prefix="anyaccel-failures-")
    env = {**dict(job.worker_env), envvars.AGENT_PID.name: str(os.getpid()), envvars.FAILURE_DIR.name: side,
           **_rendezvous_env(job, backend)}
    guardian = None
    if job.sweep:  # every process of the launch ends with it, even when the launcher is SIGKILLed
        from . import reaper

        launch_id = reaper.new_launch_id()
        env[envvars.LAUNCH_ID.name] = launch_id
        config = dataclasses.replace(config, sweep=launch_id)
        guardian = reaper.start_guardian(launch_id)
    handlers = _signal_handlers_restored() if restore_signal_handlers else contextlib.nullcontext()
    preemption = Preemption(job.preemption_grace)
    try:
        with envvars.set_temporarily(env), handlers:
            values = launch_agent(config, entrypoint, args, preemption)
        return values if isinstance(values, dict) else {}
    except (ChildFailedError, RendezvousError, DistError, SignalException) as exc:
        raise _job_error(exc, job, side, endpoint, preemption) from None
    finally:
        rdzv_configs.pop("first_store", None)
        shutil.rmtree(side, ignore_errors=True)
        if guardian is not None:
            os.close(guardian)  # the guardian sweeps once more and ends

