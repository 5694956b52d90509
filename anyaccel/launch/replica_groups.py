"""``anyaccel launch --fault_tolerance``: a torchft Lighthouse and one launcher per replica group.

With fault tolerance the machine's processes are replica groups — one process each, or, under
``parallelism_config``, its ``dp_replicate_size`` groups of the other sizes' processes (FSDP2
inside each) — and a group must fail, restart and heal **without** touching the others. torch's elastic agent
restarts *all* the workers of its job when one fails, so each group gets an agent — and a
rendezvous, a store, a guardian — of its own: :func:`run_replica_groups` starts

1. the Lighthouse (:class:`~anyaccel.fault_tolerance.lighthouse.Lighthouse`), in this process,
   bound to 127.0.0.1, unless ``--fault_tolerance HOST:PORT`` names a running one. On several
   machines (``--num_machines N --machine_rank K --main_process_ip IP``) each machine's launch
   starts its equal share of the groups (machine ``K`` the groups ``K*n .. K*n+n-1``; a group
   stays on one machine), and machine 0's serves the Lighthouse on every interface at the main
   process's port (``--main_process_port``, 29500 by default: no job-wide rendezvous uses it), where
   the other machines' groups find it;
2. one child launcher per group (``python -m anyaccel.launch.replica_groups PLAN GROUP``, a new
   session each): :func:`~anyaccel.launch.runner.run_agent` on the plan narrowed to that group —
   one worker told its group, the number of groups and the Lighthouse's address. Its agent
   restarts the group's worker when it dies (``--max_restarts`` times) and says so in one line;
3. a wait for every group. A child launcher killed as a whole (its worker and its agent) is
   started again, up to ``--max_restarts`` times per group, its workers told so
   (``ANYACCEL_REPLICA_GROUP_RESTART``): a restarted group that finds no live peer and nothing
   of its own to resume from stops instead of training from scratch alone.

SIGTERM, SIGUSR1, SIGINT and SIGHUP received here are passed to every child launcher (each then
does what ``anyaccel launch`` does: preemption checkpoints, or stopping its workers). The exit
status: 0 when every group finished, or when at least one did and the others were lost (the
summary names them: the model is complete on the groups that finished); 75 when the groups saved
for a preemption; otherwise the first failure's status. Runs in the launcher only (Local).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from .. import envvars
from .plan import DEFAULT_MAIN_PORT, LaunchPlan

__all__ = ["run_replica_groups", "group_plan", "groups_of", "lighthouse_address", "owns_address", "summary", "main"]

_PREFIX = "anyaccel launch"
_FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1")


def group_plan(plan: LaunchPlan, group: int, lighthouse: str, restarts_left: int, restart: int = 0) -> LaunchPlan:
    """``plan`` narrowed to replica group ``group``: its ``replica_group_size`` processes, told
    their group, the number of groups and the Lighthouse's address (and, after the supervisor
    restarted its launcher, how often); under ``parallelism_config`` the group's own sizes
    (``dp_replicate`` is the groups, which torchft joins: 1 inside a group). Local, pure."""
    env = dict(plan.worker_env)
    env.update({envvars.WORKER_VARS["fault_tolerance"].name: lighthouse,
                envvars.REPLICA_GROUP.name: str(group), envvars.REPLICA_GROUPS.name: str(groups_of(plan))})
    replicate = envvars.PARALLELISM_SIZES["dp_replicate_size"].name
    if replicate in env:
        env[replicate] = "1"
    if restart:
        env[envvars.REPLICA_GROUP_RESTART.name] = str(restart)
    if not plan.debug:
        env.setdefault("RUST_LOG", os.environ.get("RUST_LOG", "error"))  # torchft's Rust side: errors only
    size = plan.replica_group_size
    if plan.device == "gpu":  # each group its own GPUs: its agent numbers its ranks (and picks devices) from 0
        ids = _machine_gpus(plan)
        first = (group - plan.first_replica_group) * size  # its processes' places among the machine's
        mine = [ids[(first + j) % len(ids)] for j in range(size)]  # (more processes than GPUs: shared, as before)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(dict.fromkeys(mine))
    # one machine's agent of its own (a group does not span machines): its rendezvous on loopback, a free port
    return dataclasses.replace(plan, nproc_per_node=size, num_processes=size, worker_env=tuple(sorted(env.items())),
                               replica_group=group, max_restarts=restarts_left, notes=(), main_process_port=None,
                               num_machines=1, machine_rank=0, main_process_ip="127.0.0.1", rdzv_backend="static")


def _machine_gpus(plan: LaunchPlan) -> List[str]:
    """The GPUs this machine's processes use, in order: the ``--gpu_ids`` given, else those
    ``CUDA_VISIBLE_DEVICES`` shows this launcher, else every GPU it sees (at least one id)."""
    visible = plan.env_dict().get("CUDA_VISIBLE_DEVICES") or os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [i.strip() for i in visible.split(",") if i.strip()]
    else:
        from ..environment.devices import cuda_device_count

        ids = [str(i) for i in range(cuda_device_count() or plan.nproc_per_node)]
    return ids or ["0"]


def groups_of(plan: LaunchPlan) -> int:
    """How many replica groups the job has, on every machine together. Local, pure."""
    return plan.replica_groups


def lighthouse_address(plan: LaunchPlan) -> Optional[str]:
    """Where the job's Lighthouse serves: the given ``HOST:PORT``; with ``fault_tolerance on`` on
    several machines machine 0's main process address and port; None where this launch starts one
    on loopback (one machine). Local, pure."""
    if plan.fault_tolerance != "on":
        return plan.fault_tolerance
    if plan.single_machine:
        return None
    from ..environment.network import host_port

    return host_port(plan.main_process_ip, plan.main_process_port or DEFAULT_MAIN_PORT)


class _Group:
    """One replica group's child launcher and what happened to it."""

    def __init__(self, index: int, restarts: int):
        self.index = index
        self.restarts_left = restarts  # launcher restarts left (its agent counts the worker restarts)
        self.relaunched = 0
        self.proc: Optional[subprocess.Popen] = None
        self.code: Optional[int] = None


def _start(group: _Group, plan_path: str) -> None:
    command = [sys.executable, "-m", "anyaccel.launch.replica_groups", plan_path, str(group.index),
               str(group.restarts_left), str(group.relaunched)]
    group.proc = subprocess.Popen(command, start_new_session=True, preexec_fn=_die_with_us)


def _die_with_us() -> None:  # in the child, before exec: it ends with this launcher, even on SIGKILL
    from ..process.lifetime import die_with_parent

    die_with_parent(signal.SIGKILL)


def summary(codes: Dict[int, Optional[int]], relaunched: Dict[int, int]) -> "tuple[int, str]":
    """The launcher's exit status and one line for the user, from each group's exit status
    (``codes``) and how often its launcher was started again. Local, pure."""
    from ..process.preemption import PREEMPTED_EXIT_CODE

    def describe(index: int, code: Optional[int]) -> str:
        again = f" (its launcher started again {relaunched[index]}x)" if relaunched.get(index) else ""
        if code == 0:
            return f"group {index} finished{again}"
        if code == PREEMPTED_EXIT_CODE:
            return f"group {index} saved a checkpoint and stopped (preemption){again}"
        if code is not None and code < 0:
            return f"group {index} lost: its launcher was killed by {signal.Signals(-code).name}{again}"
        return f"group {index} lost: exit {code}{again}"

    line = "replica groups: " + "; ".join(describe(i, c) for i, c in sorted(codes.items()))
    values = list(codes.values())
    if all(c == 0 for c in values):
        return 0, line
    if any(c == 0 for c in values):
        return 0, line + " (training finished on the groups that finished)"
    if all(c in (0, PREEMPTED_EXIT_CODE) for c in values):
        return PREEMPTED_EXIT_CODE, line
    first = next(c for c in values if c not in (0, PREEMPTED_EXIT_CODE))
    return (1 if first is None or first < 0 else int(first)), line


def run_replica_groups(plan: LaunchPlan) -> int:
    """Run ``plan`` as replica groups (module docstring); returns the exit status. Local."""
    from ..fault_tolerance.lighthouse import Lighthouse

    say = (lambda message: None) if plan.quiet else (lambda message: print(f"{_PREFIX}: {message}", file=sys.stderr,
                                                                           flush=True))
    for note in plan.notes:
        say(f"note: {note}")
    _check_machine_rank(plan, say)
    lighthouse = None
    address = lighthouse_address(plan)
    if plan.fault_tolerance == "on" and plan.machine_rank == 0:
        os.environ.setdefault("RUST_LOG", "error" if not plan.debug else "info")
        if address is None:
            lighthouse = Lighthouse(plan.fault_tolerance_min_replicas, host="127.0.0.1")
        else:  # for the other machines' groups too
            lighthouse = _serve_lighthouse(plan)
        address = lighthouse.address
    assert address is not None
    size, here, first = plan.replica_group_size, plan.replica_groups_here, plan.first_replica_group
    where = "" if plan.single_machine else f" ({here} on this machine: {first}-{first + here - 1})"
    origin = "started here" if lighthouse is not None else ("machine 0's" if plan.fault_tolerance == "on" else "given")
    say(f"fault tolerance: {groups_of(plan)} replica groups of {size} process{'es' if size > 1 else ''}{where}, torchft "
        f"Lighthouse at {address} ({origin}), a step commits with at least "
        f"{plan.fault_tolerance_min_replicas} group(s)")
    folder = tempfile.mkdtemp(prefix="anyaccel-replica-groups-")
    groups = [_Group(first + i, plan.max_restarts) for i in range(here)]
    received: List[int] = []  # signals to pass on to the groups' launchers (emptied as they are)
    seen: List[int] = []  # every signal this launcher received
    previous = _forward_signals(received, seen)
    try:
        plan_path = os.path.join(folder, "plan.pickle")
        with open(plan_path, "wb") as fh:
            pickle.dump((plan, address), fh)
        for group in groups:
            _start(group, plan_path)
        _wait(groups, plan_path, received, say)
        if lighthouse is not None and not plan.single_machine:
            _serve_the_other_machines(lighthouse, seen, say)
    finally:
        _restore_signals(previous)
        for group in groups:
            if group.proc is not None and group.proc.poll() is None:
                group.proc.kill()
                group.proc.wait()
        if lighthouse is not None:
            lighthouse.close()
        shutil.rmtree(folder, ignore_errors=True)
    code, line = summary({g.index: g.code for g in groups}, {g.index: g.relaunched for g in groups})
    say(line)
    return code


def owns_address(host: str) -> Optional[bool]:
    """Whether ``host`` (an address or a name) is an address of this machine: a socket can bind
    it; None when the name does not resolve. Local."""
    import socket

    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((sockaddr[0], 0))
            return True
        except OSError:
            continue
    return False


def _check_machine_rank(plan: LaunchPlan, say: Any) -> None:
    """Several machines with ``fault_tolerance on``: machine 0 serves the Lighthouse at the main
    address, so the machine there is machine 0 and no other is. A rank that does not fit is refused
    where it came from a config file (one file shared by every machine, e.g. a home directory on
    NFS, gives each ``machine_rank`` 0: every machine would start groups 0..n-1 and train on their
    data), and said where it was given on the command line (behind NAT or in a container the main
    address may not be one this machine can bind). Local."""
    if plan.single_machine or plan.fault_tolerance != "on":
        return
    here = owns_address(plan.main_process_ip)
    if here is None or here == (plan.machine_rank == 0):
        return
    source = dict(plan.sources).get("machine_rank", "default")
    problem = (f"machine_rank {plan.machine_rank} ({'from the ' if source == 'config file' else 'from '}{source}), but "
               f"--main_process_ip {plan.main_process_ip} is {'an address of this machine' if here else 'not an address of this machine'}: "
               "machine 0 is the one at the main address (it serves the Lighthouse there), and each machine starts the "
               "replica groups of its rank")
    if source == "flag":
        say(f"warning: {problem}; going on as told (behind NAT the main address may not be this machine's own)")
        return
    from ..errors import CLIError

    raise CLIError(f"fault_tolerance on: {problem}. Pass --machine_rank K on machine K (a config file shared by "
                   "every machine gives them all the same rank)")


def _serve_lighthouse(plan: LaunchPlan) -> Any:
    """Machine 0's Lighthouse for a job on several machines: every interface (IPv6's too where the
    main address is one), the main process's port."""
    from ..errors import CLIError
    from ..fault_tolerance.lighthouse import Lighthouse

    every = "::" if ":" in plan.main_process_ip else "0.0.0.0"
    port = plan.main_process_port or DEFAULT_MAIN_PORT
    try:
        return Lighthouse(plan.fault_tolerance_min_replicas, host=every, port=port, advertise=plan.main_process_ip)
    except RuntimeError as exc:  # torchft's: the port is taken
        raise CLIError(f"fault_tolerance on: machine 0 could not serve the Lighthouse on port "
                       f"{port} ({str(exc).splitlines()[0][:200]}); the other machines' groups look "
                       "for it at --main_process_ip:--main_process_port: choose a free --main_process_port") from exc


#: seconds without any group heartbeating before machine 0's Lighthouse stops (once its own groups
#: have ended): a group elsewhere that restarts (a new interpreter importing torch) is silent that long
QUIET_BEFORE_STOP_S = 30.0


def _serve_the_other_machines(lighthouse: Any, signalled: List[int], say: Any) -> None:
    """Machine 0's groups have ended, but groups on the other machines may still train (a step
    behind, healing, or outliving machine 0's lost ones), and each of their quorums needs the
    Lighthouse: it serves on until no group has heartbeat to it for :data:`QUIET_BEFORE_STOP_S`
    (a group that restarts is silent a while), or a signal reaches this launcher (``signalled``:
    every signal received so far, one that came while the groups ran included)."""
    said = False
    quiet_since: Optional[float] = None
    while not signalled:
        count = lighthouse.heartbeating()
        if count is None:
            say("the Lighthouse's status could not be read; it stops with this launcher (groups still training on other "
                "machines then fail at their next quorum)")
            return
        now = time.monotonic()
        if count == 0:
            quiet_since = now if quiet_since is None else quiet_since
            if now - quiet_since >= QUIET_BEFORE_STOP_S:
                return
        else:
            quiet_since = None
            if not said:
                say(f"this machine's replica groups have ended; the Lighthouse serves on while groups on the other "
                    f"machines train ({count} heartbeating; it stops {QUIET_BEFORE_STOP_S:g} s after the last)")
                said = True
        time.sleep(1.0)


def _wait(groups: List[_Group], plan_path: str, received: List[int], say: "object") -> None:
    """Wait for every group's launcher, passing on signals; start again a launcher that was
    killed by a signal (not one this launcher passed on) while it has restarts left."""
    running = list(groups)
    while running:
        while received:
            sig = received.pop(0)
            for group in running:
                if group.proc is not None and group.proc.poll() is None:
                    group.proc.send_signal(sig)
        for group in list(running):
            code = group.proc.poll() if group.proc is not None else None
            if code is None:
                continue
            if code < 0 and -code not in _SENT and group.restarts_left > 0:
                group.restarts_left -= 1
                group.relaunched += 1
                say(f"replica group {group.index}: its launcher was killed by {signal.Signals(-code).name}; starting "  # type: ignore[operator]
                    f"the group again ({group.relaunched} of {group.relaunched + group.restarts_left})")
                _start(group, plan_path)
                continue
            group.code = code
            running.remove(group)
        time.sleep(0.1)


_SENT: "set[int]" = set()  # signals passed on to the groups' launchers (their deaths by them are not restarted)


def _forward_signals(received: List[int], seen: Optional[List[int]] = None) -> Dict[int, object]:
    previous: Dict[int, object] = {}

    def handler(signum: int, frame: object) -> None:
        _SENT.add(signum)
        received.append(signum)
        if seen is not None:
            seen.append(signum)

    for name in _FORWARDED:
        sig = getattr(signal, name, None)
        if sig is not None:
            previous[int(sig)] = signal.getsignal(sig)
            signal.signal(sig, handler)
    return previous


def _restore_signals(previous: Dict[int, object]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)  # type: ignore[arg-type]


def main(argv: Optional[List[str]] = None) -> int:
    """A replica group's launcher: ``python -m anyaccel.launch.replica_groups PLAN GROUP
    RESTARTS_LEFT RELAUNCHED`` (started by :func:`run_replica_groups`). Returns its exit status.
    Local to that launcher."""
    from ..errors import CLIError
    from .runner import run_agent

    plan_path, group, restarts_left, relaunched = (argv if argv is not None else sys.argv[1:])[:4]
    with open(plan_path, "rb") as fh:
        plan, address = pickle.load(fh)
    try:
        return run_agent(group_plan(plan, int(group), address, int(restarts_left), int(relaunched)))
    except CLIError as exc:
        print(f"{_PREFIX}: replica group {group}: error: {exc}", file=sys.stderr, flush=True)
        return int(getattr(exc, "exit_code", 1) or 1)


if __name__ == "__main__":
    sys.exit(main())
