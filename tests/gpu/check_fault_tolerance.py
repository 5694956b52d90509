"""Per-step fault tolerance (torchft) on a CUDA machine: what the CPU tests cannot show. Run by
``GPU_CHECK_STEPS=fault make gpu-check`` (an extra step: not in the default run, which fills the
lent machine's time), or alone: ``python tests/gpu/check_fault_tolerance.py``.

1. **On the GPU** (``anyaccel launch --fault_tolerance on --num_processes 2 --max_restarts 1``, no
   ``--cpu``): 2 replica groups of one process, each given its own slice of the GPUs
   (``CUDA_VISIBLE_DEVICES``; with one GPU they share it in turn), training
   tests/fault_tolerance/ft_train.py on CUDA; every process of group 1 is SIGKILLed mid-epoch.
   Checked: the weights are on CUDA; group 0 commits a step alone within the bound; group 1 is
   restarted, heals in ``resume()`` from group 0 over the HTTP transfer (CUDA tensors serialised
   and loaded back onto its GPU), and from then on holds bitwise group 0's weights, learning rate,
   CPU and CUDA RNG states and loader position at every step.
2. **On the machine's CPUs** (``benchmarks/fault_tolerance.py --rounds 3 --layouts 2x1,2x2``): the
   step-time ratios of issue 41 item 5 on a machine with a core for every process and thread,
   which the 2-core development machine cannot give (4 processes sharing 2 cores double every
   millisecond of CPU a step adds). The rows are printed and written to ``$OUT/fault_tolerance_bench.txt``;
   a ratio over the target is reported (``NOTE``), not failed: a benchmark, not a timed test.

``GPU_CHECK_ON_CPU=1`` runs part 1 on the CPU (``--cpu``; the CUDA check skipped): how this script is
checked on a machine without a GPU. Prints ``PASS``/``FAIL``/``SKIP`` lines; exits 1 when a check failed. Needs torchft (the ``ft`` extra;
offline: ``make gpu-wheels`` here, carry ``.gpu-wheels``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FT_TRAIN = ROOT / "tests" / "fault_tolerance" / "ft_train.py"
#: seconds from the kill to the survivor's first step without the dead group, at most (the
#: Lighthouse's heartbeat timeout, 3 s, and slack), as the CPU test's bound
COMMIT_BOUND_S = 15.0
FAILED = []


def report(ok: bool, what: str, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {what}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILED.append(what)


def _records(out: Path, group: int) -> list:
    path = out / f"group_{group}_rank_0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _steps(records: list, pid=None) -> dict:
    return {r["committed"]: r for r in records if r["event"] == "step" and (pid is None or r["pid"] == pid)}


def on_the_gpu(cpu: bool = False) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = dict(os.environ, FT_OUT=str(out), FT_EPOCHS="8", FT_ALONE_SLEEP="0.3",
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        launcher = subprocess.Popen(
            [sys.executable, "-m", "anyaccel.cli", "launch", *(["--cpu"] if cpu else []), "--fault_tolerance", "on",
             "--num_processes", "2", "--max_restarts", "1", str(FT_TRAIN)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(ROOT))
        try:
            deadline = time.monotonic() + 240
            while len([r for r in _steps(_records(out, 1)).values() if r["participants"] == 2]) < 5:
                if launcher.poll() is not None or time.monotonic() > deadline:
                    report(False, "2 replica groups on the GPU trained together",
                           (launcher.stdout.read() if launcher.poll() is not None else "no 5 steps in 240 s")[-2000:])
                    return
                time.sleep(0.05)
            victim = _records(out, 1)[-1]["pid"]
            killed_at = time.time()
            os.kill(victim, signal.SIGKILL)
            output, _ = launcher.communicate(timeout=420)
        finally:
            if launcher.poll() is None:
                launcher.kill()
        report(launcher.returncode == 0, "the launch ended cleanly after the kill", f"exit {launcher.returncode}")
        print(output[-3000:])
        g0, g1 = _records(out, 0), _records(out, 1)
        devices = {r.get("device") for r in g0 + g1 if r["event"] == "start"}
        where = (f"devices {sorted(map(str, devices))}; CUDA_VISIBLE_DEVICES per group "
                 f"{sorted({str(r.get('visible')) for r in g0 + g1 if r['event'] == 'start'})}")
        if cpu:
            print(f"SKIP the groups trained on CUDA (GPU_CHECK_ON_CPU=1): {where}")
        else:
            report(bool(devices) and all(str(d).startswith("cuda") for d in devices), "the groups trained on CUDA", where)
        alone = [r for r in g0 if r["event"] == "step" and r["t"] > killed_at and r["stepped"] and r["participants"] == 1]
        commit_s = alone[0]["t"] - killed_at if alone else float("inf")
        report(commit_s < COMMIT_BOUND_S, "the survivor committed alone within the bound",
               f"{commit_s:.2f} s after the kill (bound {COMMIT_BOUND_S:g} s)")
        starts = [r for r in g1 if r["event"] == "start"]
        if len(starts) != 2 or not starts[1]["heals"]:
            report(False, "the killed group restarted and healed", json.dumps(starts)[-1500:])
            return
        restart, heal = starts[1], starts[1]["heals"][-1]
        report(bool(restart["resumed"]) and restart["resumed"].startswith("a live replica group"),
               "the killed group healed from the live one in resume()",
               f"{heal['bytes']:,} bytes in {heal['fetch_s']:.2f} s ({heal['total_s']:.2f} s with its quorum), "
               f"at step {heal['step']}")
        mine, theirs = _steps(g1, pid=restart["pid"]), _steps(g0)
        common = sorted(set(mine) & set(theirs))
        differ = [(s, k) for s in common for k in ("sha", "lr", "rng", "epoch", "position")
                  if mine[s][k] != theirs[s][k]]
        report(len(common) >= 10 and not differ, "bitwise equal weights, learning rate, RNG and loader position after the heal",
               f"{len(common)} common steps; first differences {differ[:3]}")


def on_the_cpus() -> None:
    bench = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fault_tolerance.py"), "--rounds", "3",
                            "--layouts", "2x1,2x2"], cwd=str(ROOT), capture_output=True, text=True, timeout=900,
                           env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    text = bench.stdout + bench.stderr
    print(text[-6000:])
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "fault_tolerance_bench.txt").write_text(text)
    report(bench.returncode == 0, f"the step-time benchmark ran on {os.cpu_count()} CPUs", f"exit {bench.returncode}")
    for line in text.splitlines():
        if "MISSED" in line:
            print("NOTE over the target (a benchmark: reported, not failed): " + " ".join(line.split())[:300])


def main() -> int:
    try:
        import torch
        import torchft  # noqa: F401
    except ImportError as exc:
        print(f"SKIP fault tolerance: {exc} (the ft extra: pip install torchft==0.2.0, offline from make gpu-wheels)")
        return 0
    if torch.cuda.is_available():
        on_the_gpu()
    elif os.environ.get("GPU_CHECK_ON_CPU") == "1":
        on_the_gpu(cpu=True)
    else:
        print("SKIP fault tolerance on the GPU: torch sees no CUDA device")
    on_the_cpus()
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
