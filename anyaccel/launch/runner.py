"""Carry out a :class:`~anyaccel.launch.plan.LaunchPlan` on torch's own elastic agent.

The launcher process (one per machine) calls :func:`run_plan`; it returns the exit status.

* ``agent`` mode: ``torch.distributed.launcher.api.elastic_launch`` starts ``nproc_per_node``
  workers, each ``python -u -m anyaccel.launch.bootstrap TARGET ARGS...``. On one machine the
  rendezvous is a TCP store bound to 127.0.0.1 on a free port (or the port asked for), served by a
  small handler registered with torch's rendezvous registry (a fresh store for every restart), so
  two jobs never collide and nothing listens on the network. On several machines, torch's static
  (or c10d) rendezvous at ``main_process_ip:port``.
  When a worker fails, the agent stops the others (SIGTERM, then SIGKILL after a few seconds) and
  this function prints the root cause once; SIGINT/SIGTERM on the launcher stop every worker.
* ``in_process`` mode (an ``srun`` task that is itself one worker): the script runs here.
* ``xla`` mode: torch-xla's spawn starts the TPU processes (through :mod:`anyaccel.backends.xla`).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import socket
import sys
import tempfile
from typing import Any, List, Optional, Tuple

from .plan import LaunchPlan

__all__ = ["run_plan", "worker_args", "loopback_store"]

_PREFIX = "anyaccel launch"


def _say(plan: LaunchPlan, message: str) -> None:
    if not plan.quiet:
        print(f"{_PREFIX}: {message}", file=sys.stderr, flush=True)


def worker_args(plan: LaunchPlan) -> List[str]:
    """The arguments after ``python`` for every worker."""
    return ["-u", "-m", "anyaccel.launch.bootstrap", *(["-m"] if plan.is_module else []), plan.target, *plan.script_args]


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
        """The rendezvous of a one-machine job: a TCP store on 127.0.0.1 that the workers share.

        Every round (the first start and each ``--max_restarts`` restart) gets a *fresh* store:
        torch's static rendezvous reuses one store, so a restarted gloo group read the previous
        attempt's addresses and failed ("Gloo connectFullMesh ... Connection refused")."""

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


def loopback_rendezvous(port: Optional[int]) -> Tuple[str, str, str, dict]:
    """Set up the rendezvous of a one-machine job: bind the first store now (so a busy ``port``
    fails here, with ``OSError``) and return ``(backend, endpoint, run_id, rdzv_configs)`` for
    torch's ``LaunchConfig``. Each later round (restart) gets a fresh free loopback port."""
    import uuid

    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    first = loopback_store(port)
    try:
        rendezvous_handler_registry.register(LOOPBACK_BACKEND, _loopback_handler)
    except ValueError:  # already registered (a second launch in this process)
        pass
    configs = {"first_store": first, "timeout": int(os.environ.get("ANYACCEL_RDZV_TIMEOUT", 900))}
    return LOOPBACK_BACKEND, f"127.0.0.1:{first[1]}", f"anyaccel-{uuid.uuid4().hex[:12]}", configs


_TORCH_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


def _quiet_torch_logs(debug: bool) -> None:
    """The agent logs every failure and every SIGTERM it sends; anyaccel reports failures itself,
    once, so those logs are shown only with ``--debug``."""
    level = logging.INFO if debug else logging.CRITICAL
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(_TORCH_LOGGERS):
            logging.getLogger(name).setLevel(level)


def run_plan(plan: LaunchPlan) -> int:
    """Run the job described by ``plan`` from this machine's launcher; returns the exit status."""
    for note in plan.notes:
        _say(plan, f"note: {note}")
    os.environ.update(plan.env_dict())
    if plan.mode == "in_process":
        return _run_in_process(plan)
    if plan.mode == "xla":
        return _run_xla(plan)
    return _run_agent(plan)


def _run_in_process(plan: LaunchPlan) -> int:
    from . import bootstrap

    return bootstrap.main((["-m"] if plan.is_module else []) + [plan.target, *plan.script_args])


def _run_xla(plan: LaunchPlan) -> int:  # pragma: no cover - needs a TPU
    from ..backends import xla
    from ..cli import CLIError

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
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from . import failures

    _quiet_torch_logs(plan.debug)
    if plan.single_machine:
        try:
            backend, endpoint, run_id, rdzv_configs = loopback_rendezvous(plan.main_process_port)
        except OSError as exc:
            from ..cli import CLIError

            raise CLIError(
                f"cannot listen on 127.0.0.1:{plan.main_process_port} ({exc.strerror or exc}); another job "
                "probably uses that port. Leave out --main_process_port (and main_process_port in the config "
                "file) to get a free port."
            ) from None
    else:
        host = plan.main_process_ip
        endpoint = f"[{host}]:{plan.main_process_port}" if ":" in host else f"{host}:{plan.main_process_port}"
        run_id, backend = plan.run_id, plan.rdzv_backend
        rdzv_configs = {"timeout": int(os.environ.get("ANYACCEL_RDZV_TIMEOUT", 900))}
    os.environ["ANYACCEL_AGENT_PID"] = str(os.getpid())
    side = tempfile.mkdtemp(prefix="anyaccel-failures-")
    os.environ["ANYACCEL_FAILURE_DIR"] = side
    if backend == "static":
        rdzv_configs["rank"] = plan.machine_rank
    config = LaunchConfig(
        min_nodes=plan.num_machines,
        max_nodes=plan.num_machines,
        nproc_per_node=plan.nproc_per_node,
        logs_specs=DefaultLogsSpecs(),
        run_id=run_id,
        role="anyaccel",
        rdzv_endpoint=endpoint,
        rdzv_backend=backend,
        rdzv_configs=rdzv_configs,
        max_restarts=plan.max_restarts,
        monitor_interval=plan.monitor_interval,
        start_method="spawn",
        shutdown_timeout=int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 5)),
    )
    if plan.debug or not plan.single_machine:
        _say(plan, f"{plan.summary()}; rendezvous {backend} at {endpoint}")
        if not plan.single_machine:
            _say(plan, f"waiting for all {plan.num_machines} machines to join (timeout {rdzv_configs['timeout']} s)")
    try:
        elastic_launch(config, sys.executable)(*worker_args(plan))
        return 0
    except ChildFailedError as err:
        found = failures.failures_from(err, side)
        print(f"{_PREFIX}: error: " + failures.report(found, plan.num_processes, plan.machine_rank), file=sys.stderr, flush=True)
        return 1
    except (RendezvousError, DistError) as exc:  # the group could not be formed
        from ..cli import CLIError

        text = " ".join(str(exc).split()).rstrip(".")
        if "EADDRINUSE" in text or "address already in use" in text:
            hint = f"port {plan.main_process_port} is already used on this machine: pick another --main_process_port"
        else:
            hint = (f"check that every machine runs the same command with --num_machines {plan.num_machines}, "
                    f"--main_process_ip {plan.main_process_ip} and --main_process_port {plan.main_process_port} "
                    "(its own --machine_rank), that machine 0 is up and that the port is reachable")
        raise CLIError(f"could not form the group at {endpoint} (machine {plan.machine_rank} of {plan.num_machines}): "
                       f"{type(exc).__name__}: {text[:400]}. {hint[0].upper()}{hint[1:]}.", exit_code=1) from None
    except SignalException as exc:
        import signal

        name = signal.Signals(exc.sigval).name if hasattr(exc, "sigval") else "a signal"
        print(f"{_PREFIX}: stopped by {name}; every worker was stopped too", file=sys.stderr, flush=True)
        return 128 + int(getattr(exc, "sigval", 1))
    finally:
        rdzv_configs.pop("first_store", None)
        shutil.rmtree(side, ignore_errors=True)
