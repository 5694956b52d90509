"""Notebook launcher start-up: 2 CPU processes forked from an interactive session.

Each sample is a fresh interpreter playing the notebook kernel: it imports torch and the
framework (not timed), then times the launcher call -- from the call to rank 0's first
collective, and to the call's return. The function run in the workers joins the group the
framework's way and all-reduces a one; a sum of 1 instead of 2 means no 2-process group formed.

* ``torch.multiprocessing``  ``start_processes(fn, nprocs=2, start_method="fork")`` + ``init_process_group``
* ``anyaccel``               ``from anyaccel import notebook_launcher``; ``Accelerator()`` in the function
* ``accelerate``             ``accelerate.notebook_launcher`` (on a CPU-only box 1.15 runs separate rank-0 copies)
* ``fabric``                 ``Fabric(accelerator="cpu", devices=2, strategy="ddp_notebook").launch(fn)``
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

KERNEL = r'''
import json, os, socket, sys, time
mode, out, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
import torch
if mode.startswith("anyaccel"):
    from anyaccel import notebook_launcher, Accelerator

elif mode == "accelerate":
    from accelerate import notebook_launcher, Accelerator
elif mode == "fabric":
    from lightning.fabric import Fabric

def stamp(rank, value):
    t = time.time()
    if rank == 0:
        with open(out + ".tmp", "w") as f:
            json.dump({"t": t, "sum": float(value)}, f)
        os.replace(out + ".tmp", out)

def raw_fn(index):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=2)
    t = torch.ones(1)
    dist.all_reduce(t)
    stamp(dist.get_rank(), t.item())
    dist.destroy_process_group()

def acc_fn():
    acc = Accelerator() if mode.startswith("anyaccel") else Accelerator(cpu=True)
    t = acc.reduce(torch.ones(1))
    stamp(acc.process_index, t.reshape(-1)[0].item())

def fabric_fn(fabric):
    t = fabric.all_reduce(torch.ones(1), reduce_op="sum")
    stamp(fabric.global_rank, t.reshape(-1)[0].item())

t0 = time.time()
if mode == "raw":
    import torch.multiprocessing as mp
    mp.start_processes(raw_fn, nprocs=2, start_method="fork")
elif mode in ("anyaccel", "accelerate"):
    notebook_launcher(acc_fn, num_processes=2, **({"use_port": str(port)} if mode == "accelerate" else {}))
elif mode == "fabric":
    os.environ["MASTER_PORT"] = str(port)
    Fabric(accelerator="cpu", devices=2, strategy="ddp_notebook").launch(fabric_fn)
t1 = time.time()
with open(out) as f:
    s = json.load(f)
print(json.dumps({"first": s["t"] - t0, "total": t1 - t0, "sum": s["sum"]}))
'''

CONTENDERS = {"torch.multiprocessing": ("raw", None), "anyaccel": ("anyaccel", "anyaccel"),
              "accelerate": ("accelerate", "accelerate"), "fabric": ("fabric", "lightning")}


def _once(kernel: str, mode: str, timeout: float = 120) -> Dict:
    tmp = tempfile.mkdtemp(prefix="anyaccel-nb-")
    try:
        proc = subprocess.run([common.PYTHON, kernel, mode, os.path.join(tmp, "stamp.json"), str(common.free_port())],
                              capture_output=True, text=True, timeout=timeout, env=common.bench_env(), cwd=tmp)
        lines = [ln for ln in proc.stdout.strip().splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            return {"error": f"rc {proc.returncode}: " + (proc.stdout + proc.stderr).strip()[-400:]}
        return json.loads(lines[-1])
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(quick: bool = False) -> List[dict]:
    rows: List[dict] = []
    tmp = tempfile.mkdtemp(prefix="anyaccel-kernel-")
    kernel = os.path.join(tmp, "kernel.py")
    with open(kernel, "w") as f:
        f.write(KERNEL)
    name = "notebook launcher, 2 CPU processes, call to first collective"
    try:
        usable, notes = {}, {}
        for label, (mode, needs) in CONTENDERS.items():
            if needs and not common.have(needs):
                rows.append(common.skip_row("notebook", name, label, f"{needs} not installed"))
                continue
            first = _once(kernel, mode)
            if "error" in first:
                rows.append(common.skip_row("notebook", name, label, "not available: " + first["error"][:300]))
                continue
            if first["sum"] != 2.0:
                notes[label] = "NO 2-process group formed (each process ran alone as rank 0)"
            usable[label] = mode
        samples: Dict[str, List[Dict]] = {k: [] for k in usable}
        names = list(usable)
        for r in range(1 if quick else 7):
            for label in names[r % len(names):] + names[: r % len(names)]:
                samples[label].append(_once(kernel, usable[label]))
        base = [s["first"] for s in samples.get("torch.multiprocessing", []) if "error" not in s]
        base_first = common.median(base) if base else None
        for label in names:
            good = [s for s in samples[label] if "error" not in s]
            if not good:
                rows.append(common.skip_row("notebook", name, label, "failed: " + samples[label][0]["error"][:300]))
                continue
            first = common.median(s["first"] for s in good)
            note = notes.get(label, "")
            note = (note + "; " if note else "") + f"call returns after {common.median(s['total'] for s in good):.2f} s"
            if len(good) < len(samples[label]):
                note += f"; {len(samples[label]) - len(good)} of {len(samples[label])} runs failed"
            is_base = label == "torch.multiprocessing"
            rows.append(common.row("notebook", name, label, first, "s",
                                   ratio=None if is_base or not base_first else first / base_first,
                                   baseline=None if is_base else "torch.multiprocessing", note=note))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


if __name__ == "__main__":
    common.print_table(run(quick="--quick" in sys.argv))
