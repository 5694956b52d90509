"""Run Accelerate 1.15's own distributed test scripts against Accelerate and against anyaccel.

For each script (:data:`SCRIPTS`), a *listing job* runs ``main()`` with every test call skipped
to learn which calls it makes on 2 CPU processes (``name:occurrence``, e.g. ``test_data_loader:2``:
the third call of ``test_data_loader``); then each call runs in **its own 2-process job** (the
worker, :mod:`tests.accelerate_compat.worker`) with a timeout, so one failure or hang cannot
affect the others. A call passes when both ranks report success.

Accelerate's side (the baseline) is launched with torchrun, anyaccel's with
``anyaccel launch --num_processes 2 --cpu``. Accelerate's results are stored in
``baseline.json`` next to this file (they only change with Accelerate's version, and measuring
them doubles the run time); ``python -m tests.accelerate_compat --impl accelerate --write-baseline``
measures them again.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BASELINE = os.path.join(HERE, "baseline.json")
WORKER = os.path.join(HERE, "worker.py")
ACCELERATE_VERSION = "1.15.0"
SCRIPTS = ("test_ops.py", "test_sync.py", "test_distributed_data_loop.py", "test_script.py",
           "external_deps/test_metrics.py")
# Names that the data-loader work (issue 14, part 2) adds; until it is merged the scripts that
# import them still start (the names are placeholders that raise when used).
PENDING_NAMES = frozenset({"anyaccel.DataLoaderConfiguration", "anyaccel.utils.DataLoaderConfiguration",
                           "anyaccel.DataLoaderDispatcher", "anyaccel.SeedableRandomSampler"})


def _command(impl: str, args: List[str]) -> List[str]:
    if impl == "anyaccel":
        launcher = [sys.executable, "-m", "anyaccel.cli", "launch", "--num_processes", "2", "--cpu"]
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    return launcher + [WORKER] + args


# Errors of the machine, not of the code under test (two jobs starting at once on a busy box):
# such a job is run once more.
_INFRA_ERRORS = ("connectFullMesh", "Address already in use", "RendezvousConnectionError")


def run_job(impl: str, script: str, key: Optional[str], timeout: float) -> Dict[str, Any]:
    """Start one 2-process job (listing when ``key`` is None) and combine both ranks' reports;
    once more when it failed for a reason of the machine (:data:`_INFRA_ERRORS`).
    Returns ``{"ok", "error", "seen", "missing", "seconds", "started"}``."""
    result = _run_job(impl, script, key, timeout)
    if not result["ok"] and any(e in (result["error"] or "") + result.get("log_tail", "") for e in _INFRA_ERRORS):
        result = _run_job(impl, script, key, timeout)
    return result


def _run_job(impl: str, script: str, key: Optional[str], timeout: float) -> Dict[str, Any]:
    out = tempfile.mkdtemp(prefix="accel-compat-")
    args = [impl, script, out] + ([key] if key else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    if impl == "accelerate":
        env["ACCELERATE_USE_CPU"] = "1"  # what `accelerate launch --cpu` sets; without it torchrun on CPU is "NO"
    start = time.perf_counter()
    log_path = os.path.join(out, "log.txt")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(_command(impl, args), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)  # the job's own session: the launcher and its workers
            proc.wait()
    ranks = []
    for r in range(2):
        path = os.path.join(out, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                ranks.append(json.load(f))
    with open(log_path, errors="replace") as f:
        log_tail = f.read()[-3000:]
    shutil.rmtree(out, ignore_errors=True)
    result: Dict[str, Any] = {"seconds": round(time.perf_counter() - start, 1),
                              "seen": ranks[0]["seen"] if ranks else [],
                              "missing": sorted({m for r in ranks for m in r.get("missing", [])}),
                              "started": bool(ranks) and all(r.get("started") for r in ranks)}
    errors = [f"rank {r['rank']}: {r['error']}" for r in ranks if not r["ok"]]
    if len(ranks) < 2:
        errors.append(f"timeout after {timeout:.0f} s" if timed_out else
                      f"a rank wrote no report (exit code {proc.returncode}): {_last_line(log_tail)}")
    result["ok"] = not errors
    result["error"] = errors[0] if errors else None
    if errors:
        result["log_tail"] = log_tail
        result["traceback"] = next((r.get("traceback") for r in ranks if not r["ok"]), None)
    return result


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "(no output)"


def run_script(impl: str, script: str, timeout: float, jobs: int, keys: Optional[List[str]] = None,
               progress: Any = None) -> Dict[str, Any]:
    """List the script's calls (or take ``keys``: the baseline's), then run each in its own job."""
    listing = run_job(impl, script, None, timeout)
    seen = listing["seen"]
    keys = list(keys) if keys is not None else seen
    report: Dict[str, Any] = {"started": listing["started"], "listing_error": listing["error"],
                              "missing": listing["missing"], "calls": {}}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {key: pool.submit(run_job, impl, script, key, timeout) for key in keys}
        for key in keys:
            res = futures[key].result()
            entry = {"ok": res["ok"], "seconds": res["seconds"]}
            if not res["ok"]:
                entry["error"] = res["error"]
                if os.environ.get("ACCEL_COMPAT_VERBOSE"):
                    entry["traceback"] = res.get("traceback") or res.get("log_tail")
            report["calls"][key] = entry
            if progress:
                progress(f"{impl} {script} {key}: {'ok' if res['ok'] else res['error']} ({res['seconds']} s)")
    return report


def run_all(impl: str, timeout: float = 90.0, jobs: int = 2, scripts=SCRIPTS, baseline: Optional[dict] = None,
            progress: Any = None) -> Dict[str, Any]:
    """Every script's report; with ``baseline`` the calls run are the ones Accelerate made."""
    results = {}
    for script in scripts:
        keys = list(baseline["scripts"][script]["calls"]) if baseline else None
        results[script] = run_script(impl, script, timeout, jobs, keys=keys, progress=progress)
    return {"impl": impl, "scripts": results}


def load_baseline() -> Dict[str, Any]:
    with open(BASELINE) as f:
        return json.load(f)


def table(baseline: Dict[str, Any], ours: Dict[str, Any]) -> str:
    """A Markdown table: per script, calls, passed by Accelerate, passed by anyaccel, failures."""
    rows = ["| script | starts | test calls | Accelerate passes | anyaccel passes (of those) | anyaccel fails |",
            "|---|---|---|---|---|---|"]
    total = passed_acc = passed_both = 0
    failures = []
    for script, base in baseline["scripts"].items():
        mine = ours["scripts"].get(script)
        if mine is None:
            continue
        acc_ok = [k for k, v in base["calls"].items() if v["ok"]]
        both = [k for k in acc_ok if mine["calls"].get(k, {}).get("ok")]
        failed = [k for k in acc_ok if not mine["calls"].get(k, {}).get("ok")]
        total += len(base["calls"])
        passed_acc += len(acc_ok)
        passed_both += len(both)
        rows.append(f"| `{script}` | {'yes' if mine['started'] else 'no'} | {len(base['calls'])} | {len(acc_ok)} | "
                    f"{len(both)} | {len(failed)} |")
        for k in failed:
            failures.append(f"- `{script}` `{k}`: {mine['calls'].get(k, {}).get('error', 'not run')}")
    pct = 100.0 * passed_both / passed_acc if passed_acc else 0.0
    rows.append(f"| **total** | | {total} | {passed_acc} | {passed_both} ({pct:.0f} %) | {passed_acc - passed_both} |")
    return "\n".join(rows + ([""] + failures if failures else []))


def summary(baseline: Dict[str, Any], ours: Dict[str, Any]) -> Dict[str, Any]:
    acc_ok = [(s, k) for s, b in baseline["scripts"].items() if s in ours["scripts"]
              for k, v in b["calls"].items() if v["ok"]]
    both = [(s, k) for s, k in acc_ok if ours["scripts"][s]["calls"].get(k, {}).get("ok")]
    return {"accelerate_passes": len(acc_ok), "anyaccel_passes": len(both),
            "ratio": len(both) / len(acc_ok) if acc_ok else 0.0}
