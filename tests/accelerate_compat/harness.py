"""Run Accelerate 1.15's own distributed test scripts against Accelerate and against anyaccel.

For each script (:data:`SCRIPTS`) a 2-process job (the worker,
:mod:`tests.accelerate_compat.worker`) first runs ``main()`` with every test call skipped, to learn
which calls it makes on 2 CPU processes (``name:occurrence``, e.g. ``test_data_loader:2``: the third
call of ``test_data_loader``), then runs ``main()`` once per call with only that call selected.
Against the baseline (its calls known), one job runs every script so, one after the other
(:func:`run_jobs`; a script it never reached gets a job of its own).
The two ranks meet at a file barrier after each call; when a call makes no progress for
``timeout`` seconds the job is killed. **Every call that did not pass there runs again in its own
2-process job** (isolated: a fresh pair of processes, nothing left over from earlier calls), and
that result is the one reported — except a call that ``main()``'s own code never reached, failing
before it with the error it also had while listing (running it alone would repeat that), and a
call the caller names in ``expected_failures`` (a difference it has explained, whose result alone
cannot change its verdict: the test's run, one 2-process job less each); a call passes when both
ranks report success. (``isolate=True`` runs every call on its own from the start: the same table,
about four times slower.)

Accelerate's side (the baseline) is launched with torchrun and ``ACCELERATE_USE_CPU=1`` (what
``accelerate launch --cpu`` sets), anyaccel's with ``anyaccel launch --num_processes 2 --cpu``.
Accelerate's results are stored in ``baseline.json`` next to this file (they only change with
Accelerate's version, and measuring them doubles the run time);
``python -m tests.accelerate_compat --impl accelerate --write-baseline`` measures them again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BASELINE = os.path.join(HERE, "baseline.json")
WORKER = os.path.join(HERE, "worker.py")
SCRIPTS = ("test_ops.py", "test_sync.py", "test_distributed_data_loop.py", "test_script.py",
           "external_deps/test_metrics.py")
# Errors of the machine, not of the code under test (two jobs starting at once on a busy box):
# such a job is run once more.
_INFRA_ERRORS = ("connectFullMesh", "Address already in use", "RendezvousConnectionError")


def _command(impl: str, args: List[str]) -> List[str]:
    if impl == "anyaccel":
        launcher = [sys.executable, "-m", "anyaccel.cli", "launch", "--num_processes", "2", "--cpu"]
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    return launcher + [WORKER] + args


def _env(impl: str, swap: str = "full") -> Dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", ACCEL_COMPAT_SWAP=swap)
    if impl == "accelerate":
        env["ACCELERATE_USE_CPU"] = "1"  # what `accelerate launch --cpu` sets; without it torchrun on CPU is "NO"
    return env


def _read_lines(path: str) -> List[Dict[str, Any]]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def run_job(impl: str, script: str, keys: List[str], timeout: float, swap: str = "full") -> Dict[str, Any]:
    """One 2-process job: list ``main()``'s calls, then run ``keys`` one after the other.
    Returns ``{"listing": {...}, "calls": {key: {"ok", "error", ...}}, "log_tail", "reached"}`` with
    the calls both ranks finished; the job is killed when no call finishes for ``timeout`` seconds."""
    return run_jobs(impl, [(script, keys)], timeout, swap)[0]


def run_jobs(impl: str, parts: List[Tuple[str, List[str]]], timeout: float, swap: str = "full") -> List[Dict[str, Any]]:
    """One 2-process job for several ``(script, keys)`` parts, in turn (the worker's ``++``): what
    :func:`run_job` returns, per part. A part the job never reached (``"reached": False``: an
    earlier part hung or ended the job) has no results."""
    out = tempfile.mkdtemp(prefix="accel-compat-")
    dirs = [os.path.join(out, str(i)) for i in range(len(parts))]
    paths = [[os.path.join(d, f"rank{r}.jsonl") for r in range(2)] for d in dirs]
    args: List[str] = []
    for i, (script, keys) in enumerate(parts):
        args += (["++"] if i else []) + [impl, script, dirs[i]] + list(keys)
    log_path = os.path.join(out, "log.txt")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(_command(impl, args), cwd=ROOT, env=_env(impl, swap),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        done, last_progress, timed_out = -1, time.monotonic(), False
        while proc.poll() is None:
            time.sleep(0.2)
            now_done = sum(min(len(_read_lines(p)) for p in part) for part in paths)
            if now_done != done:
                done, last_progress = now_done, time.monotonic()
            elif time.monotonic() - last_progress > timeout:
                timed_out = True
                _kill_tree(proc)
                proc.wait()
    with open(log_path, errors="replace") as f:
        log_tail = f.read()[-3000:]
    results = [_part_result([_read_lines(p) for p in part], keys, timeout, timed_out, proc.returncode, log_tail)
               for part, (_, keys) in zip(paths, parts)]
    shutil.rmtree(out, ignore_errors=True)
    return results


def _part_result(ranks: List[List[Dict[str, Any]]], keys: List[str], timeout: float, timed_out: bool,
                 returncode: Optional[int], log_tail: str) -> Dict[str, Any]:
    """One script's result from what each rank wrote (see :func:`run_job`)."""
    n = min(len(r) for r in ranks)
    lines = [[r[i] for r in ranks] for i in range(n)]
    result: Dict[str, Any] = {"calls": {}, "log_tail": log_tail, "reached": bool(lines)}
    if not lines:
        why = f"timeout after {timeout:.0f} s" if timed_out else f"exit code {returncode}"
        result["listing"] = {"ok": False, "started": False, "seen": [], "missing": [],
                             "error": f"no report ({why}): {_last_line(log_tail)}"}
        return result
    first = lines[0]
    result["listing"] = {"ok": all(r["ok"] for r in first), "started": all(r.get("started") for r in first),
                         "seen": first[0]["seen"], "missing": sorted({m for r in first for m in r.get("missing", [])}),
                         "error": _first_error(first)}
    for pair in lines[1:]:
        result["calls"][pair[0]["key"]] = {"ok": all(r["ok"] for r in pair), "error": _first_error(pair),
                                           "seconds": max(r["seconds"] for r in pair),
                                           "traceback": next((r.get("traceback") for r in pair if not r["ok"]), None)}
    if not result["listing"]["started"]:  # the script does not even import: nothing ran
        for key in keys:
            result["calls"][key] = {"ok": False, "error": f"the script does not start: {result['listing']['error']}",
                                    "seconds": 0.0, "traceback": None, "not_started": True}
    elif len(lines) - 1 < len(keys):
        stuck = keys[len(lines) - 1]
        why = f"timeout: no result after {timeout:.0f} s" if timed_out else \
            f"the job ended (exit code {returncode}) before it: {_last_line(log_tail)}"
        result["calls"][stuck] = {"ok": False, "error": why, "seconds": timeout if timed_out else 0.0,
                                  "traceback": log_tail}
    return result


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process under it (torchrun starts its workers in sessions
    of their own, so killing the launcher's process group would leave them hanging)."""
    import psutil

    try:
        victims = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        victims = []
    os.killpg(proc.pid, signal.SIGKILL)
    for child in victims:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def _first_error(pair: List[Dict[str, Any]]) -> Optional[str]:
    return next((f"rank {i}: {r.get('error')}" for i, r in enumerate(pair) if not r["ok"]), None)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "(no output)"


def _isolated(impl: str, script: str, key: str, timeout: float, swap: str = "full") -> Dict[str, Any]:
    job = run_job(impl, script, [key], timeout, swap)
    res = job["calls"].get(key) or {"ok": False, "error": job["listing"]["error"] or "no result", "seconds": 0.0}
    if not res["ok"] and any(e in (res.get("error") or "") + job["log_tail"] for e in _INFRA_ERRORS):
        job = run_job(impl, script, [key], timeout, swap)
        res = job["calls"].get(key) or {"ok": False, "error": job["listing"]["error"] or "no result", "seconds": 0.0}
    return res


def run_script(impl: str, script: str, timeout: float = 90.0, keys: Optional[List[str]] = None,
               isolate: bool = False, progress: Optional[Callable[[str], None]] = None,
               swap: str = "full", expected_failures=(), job: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The script's report: ``{"started", "missing", "listing_error", "seen", "calls": {key: {...}}}``.
    ``keys`` (the baseline's calls) default to the calls ``main()`` makes here. ``swap``: what the
    anyaccel run rewrites (worker.sed_imports: ``"full"``, or ``"spare_test_utils"``).
    ``expected_failures``: keys that, failing in sequence, are reported so, not run again alone.
    ``job``: the script's part of a job that ran ``keys`` already (:func:`run_jobs`), if it got there."""
    if keys is None:
        keys = run_job(impl, script, [], timeout, swap)["listing"]["seen"]
    if job is None or not job["reached"]:
        job = run_job(impl, script, [] if isolate else list(keys), timeout, swap)
    listing = job["listing"]
    report: Dict[str, Any] = {"started": listing["started"], "missing": listing["missing"],
                              "listing_error": listing["error"], "seen": listing["seen"], "calls": {}}
    for key in keys:
        res = job["calls"].get(key)
        how = "in sequence"
        if res is not None and (res.get("not_started") or _glue_error(res, listing)):
            how = "in sequence; main() fails before it, as when listing"
        elif res is not None and key in expected_failures:
            how = "in sequence; an expected failure, not run again alone"
        elif res is None or not res["ok"]:
            res, how = _isolated(impl, script, key, timeout, swap), "isolated"
        entry = {"ok": res["ok"], "seconds": res.get("seconds")}
        if not res["ok"]:
            entry["error"] = res.get("error")
            if os.environ.get("ACCEL_COMPAT_VERBOSE"):
                entry["traceback"] = res.get("traceback")
        report["calls"][key] = entry
        if progress:
            progress(f"{impl} {script} {key}: {'ok' if res['ok'] else res.get('error')} ({how})")
    return report


def _glue_error(res: Dict[str, Any], listing: Dict[str, Any]) -> bool:
    """The call was not reached because ``main()``'s own code failed before it, with the error it
    also had when listing: running it alone would only repeat that."""
    error, glue = res.get("error") or "", listing.get("error") or ""
    return bool(glue) and "not reached: main() raised before calling it" in error and glue.split(": ", 1)[-1] in error


def run_all(impl: str, timeout: float = 90.0, scripts=SCRIPTS, baseline: Optional[dict] = None,
            isolate: bool = False, progress: Optional[Callable[[str], None]] = None,
            swap: str = "full", expected_failures=frozenset()) -> Dict[str, Any]:
    """Every script's report; with ``baseline`` the calls run are the ones Accelerate made.
    ``expected_failures``: ``(script, key)`` pairs not run again alone when they fail in sequence
    (:func:`run_script`)."""
    results = {}
    jobs: Dict[str, Dict[str, Any]] = {}
    if baseline and not isolate:  # every script's calls known: one job for all, in turn
        parts = [(script, list(baseline["scripts"][script]["calls"])) for script in scripts]
        jobs = dict(zip(scripts, run_jobs(impl, parts, timeout, swap)))
    for script in scripts:
        keys = list(baseline["scripts"][script]["calls"]) if baseline else None
        expected = {key for name, key in expected_failures if name == script}
        results[script] = run_script(impl, script, timeout, keys=keys, isolate=isolate, progress=progress, swap=swap,
                                     expected_failures=expected, job=jobs.get(script))
    return {"impl": impl, "swap": swap, "scripts": results}


def load_baseline() -> Dict[str, Any]:
    with open(BASELINE) as f:
        return json.load(f)


def table(baseline: Dict[str, Any], ours: Dict[str, Any]) -> str:
    """A Markdown table: per script, test calls, passed by Accelerate, passed by anyaccel, then
    one line per call Accelerate passes and anyaccel fails, with the first line of its error."""
    rows = ["| script | starts | test calls | Accelerate passes | anyaccel passes (of those) | anyaccel fails |",
            "|---|---|---|---|---|---|"]
    failures = []
    for script in sorted(baseline["scripts"], key=lambda name: SCRIPTS.index(name) if name in SCRIPTS else 99):
        base, mine = baseline["scripts"][script], ours["scripts"].get(script)
        if mine is None:
            continue
        acc_ok = [k for k, v in base["calls"].items() if v["ok"]]
        failed = [k for k in acc_ok if not mine["calls"].get(k, {}).get("ok")]
        rows.append(f"| `{script}` | {'yes' if mine['started'] else 'no'} | {len(base['calls'])} | {len(acc_ok)} | "
                    f"{len(acc_ok) - len(failed)} | {len(failed)} |")
        failures += [f"- `{script}` `{k}`: {mine['calls'].get(k, {}).get('error', 'not run')}" for k in failed]
    s = summary(baseline, ours)
    total = sum(len(b["calls"]) for name, b in baseline["scripts"].items() if name in ours["scripts"])
    rows.append(f"| **total** | | {total} | {s['accelerate_passes']} | {s['anyaccel_passes']} "
                f"({100 * s['ratio']:.0f} %) | {s['accelerate_passes'] - s['anyaccel_passes']} |")
    return "\n".join(rows + ([""] + failures if failures else []))


def summary(baseline: Dict[str, Any], ours: Dict[str, Any]) -> Dict[str, Any]:
    """``{"accelerate_passes", "anyaccel_passes" (of those), "ratio"}`` over the scripts run."""
    acc_ok = [(s, k) for s, b in baseline["scripts"].items() if s in ours["scripts"]
              for k, v in b["calls"].items() if v["ok"]]
    both = [(s, k) for s, k in acc_ok if ours["scripts"][s]["calls"].get(k, {}).get("ok")]
    return {"accelerate_passes": len(acc_ok), "anyaccel_passes": len(both),
            "ratio": len(both) / len(acc_ok) if acc_ok else 0.0}
