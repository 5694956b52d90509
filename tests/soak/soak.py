"""The soak: run the canonical shapes of a user's script (tests/soak/soak_job.py) many times,
each a fresh job through the public launch path, and count the runs that hang, fail or leave a
process behind.

    python tests/soak/soak.py [--runs 200] [--shapes ddp,fsdp,...] [--parallel 2] [--bound 90]

``make soak`` runs it 200 times per shape; ``tests/soak/test_soak_multiprocess.py`` 20 times within
``make test``. Prints one line per shape (runs, ok, hangs, failures, survivors) and exits 1 when
any run hung, failed or left a survivor.

* A run is ``anyaccel launch --num_processes N --cpu soak_job.py SHAPE DIR`` (``python soak_job.py
  notebook DIR`` for the notebook shape) in a session of its own. It passes when it exits 0 within
  ``--bound`` seconds with every rank's ``soak-ok`` line. A run still going after the bound is a
  hang: its process tree is SIGKILLed (and its stacks printed first when ``py-spy`` is installed),
  so a hang costs the bound, not the test's timeout.
* Survivors: every process of a run carries a token in its environment (forked DataLoader
  workers inherit it). Once the run's top process has exited, a process that still carries the
  token a few seconds later is a survivor, and is killed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
ROOT = TESTS.parent
JOB = HERE / "soak_job.py"
CONSOLE = "import sys; from anyaccel.cli import main; sys.exit(main())"

#: shape -> processes (the notebook shape forks its 2 from a plain python process; ftkill's 2 are 2
#: replica groups of 1 process, and its "rank" in the soak-ok line is the group)
SHAPES: Dict[str, int] = {"ddp": 2, "fsdp": 2, "tpfsdp": 4, "workers": 2, "twice": 2, "notebook": 2, "canonical": 2,
                          "ftkill": 2}
#: the launch flags a shape needs besides ``--num_processes N --cpu``
FLAGS: Dict[str, List[str]] = {"ftkill": ["--fault_tolerance", "on", "--max_restarts", "1"]}
#: the least per-run bound a shape gets, whatever ``--bound`` says: ftkill starts 3 interpreters one
#: after the other (2 groups, then the killed one's restart) and waits out the Lighthouse's 3 s
#: heartbeat timeout (34 CPU-s a run; 126 to 287 s of wall time at load average 5 to 12 on the shared
#: 2-core machine, and past 300 s under `nice -n 19` beside a CI run: each start starved in `import torch`)
MIN_BOUND: Dict[str, float] = {"ftkill": 600.0}
#: what ``make soak`` runs by default: each shape on its own, so a count names its shape (ftkill
#: where torchft, the ``ft`` extra, is installed)
SEPARATE = ("ddp", "fsdp", "tpfsdp", "workers", "twice", "notebook") + \
    (("ftkill",) if importlib.util.find_spec("torchft") is not None else ())
#: what ``make test`` runs (tests/soak/test_soak_multiprocess.py): the same shapes in two jobs, for
#: time — ``canonical`` is ``fsdp`` + ``tpfsdp`` (on a 1 x 2 mesh) + ``workers`` + ``twice`` + ``ddp``
#: in one job of 2 processes (a fresh process costs seconds of CPU in imports: one job of 2 costs
#: about half a job of 4)
CI = ("canonical", "notebook")
TOKEN = "SOAK_RUN_TOKEN"
#: seconds a run's processes get to be gone after its top process exited
SURVIVOR_GRACE = 5.0


@dataclasses.dataclass
class Run:
    shape: str
    status: str  # ok | hang | failed
    seconds: float
    survivors: List[str]
    detail: str = ""


@dataclasses.dataclass
class Counts:
    runs: int = 0
    ok: int = 0
    hangs: int = 0
    failures: int = 0
    survivors: int = 0
    slowest: float = 0.0
    details: List[str] = dataclasses.field(default_factory=list)

    def add(self, run: Run) -> None:
        self.runs += 1
        self.ok += run.status == "ok"
        self.hangs += run.status == "hang"
        self.failures += run.status == "failed"
        self.survivors += len(run.survivors)
        self.slowest = max(self.slowest, run.seconds)
        if run.status != "ok" or run.survivors:
            self.details.append(f"{run.status} after {run.seconds:.1f} s; survivors {run.survivors}\n{run.detail}")


def _env(token: str) -> Dict[str, str]:
    launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                     "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items()
           if k not in launcher_vars and not k.startswith(("SLURM_", "OMPI_", "PMI_", "ANYACCEL_"))}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("SOAK_PYTHONPATH") or str(ROOT),
                                                    env.get("PYTHONPATH", "")) if p)
    env[TOKEN] = token
    return env


def _command(shape: str, workdir: str) -> List[str]:
    if shape == "notebook":
        return [sys.executable, str(JOB), shape, workdir]
    return [sys.executable, "-c", CONSOLE, "launch", "--num_processes", str(SHAPES[shape]), "--cpu",
            *FLAGS.get(shape, []), str(JOB), shape, workdir]


def carrying(token: str) -> List["psutil.Process"]:  # noqa: F821 - psutil is imported lazily
    """The live processes whose environment carries ``token``."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(TOKEN) == token and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _describe(procs: Sequence["psutil.Process"]) -> List[str]:  # noqa: F821
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except Exception:  # noqa: BLE001 - it went away meanwhile
            out.append(str(p.pid))
    return out


def _stacks(procs: Sequence["psutil.Process"]) -> str:  # noqa: F821
    """``py-spy dump`` of each process when py-spy is installed (a hang's evidence), else ''."""
    spy = shutil.which("py-spy") or (str(Path(sys.executable).parent / "py-spy")
                                     if (Path(sys.executable).parent / "py-spy").exists() else None)
    if spy is None:
        return ""
    text = []
    for p in procs:
        try:
            done = subprocess.run([spy, "dump", "--native", "--pid", str(p.pid)], capture_output=True, text=True,
                                  timeout=30)
            text.append(f"--- py-spy dump --native --pid {p.pid}\n{done.stdout[-6000:]}{done.stderr[-500:]}")
        except Exception as exc:  # noqa: BLE001
            text.append(f"--- py-spy on {p.pid}: {exc}")
    return "\n".join(text)


def _kill(procs: Sequence["psutil.Process"]) -> None:  # noqa: F821
    for p in procs:
        try:
            p.kill()
        except Exception:  # noqa: BLE001
            pass


def run_one(shape: str, bound: float, keep: Optional[str] = None) -> Run:
    """One fresh job of ``shape``; see the module docstring for what passes."""
    token = uuid.uuid4().hex
    workdir = tempfile.mkdtemp(prefix=f"soak-{shape}-")
    start = time.monotonic()
    proc = subprocess.Popen(_command(shape, workdir), env=_env(token), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=workdir)
    status, detail = "ok", ""
    try:
        output, _ = proc.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        status = "hang"
        stacks = _stacks(carrying(token))
        os.killpg(proc.pid, signal.SIGKILL)
        _kill(carrying(token))
        output, _ = proc.communicate()
        detail = stacks
    seconds = time.monotonic() - start
    if status == "ok":
        expected = SHAPES[shape]
        oks = sum(f"soak-ok {shape} rank {r}" in output for r in range(expected))
        if proc.returncode != 0 or oks != expected:
            status = "failed"
            detail = f"exit {proc.returncode}, {oks} of {expected} ranks said soak-ok"
    if status != "ok":
        detail = f"{detail}\n--- output (last 4000 characters)\n{output[-4000:]}"
    deadline = time.monotonic() + SURVIVOR_GRACE
    left = carrying(token)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = carrying(token)
    survivors = _describe(left)
    _kill(left)
    if keep is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return Run(shape, status, seconds, survivors, detail)


def soak(shapes: Sequence[str], runs: int, parallel: int = 2, bound: float = 90.0,
         progress: bool = False) -> Dict[str, Counts]:
    """Run every shape ``runs`` times (``parallel`` jobs at a time, interleaved); the counts per shape."""
    counts = {s: Counts() for s in shapes}
    order = [s for _ in range(runs) for s in shapes]
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = [pool.submit(run_one, s, max(bound, MIN_BOUND.get(s, 0.0))) for s in order]
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            run = future.result()
            counts[run.shape].add(run)
            if progress and (run.status != "ok" or run.survivors or done % 10 == 0):
                print(f"[{done}/{len(order)}] {run.shape}: {run.status} in {run.seconds:.1f} s"
                      f"{'; survivors ' + str(run.survivors) if run.survivors else ''}", flush=True)
    return counts


def table(counts: Dict[str, Counts]) -> str:
    lines = [f"{'shape':<10} {'runs':>5} {'ok':>5} {'hangs':>6} {'failed':>7} {'survivors':>10} {'slowest s':>10}"]
    for shape, c in counts.items():
        lines.append(f"{shape:<10} {c.runs:>5} {c.ok:>5} {c.hangs:>6} {c.failures:>7} {c.survivors:>10} "
                     f"{c.slowest:>10.1f}")
    return "\n".join(lines)


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="runs of each shape (default 200)")
    parser.add_argument("--shapes", default=",".join(SEPARATE),
                        help=f"comma-separated, from {', '.join(SHAPES)} (default: {', '.join(SEPARATE)}; "
                             f"make test runs {', '.join(CI)})")
    parser.add_argument("--parallel", type=int, default=2, help="jobs at a time (default 2)")
    parser.add_argument("--bound", type=float, default=90.0,
                        help=f"seconds after which a run is a hang (default 90; at least {MIN_BOUND} for those shapes)")
    args = parser.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    start = time.monotonic()
    cpu = _children_cpu()
    counts = soak(shapes, args.runs, args.parallel, args.bound, progress=True)
    print(table(counts))
    print(f"CPU time of the jobs: {_children_cpu() - cpu:.0f} s ({(_children_cpu() - cpu) / max(1, args.runs * len(shapes)):.1f} s "
          f"a run); load average now {os.getloadavg()[0]:.1f}")
    for shape, c in counts.items():
        for detail in c.details[:3]:
            print(f"--- {shape}: {detail}")
    bad = sum(c.hangs + c.failures + c.survivors for c in counts.values())
    print(f"soak: {sum(c.runs for c in counts.values())} runs in {time.monotonic() - start:.0f} s, "
          f"{sum(c.hangs for c in counts.values())} hangs, {sum(c.failures for c in counts.values())} failures, "
          f"{sum(c.survivors for c in counts.values())} survivors", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
