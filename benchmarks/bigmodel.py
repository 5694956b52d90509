"""Big-model loading: peak host memory per process and time to first step while a model of S
bytes is loaded from one safetensors file into FSDP2 shards over N CPU processes (N = 2 and 4).

Contenders (benchmarks/bigmodel_worker.py): anyaccel (init_empty_weights -> prepare ->
load_checkpoint_in_model, each rank reading only its rows), anyaccel with rank 0 reading and
broadcasting (``broadcast_from_rank0=True``), raw PyTorch (every rank builds the model and reads the
whole file, then fully_shard) and Accelerate's ``cpu_ram_efficient_loading`` path (rank 0 reads the
file, ``fsdp2_load_full_state_dict`` broadcasts; called directly, because Accelerate only selects
FSDP on GPU-like devices).

What is proved, per run: every rank's shards equal the file's rows (read back after loading), and
the bytes of parameter shards each rank holds (about S/N). Memory is the resident-set high-water
mark (VmHWM) after loading minus the resident set before it, with one-off imports done beforehand;
the bound checked is ``S/N + largest tensor + 64 MiB`` for anyaccel.

    python -m benchmarks --only bigmodel
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import List

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bigmodel_worker.py")
CONSTANT = 64 * 2**20  # the stated constant of the bound (allocator slack, gloo buffers, page tables)
METHODS = ("raw", "accelerate", "anyaccel-broadcast", "anyaccel")
# Freed large tensors go back to the OS (see benchmarks/sharding.py): the high-water mark then
# measures tensors alive at the peak, not glibc's history.
_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}


def _checkpoint(folder: str, width: int, layers: int) -> str:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    state = {}
    for i in range(layers):
        state[f"layers.{i}.weight"] = torch.randn(width, width, generator=g)
        state[f"layers.{i}.bias"] = torch.randn(width, generator=g)
    path = os.path.join(folder, "model.safetensors")
    save_file(state, path)
    return path


def _run(method: str, nproc: int, path: str, width: int, layers: int, folder: str) -> List[dict]:
    out = tempfile.mkdtemp(dir=folder)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", "--max-restarts", "0", WORKER, "--method", method, "--checkpoint", path,
           "--width", str(width), "--layers", str(layers), "--out", out]
    env = common.bench_env()
    env.update(_ENV)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=common.REPO)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "Error" in ln or "error:" in ln]
        raise RuntimeError(" | ".join(lines[:3])[-400:] or (proc.stdout + proc.stderr)[-400:])
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(nproc)]


def run(quick: bool = False) -> List[dict]:
    width, layers = (1024, 8) if quick else (2048, 16)
    size = layers * (width * width + width) * 4
    largest = width * width * 4
    rows: List[dict] = []
    folder = tempfile.mkdtemp(prefix="anyaccel-bench-bigmodel-")
    try:
        path = _checkpoint(folder, width, layers)
        for nproc in (2, 4):
            name = f"load {size / 2**20:.0f} MiB into FSDP2, {nproc} CPU procs"
            results = {}
            for method in METHODS:
                try:
                    results[method] = _run(method, nproc, path, width, layers, folder)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    rows.append(common.skip_row("bigmodel", name, method, f"failed: {exc}"[:300]))
            rows += _rows(name, results, size, largest, nproc)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def _rows(name: str, results: dict, size: int, largest: int, nproc: int) -> List[dict]:
    rows = []
    raw = results.get("raw")
    raw_peak = max(r["hwm_after_load"] - r["rss_before"] for r in raw) if raw else None
    bound = size / nproc + largest + CONSTANT
    for method, ranks in results.items():
        peak = max(r["hwm_after_load"] - r["rss_before"] for r in ranks)
        held = [r["held_param_bytes"] / 2**20 for r in ranks]
        step = max(r["first_step_s"] for r in ranks)
        ok = all(r["weights_match"] for r in ranks)
        peaks = ", ".join(f"{(r['hwm_after_load'] - r['rss_before']) / 2**20:.0f}" for r in ranks)
        note = (f"shards held per rank {', '.join(f'{h:.0f}' for h in held)} MiB; weights match file: {ok}; "
                f"time to first step {step:.2f} s; per-rank peaks "
                f"{peaks} MiB")
        if method.startswith("anyaccel"):
            note += f"; bound S/N+largest+64MiB = {bound / 2**20:.0f} MiB: {'met' if peak <= bound else 'NOT met'}"
        base = method == "raw"
        rows.append(common.row("bigmodel", name, method, peak / 2**20, "MiB peak RSS over baseline (max rank)",
                               ratio=None if base or not raw_peak else peak / raw_peak,
                               baseline=None if base else "raw (full model per process)",
                               target="<= 1.0 (of S/N + largest + 64 MiB)" if method.startswith("anyaccel") else None,
                               judged=peak / bound if method.startswith("anyaccel") else None, note=note))
    return rows


if __name__ == "__main__":
    for r in run("--quick" in sys.argv):
        print(json.dumps(r))
