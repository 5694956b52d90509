"""What a replica group is told, resolved once: :class:`FaultToleranceSettings`.

The option ``fault_tolerance`` (one row of :mod:`anyaccel.optionspec`: argument, config key, flag
``--fault_tolerance``, variable ``ANYACCEL_FAULT_TOLERANCE``) is ``off``, ``on`` or a Lighthouse's
``HOST:PORT``. ``on`` is the launcher's to resolve: ``anyaccel launch`` starts the Lighthouse and
tells every worker its address, with the worker's replica group and the number of groups
(``ANYACCEL_REPLICA_GROUP``, ``ANYACCEL_REPLICA_GROUPS``). A worker therefore always knows an
address; a script started without the launcher gives the address and sets the two variables
itself (one ``torchrun`` or ``srun`` per group).

torchft is an optional dependency (``pip install 'anyaccel[ft]'``, pinned): :func:`require_torchft`
says so, naming the option that asked for it, instead of an ``ImportError`` from deep inside.
Local and pure except :func:`require_torchft` (an import).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

from .. import envvars
from ..errors import FaultToleranceError

__all__ = ["FaultToleranceSettings", "require_torchft", "torchft_missing", "TORCHFT_VERSION", "resolve_settings"]

#: the torchft release anyaccel is written and tested against (the ``ft`` extra pins it)
TORCHFT_VERSION = "0.2.0"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultToleranceSettings:
    """One replica group's fault-tolerance settings. ``lighthouse``: the Lighthouse's
    ``http://HOST:PORT``; ``group`` of ``groups`` replica groups; ``min_replicas``: groups a step
    needs to commit; ``timeout_s``: how long an all-reduce, a commit vote or a transfer from a
    healing peer may take before the step is given up (torchft's ``TORCHFT_TIMEOUT_SEC`` sets
    it, for torchft and for the gloo group of the gradients alike); ``quorum_timeout_s``: how
    long a step waits for its quorum before the job stops with an error
    (``TORCHFT_QUORUM_TIMEOUT_SEC``). Frozen; checked when made."""

    lighthouse: str
    group: int
    groups: int
    min_replicas: int = 1
    timeout_s: float = 60.0
    quorum_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.lighthouse.startswith("http://"):
            object.__setattr__(self, "lighthouse", f"http://{self.lighthouse}")
        if self.groups < 1 or not 0 <= self.group < self.groups:
            raise FaultToleranceError(
                f"replica group {self.group} of {self.groups}: the group must be in 0..{self.groups - 1} (set "
                f"{envvars.REPLICA_GROUP.name} and {envvars.REPLICA_GROUPS.name}, or start with anyaccel launch)")
        if self.min_replicas > self.groups:
            raise FaultToleranceError(
                f"fault_tolerance_min_replicas is {self.min_replicas} but the job has {self.groups} replica groups: no "
                f"step could ever commit; use at most {self.groups}")
        for name, seconds, variable in (("timeout_s", self.timeout_s, TIMEOUT_VARIABLE),
                                        ("quorum_timeout_s", self.quorum_timeout_s, QUORUM_TIMEOUT_VARIABLE)):
            if not seconds > 0:
                raise FaultToleranceError(
                    f"fault tolerance {name} is {seconds!r}: it must be a positive number of seconds (set {variable})")

    @property
    def quorum_wait_s(self) -> float:
        """The most a step waits for its quorum's answer, whatever torchft's quorum thread does: the
        Lighthouse's answer (``quorum_timeout_s``), then a rebuild of the gradient group, a heal's
        metadata and its transfer (``timeout_s`` each). Local."""
        return self.quorum_timeout_s + 3 * self.timeout_s


def resolve_settings(value: str, min_replicas: Optional[int], env: Optional[Mapping[str, str]] = None
                     ) -> Optional[FaultToleranceSettings]:
    """The settings of a worker whose ``fault_tolerance`` option is ``value`` (already checked by
    its row: ``off``, ``on`` or ``HOST:PORT``); None for ``off``. The replica group and the number
    of groups come from the launcher's variables. Raises :class:`FaultToleranceError` saying what
    to do for ``on`` without the launcher, or for missing group variables. Local."""
    if value == "off":
        return None
    missing = torchft_missing()
    if missing:
        raise FaultToleranceError(missing)
    group = envvars.read(envvars.REPLICA_GROUP, env)
    groups = envvars.read(envvars.REPLICA_GROUPS, env)
    if value == "on":
        raise FaultToleranceError(
            "fault_tolerance is 'on' in a process that anyaccel launch did not start with fault tolerance: 'on' asks "
            "the launcher to start the torchft Lighthouse. Start the script with `anyaccel launch --fault_tolerance on "
            "...`, or give the address of a running Lighthouse (fault_tolerance='HOST:PORT', e.g. from "
            "`torchft_lighthouse --min_replicas 1`) and set " + _GROUP_VARIABLES)
    if group is None or groups is None:
        raise FaultToleranceError(
            f"fault_tolerance is {value!r} but this process does not know its replica group: set "
            + _GROUP_VARIABLES + " (anyaccel launch --fault_tolerance does)")
    # torchft's own variables, read here too: the gloo group's operations take the same timeout
    # (without it a pulled cable held an all-reduce for the default 60 s whatever the variable said)
    seen = os.environ if env is None else env
    _seconds(seen, CONNECT_TIMEOUT_VARIABLE, 60)  # not anyaccel's, but torchft's Manager reads it as the two below
    return FaultToleranceSettings(lighthouse=value, group=int(group), groups=int(groups),
                                  min_replicas=int(min_replicas or 1),
                                  timeout_s=_seconds(seen, TIMEOUT_VARIABLE, 60),
                                  quorum_timeout_s=_seconds(seen, QUORUM_TIMEOUT_VARIABLE, 120))


#: torchft's variables for its timeouts (torchft's ``Manager`` reads them too, as whole seconds)
TIMEOUT_VARIABLE = "TORCHFT_TIMEOUT_SEC"
QUORUM_TIMEOUT_VARIABLE = "TORCHFT_QUORUM_TIMEOUT_SEC"
CONNECT_TIMEOUT_VARIABLE = "TORCHFT_CONNECT_TIMEOUT_SEC"


def _seconds(env: Mapping[str, str], variable: str, default: int) -> float:
    """``variable`` of ``env`` as torchft 0.2.0 reads it (``int(value)`` seconds when it is set,
    even to ""), else ``default``. torchft's ``Manager`` reads the same variable itself and fails on
    anything ``int()`` refuses ("5.5" and "" included) with a ValueError that anyaccel would report
    as an unreachable Lighthouse; the value is checked here, once, naming the variable. Local, pure."""
    text = env.get(variable)
    if text is None:
        return float(default)
    try:
        seconds = int(text)
    except ValueError:
        seconds = 0
    if seconds <= 0:
        raise FaultToleranceError(
            f"{variable} is {text!r}: torchft reads it as a whole number of seconds greater than 0 (e.g. "
            f"{variable}={default}); set it so, or unset it for {default} s")
    return float(seconds)


_GROUP_VARIABLES = (f"{envvars.REPLICA_GROUP.name} (this group: 0, 1, ...) and {envvars.REPLICA_GROUPS.name} "
                    "(how many groups) in every process of each group")


def torchft_missing() -> Optional[str]:
    """What to do when torchft is not installed (the one message), or None when it is; looks
    for it without importing it (its import costs time). Local."""
    import importlib.util

    if importlib.util.find_spec("torchft") is not None:
        return None
    return (f"fault_tolerance needs torchft {TORCHFT_VERSION}, which is not installed here; install it with `pip "
            f"install 'anyaccel[ft]'` (or `pip install torchft=={TORCHFT_VERSION}`), or set fault_tolerance to off")


def require_torchft() -> Any:
    """Import and return ``torchft``, or raise :class:`FaultToleranceError` saying how to install
    the pinned release. Local."""
    try:
        import torchft
    except ImportError as exc:
        raise FaultToleranceError(
            f"fault_tolerance needs torchft {TORCHFT_VERSION}, which is not installed here ({exc}); install it with "
            f"`pip install 'anyaccel[ft]'` (or `pip install torchft=={TORCHFT_VERSION}`), or set fault_tolerance to "
            "off") from None
    return torchft
