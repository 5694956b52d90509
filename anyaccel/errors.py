"""Every error anyaccel raises on purpose, under one base class.

``except anyaccel.errors.AnyaccelError`` catches all of them. Each also derives from the builtin
a user would have caught before it existed (``ValueError`` for bad values, ``RuntimeError`` for
things that went wrong at run time), so existing ``except`` clauses keep working.

Messages say what was wrong, which value, and what to do. Imports only the standard library: the
worker bootstrap and the launch planner load this module before torch.
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "AnyaccelError",
    "JobEnvironmentError",
    "ConfigError",
    "CLIError",
    "PlanError",
    "ShapeMismatchError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "PeerExitedError",
    "CheckpointError",
    "LauncherError",
    "WorkerFailedError",
    "FaultToleranceError",
]


class AnyaccelError(Exception):
    """Base of every error anyaccel raises deliberately."""


class JobEnvironmentError(AnyaccelError, RuntimeError):
    """The launcher's environment variables describe an impossible or inconsistent job (a rank
    outside the world, a malformed SLURM node list, an MPI job over several nodes without
    ``MASTER_ADDR``). Raised by :func:`anyaccel.environment.resolve_environment`."""


class ConfigError(AnyaccelError, ValueError):
    """A configuration value or file the user must fix. The message names the file (when known),
    the key, the bad value and what is allowed; ``anyaccel`` prints it as one paragraph, exit 2."""

    def __init__(self, message: str, *, source: Optional[str] = None, key: Optional[str] = None):
        super().__init__(f"{source}: {message}" if source else message)
        self.message, self.source, self.key = message, source, key


class CLIError(AnyaccelError):
    """An error the user can fix, printed by the ``anyaccel`` command as
    ``anyaccel <cmd>: error: <message>`` with exit status ``exit_code`` (2 by default)."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


class PlanError(CLIError):
    """The requested launch is impossible; the message says which value and what to do."""


class ShapeMismatchError(AnyaccelError, RuntimeError):
    """Raised on every rank when a collective is called with different shapes on different ranks."""


class CollectiveMismatchError(ShapeMismatchError):
    """Raised on every rank when ranks reach different collectives at the same point (one in
    ``gather`` while another is in ``reduce`` or a barrier, or one rank a collective ahead); names
    each rank's call and ``file:line``."""


class CollectiveTimeoutError(AnyaccelError, RuntimeError):
    """A collective outlived the process group's timeout; the message is the hang doctor's report
    of where every rank was."""


class PeerExitedError(AnyaccelError, RuntimeError):
    """Another rank left the job while this one waited in a collective; names the rank, its exit
    code and the collective."""


class CheckpointError(AnyaccelError, RuntimeError):
    """A checkpoint could not be written or read; the message names the directory and what is
    missing or wrong."""


class FaultToleranceError(AnyaccelError, RuntimeError):
    """Per-step fault tolerance (``fault_tolerance``, on torchft) cannot go on or cannot start: torchft
    is missing, the Lighthouse cannot be reached, no quorum formed in time, or a replica group joined
    a running job where it cannot continue. The message names the value and what to do."""


class LauncherError(AnyaccelError, RuntimeError):
    """A launch cannot start; nothing was started."""


class WorkerFailedError(AnyaccelError, RuntimeError):
    """A worker started by :func:`~anyaccel.notebook_launcher` raised. ``rank`` is the failing
    rank, ``worker_traceback`` its traceback as text, ``original`` the worker's exception object
    when it could be pickled (also chained as ``__cause__``)."""

    def __init__(self, message: str, rank: int, worker_traceback: Optional[str], original: Optional[BaseException]):
        super().__init__(message)
        self.rank = rank
        self.worker_traceback = worker_traceback
        self.original = original
