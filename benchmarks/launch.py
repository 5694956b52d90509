"""Launch latency: 2 CPU processes from the command line to their first collective, and to exit.

Every launcher runs a probe script that joins a 2-process gloo group, all-reduces a one, and
(rank 0) writes the wall-clock time right after that first collective. The parent records the
time just before starting the launcher and after it exits. Launchers rotate every round; medians
and the median of per-round differences to ``torchrun`` are reported (target: ``anyaccel launch``
within +0.2 s of torchrun to the first collective).

* ``torchrun``                 ``python -m torch.distributed.run --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint localhost:0``
* ``anyaccel launch``          ``anyaccel launch --num_processes 2 --cpu`` with the plain-torch probe, and with
                               a probe that uses ``Accelerator()`` (what an anyaccel user runs)
* ``accelerate launch``        ``--cpu --num_processes 2`` (Accelerate 1.15 starts one process there: the row says so),
                               and ``--multi_gpu --num_processes 2`` (what starts 2 CPU processes)
* ``fabric run``               ``--accelerator cpu --devices 2 --strategy ddp``

The notebook launchers are measured the same way in :mod:`benchmarks.notebook`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

TARGET = "<= +0.2 s"

PROBE = r'''
import json, os, sys, time
mode, out = sys.argv[1], sys.argv[2]
import torch
if mode == "raw":
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    rank = dist.get_rank()
elif mode == "anyaccel":
    from anyaccel import Accelerator
    acc = Accelerator()
    t = acc.reduce(torch.ones(1))
    rank = acc.process_index
elif mode == "accelerate":
    from accelerate import Accelerator
    acc = Accelerator(cpu=True)
    t = acc.reduce(torch.ones(1))
    rank = acc.process_index
elif mode == "fabric":
    from lightning.fabric import Fabric
    fabric = Fabric()  # under `fabric run` this already joined the group (launch() is refused)
    if not os.environ.get("LT_CLI_USED"):
        fabric.launch()
    t = fabric.all_reduce(torch.ones(1), reduce_op="sum")
    rank = fabric.global_rank
stamp = time.time()
if rank == 0:
    with open(out + ".tmp", "w") as f:
        json.dump({"t": stamp, "sum": float(t.reshape(-1)[0]), "pid": os.getpid()}, f)
    os.replace(out + ".tmp", out)
if mode == "raw":
    dist.destroy_process_group()
'''


def _bin(name: str) -> str:
    """A console script of this virtual environment (next to the interpreter)."""
    path = os.path.join(os.path.dirname(common.PYTHON), name)
    return path if os.path.exists(path) else name


def launchers() -> Dict[str, Dict]:
    """name -> {"cmd": prefix argv, "mode": probe mode, "needs": module}."""
    py = common.PYTHON
    return {
        "torchrun": {"cmd": [py, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
                             "--rdzv-endpoint", "localhost:0"], "mode": "raw"},
        "anyaccel launch (torch probe)": {"cmd": [_bin("anyaccel"), "launch", "--num_processes", "2", "--cpu"],
                                          "mode": "raw"},
        "anyaccel launch (Accelerator probe)": {"cmd": [_bin("anyaccel"), "launch", "--num_processes", "2", "--cpu"],
                                                "mode": "anyaccel"},
        "accelerate launch --cpu": {"cmd": [_bin("accelerate"), "launch", "--cpu", "--num_processes", "2",
                                            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"],
                                    "mode": "accelerate", "needs": "accelerate", "port": "--main_process_port"},
        "accelerate launch --multi_gpu": {"cmd": [_bin("accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
                                                  "--num_machines", "1", "--mixed_precision", "no",
                                                  "--dynamo_backend", "no"],
                                          "mode": "accelerate", "needs": "accelerate", "port": "--main_process_port"},
        "fabric run": {"cmd": [_bin("fabric"), "run", "--accelerator", "cpu", "--devices", "2", "--strategy", "ddp"],
                       "mode": "fabric", "needs": "lightning", "port": "--main-port"},
    }


def launch_once(spec: Dict, probe: str, timeout: float = 120) -> Dict:
    """Run one launch; returns {"first": s, "exit": s, "world_ok": bool} or {"error": text}."""
    tmp = tempfile.mkdtemp(prefix="anyaccel-launch-")
    out = os.path.join(tmp, "stamp.json")
    cmd = list(spec["cmd"])
    if spec.get("port"):
        cmd += [spec["port"], str(common.free_port())]
    cmd += [probe, spec["mode"], out]
    env = common.bench_env()
    try:
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)
        t_exit = time.time()
        if not os.path.exists(out):
            tail = (proc.stdout + proc.stderr).strip()[-600:]
            return {"error": f"rc {proc.returncode}, no collective reached: {tail}"}
        with open(out) as f:
            stamp = json.load(f)
        return {"first": stamp["t"] - t0, "exit": t_exit - t0, "world_ok": stamp["sum"] == 2.0,
                "rc": proc.returncode}
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(quick: bool = False, only: Optional[List[str]] = None) -> List[dict]:
    rows: List[dict] = []
    tmp = tempfile.mkdtemp(prefix="anyaccel-probe-")
    probe = os.path.join(tmp, "probe.py")
    with open(probe, "w") as f:
        f.write(PROBE)
    try:
        specs = {k: v for k, v in launchers().items() if not only or k in only or k == "torchrun"}
        usable: Dict[str, Dict] = {}
        notes: Dict[str, str] = {}
        for name, spec in specs.items():
            if spec.get("needs") and not common.have(spec["needs"]):
                rows.append(common.skip_row("launch", "2 CPU processes", name, f"{spec['needs']} not installed"))
                continue
            first = launch_once(spec, probe)  # also the warm-up (page cache)
            if "error" in first:
                why = "not available: " + first["error"]
                rows.append(common.skip_row("launch", "2 CPU processes", name, why[:300],
                                            target=TARGET if name.startswith("anyaccel") else None))
                continue
            if not first["world_ok"]:
                notes[name] = "started ONE process (no 2-process group formed)"
            usable[name] = spec
        samples: Dict[str, List[Dict]] = {n: [] for n in usable}
        names = list(usable)
        rounds = 1 if quick else 7
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                samples[name].append(launch_once(usable[name], probe))
        base = samples.get("torchrun", [])
        base_good = [b["first"] for b in base if "error" not in b]
        base_first = common.median(base_good) if base_good else None
        for name in names:
            good = [s for s in samples[name] if "error" not in s]
            if not good:
                rows.append(common.skip_row("launch", "2 CPU processes", name,
                                            "failed: " + samples[name][0].get("error", "")[:300]))
                continue
            first = common.median(s["first"] for s in good)
            exit_ = common.median(s["exit"] for s in good)
            deltas = [s["first"] - b["first"] for s, b in zip(samples[name], base) if "error" not in s and "error" not in b]
            delta = common.median(deltas) if name != "torchrun" and deltas else None
            note = notes.get(name, "")
            note = (note + "; " if note else "") + f"to exit {exit_:.2f} s"
            if delta is not None:
                note += f"; +{delta:.2f} s vs torchrun" if delta >= 0 else f"; {delta:.2f} s vs torchrun"
            failures = len(samples[name]) - len(good)
            if failures:
                note += f"; {failures} of {len(samples[name])} runs failed"
            target = TARGET if name.startswith("anyaccel launch (torch") else None
            rows.append(common.row("launch", "2 CPU processes to first collective", name, first, "s",
                                   ratio=first / base_first if base_first and name != "torchrun" else None,
                                   baseline=None if name == "torchrun" else "torchrun", target=target,
                                   judged=delta, note=note))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


if __name__ == "__main__":
    common.print_table(run(quick="--quick" in sys.argv))
