"""``anyaccel test``: prove in a few seconds that this machine (or cluster) can run a job.

Takes the same options and configuration file as ``anyaccel launch`` and starts a short real job
through the same path (:func:`~anyaccel.launch.command.request_from_args` →
:func:`~anyaccel.launch.plan.resolve_plan` → :func:`~anyaccel.launch.runner.run_plan`), with
:mod:`anyaccel.cli.selftest_worker` as the script. Every worker runs the checks (process group,
device placement, each kind of collective, mixed precision, a few training steps that must agree
across ranks, a save_state/load_state round trip, the hang doctor's mismatch check) and leaves its
results in a temporary directory; this launcher merges them into one line per check with ✓/✗, a
verdict, and exit status 0 (all passed) or 1. ``--json`` prints the same as one JSON object.

It is a quick check, so it does not wait long: unless set already, the rendezvous timeout
(``ANYACCEL_RDZV_TIMEOUT``) is 20 s and the process group's timeout (``ANYACCEL_PG_TIMEOUT``) 30 s,
and the whole job is stopped after ``--timeout`` seconds (default 120). A machine that cannot join
its group ends with a ✗ naming the address and what to check, never a hang.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

from ..errors import CLIError

__all__ = ["add_parser", "run", "merge_results", "QUICK_TIMEOUTS"]

# the environment variables (existing launch options) anyaccel test sets when the user did not
QUICK_TIMEOUTS = {"ANYACCEL_RDZV_TIMEOUT": "20", "ANYACCEL_PG_TIMEOUT": "30"}
_MARK = {"pass": "✓", "fail": "✗", "skip": "–"}
_PREFIX = "anyaccel test"

_DESCRIPTION = """\
Start a short real job with the configured number of processes on this machine's devices (same
options and configuration file as `anyaccel launch`; nothing to write) and check, in a few seconds:
the process group forms, every process is on its device, gather / gather_object / reduce /
broadcast / pad_across_processes / barrier give the right values, mixed precision is what was
configured, a few training steps leave the same weights on every rank, save_state/load_state
restores them exactly, and the hang doctor raises CollectiveMismatchError on every rank when ranks
call different collectives. One line per check, then a verdict; exit status 0 when every check
passed, 1 otherwise.

Timeouts are short: the rendezvous gives up after 20 s (ANYACCEL_RDZV_TIMEOUT), a collective after
30 s (ANYACCEL_PG_TIMEOUT), the whole job after --timeout seconds."""

_EPILOG = """\
examples:
  anyaccel test                                   what `anyaccel launch` would start (config file, else detected)
  anyaccel test --cpu --num_processes 2           two CPU processes
  anyaccel test --mixed_precision bf16 --json     one JSON object on stdout
  anyaccel test --num_machines 2 --machine_rank 0 --main_process_ip 10.0.0.1 --main_process_port 29500
                                                  on each machine (its own --machine_rank): the cluster"""


def add_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Register ``test`` on the ``anyaccel`` sub-command parsers, with every option of
    ``launch`` (taken from its parser, so the two never drift apart); it runs :func:`run`."""
    from ..launch import command as launch_command

    holder = argparse.ArgumentParser(add_help=False)
    launch_parser = launch_command.add_parser(holder.add_subparsers())
    p = subparsers.add_parser(
        "test",
        parents=[launch_parser],
        conflict_handler="resolve",
        help="check in a few seconds that this machine (or cluster) can run a job",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="anyaccel test [launch options] [--json] [--timeout SECONDS]",
    )
    p.add_argument("-m", dest="module", action="store_true", help=argparse.SUPPRESS)  # launch's; no script here
    t = p.add_argument_group("the test")
    t.add_argument("--json", action="store_true", help="print one JSON object (checks, verdict) instead of lines")
    t.add_argument("--timeout", type=launch_command.positive_seconds, default=120.0, metavar="SECONDS",
                   help="stop the job after this long, as a failure (default 120)")
    t.add_argument("--steps", type=int, default=3, metavar="N", help="training steps to compare across ranks (default 3)")
    p.set_defaults(func=run)
    return p


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


def merge_results(out_dir: str) -> List[Dict[str, Any]]:
    """One entry per check from the ``rank<N>.json`` files in ``out_dir``, in the order the
    workers ran them: ``fail`` if any rank failed it (detail of the first failing rank, labelled),
    ``skip`` if every rank skipped it, else ``pass`` (detail of the lowest rank); a check some
    rank never reached (it stopped before) is ``fail`` naming those ranks. ``ranks`` lists the
    ranks that reported the check. Local (the launcher reads its own machine's ranks)."""
    per_rank: Dict[int, Dict[str, Any]] = {}
    for name in os.listdir(out_dir):
        if name.startswith("rank") and name.endswith(".json"):
            try:
                with open(os.path.join(out_dir, name)) as f:
                    data = json.load(f)
            except (OSError, ValueError):
                continue
            per_rank[int(data["rank"])] = data
    order: List[str] = []
    for data in per_rank.values():
        for c in data["checks"]:
            if c["name"] not in order:
                order.append(c["name"])
    from .selftest_worker import CHECKS

    order.sort(key=lambda n: [c[0] for c in CHECKS].index(n) if n in [c[0] for c in CHECKS] else len(CHECKS))
    merged = []
    for check in order:
        found = {r: next((c for c in d["checks"] if c["name"] == check), None) for r, d in sorted(per_rank.items())}
        got = {r: c for r, c in found.items() if c is not None}
        missing = sorted(r for r, c in found.items() if c is None)
        failed = [(r, c) for r, c in got.items() if c["status"] == "fail"]
        if failed:
            status = "fail"
            r, c = failed[0]
            detail = c["detail"] if len(per_rank) == 1 else f"rank {r}: {c['detail']}"
            if len(failed) > 1:
                detail += f" (and {len(failed) - 1} more rank(s))"
        elif missing:
            status = "fail"
            detail = f"not reached on rank(s) {', '.join(map(str, missing))}: the job stopped before"
        else:
            status = "skip" if all(c["status"] == "skip" for c in got.values()) else "pass"
            detail = got[min(got)]["detail"]
        seconds = max((c.get("seconds", 0.0) for c in got.values()), default=0.0)
        merged.append({"name": check, "status": status, "detail": detail, "ranks": sorted(got), "seconds": seconds})
    return merged


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def _plan(args: argparse.Namespace, out_dir: str) -> Any:
    """The launch plan of these options, with the worker module as its target: what
    ``anyaccel launch [options] -m anyaccel.cli.selftest_worker`` would run (``args`` gets that target)."""
    from ..environment.devices import cuda_device_count
    from ..launch import command as launch_command
    from ..launch.plan import PlanError

    args.module = True
    args.script_and_args = ["anyaccel.cli.selftest_worker"]
    try:
        plan = launch_command.plan_from_args(args)  # exactly what `anyaccel launch` would plan
    except PlanError as exc:
        raise CLIError(str(exc)) from None
    gpu_count = cuda_device_count() if plan.device == "gpu" else 0
    worker_args = (
        "--out", out_dir, "--expect_world", str(plan.num_processes or 1), "--expect_device", plan.device,
        "--expect_precision", plan.mixed_precision, "--nproc_per_node", str(plan.nproc_per_node),
        "--gpus_per_machine", str(gpu_count), "--steps", str(args.steps),
    )  # fmt: skip
    return dataclasses.replace(plan, script_args=worker_args)


class _Deadline:
    """Stops the job after ``seconds``: SIGTERM to this process (torch's agent then stops every
    worker; before the agent runs, the handler installed here interrupts the launcher)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.expired = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._saved: Any = None

    def _expire(self) -> None:
        self.expired = True
        os.kill(os.getpid(), signal.SIGTERM)

    def _on_term(self, signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"stopped after {self.seconds:g} s")

    def __enter__(self) -> "_Deadline":
        if threading.current_thread() is threading.main_thread():
            self._saved = signal.signal(signal.SIGTERM, self._on_term)
        self._timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._timer.cancel()
        if self._saved is not None:
            signal.signal(signal.SIGTERM, self._saved)


def _failure(name: str, message: str) -> Dict[str, Any]:
    """A ✗ line the launcher adds itself (the job could not start or did not finish)."""
    return {"name": name, "status": "fail", "detail": message, "ranks": [], "seconds": 0.0}


def run(args: argparse.Namespace) -> int:
    """Carry out ``anyaccel test`` in the launcher (one per machine); returns 0 when every check
    passed on every rank of this machine, 1 otherwise."""
    if args.script_and_args:
        raise CLIError(f"`anyaccel test` runs its own short job and takes no script (got {args.script_and_args[0]!r}); "
                       "to run a script use `anyaccel launch`.")
    for name, value in QUICK_TIMEOUTS.items():
        os.environ.setdefault(name, value)
    if not args.debug:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # c10d's retry logs; the ✗ line says it once
    out_dir = tempfile.mkdtemp(prefix="anyaccel-test-")
    t0 = time.perf_counter()
    try:
        plan = _plan(args, out_dir)
        if not args.json and not args.quiet:
            where = plan.config_path or "no config file (detected defaults and flags)"
            print(f"{_PREFIX}: {plan.summary()}; settings from {where}", flush=True)
        problem = _launch(plan, args.timeout)
        checks = merge_results(out_dir)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    if problem and checks:
        checks.append(_failure("job finished", problem))
    elif problem:  # no rank reported anything: the group never formed
        checks = [_failure("process group formed", problem)]
    failed = [c for c in checks if c["status"] == "fail"]
    verdict = "fail" if failed or not checks else "pass"
    seconds = time.perf_counter() - t0
    if args.json:
        print(json.dumps({
            "verdict": verdict, "exit_code": int(verdict == "fail"), "seconds": round(seconds, 2),
            "plan": {"summary": plan.summary(), "device": plan.device, "num_processes": plan.num_processes,
                     "num_machines": plan.num_machines, "machine_rank": plan.machine_rank,
                     "mixed_precision": plan.mixed_precision, "strategy": plan.strategy,
                     "config_file": plan.config_path},
            "checks": checks,
        }, indent=1))
    else:
        _print(checks, verdict, seconds)
    return 1 if verdict == "fail" else 0


def _launch(plan: Any, timeout: float) -> Optional[str]:
    """Run the plan; returns None when the job ended normally, else what went wrong (one line)."""
    from ..launch.runner import run_plan

    if plan.mode == "agent":  # import torch's agent before the clock runs: an interrupted import breaks torch
        import torch.distributed.launcher.api  # noqa: F401
    deadline = _Deadline(timeout)
    try:
        with deadline:
            code = run_plan(plan)
    except CLIError as exc:  # the group could not be formed, the port is taken, ...
        return str(exc)
    except KeyboardInterrupt:
        if not deadline.expired:
            raise
        code = 128 + signal.SIGTERM
    if deadline.expired:
        return (f"the job did not finish within --timeout {timeout:g} s and was stopped; a process is stuck "
                "(in the rendezvous or a collective). Rerun with --debug to see torch's logs, or raise --timeout "
                "if the first step is legitimately slow (e.g. torch.compile).")
    if code > 128:
        name = signal.Signals(code - 128).name if code - 128 in signal.valid_signals() else f"signal {code - 128}"
        return f"the job was stopped by {name} before it finished; every worker was stopped"
    if code != 0:
        return f"a worker failed (exit status {code}); its error is printed above"
    return None


def _print(checks: List[Dict[str, Any]], verdict: str, seconds: float) -> None:
    width = max((len(c["name"]) for c in checks), default=0)
    for c in checks:
        print(f"  {_MARK[c['status']]} {c['name']:<{width}}  {c['detail']}", flush=True)
    counts = {s: sum(c["status"] == s for c in checks) for s in _MARK}
    skipped = f", {counts['skip']} skipped" if counts["skip"] else ""
    if verdict == "pass":
        print(f"PASS: {counts['pass']} checks passed{skipped} in {seconds:.1f} s. "
              "This setup can run `anyaccel launch train.py`.", flush=True)
    else:
        print(f"FAIL: {counts['fail']} of {len(checks)} checks failed{skipped} ({seconds:.1f} s). "
              "Fix the ✗ lines above, then rerun `anyaccel test` with the same options.", flush=True)
