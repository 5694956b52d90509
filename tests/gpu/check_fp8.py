#!/usr/bin/env python
"""Check and measure fp8 training (torchao) through anyaccel on a machine with an NVIDIA GPU.

    python tests/gpu/check_fp8.py                  # every check; exit 1 if any FAILs
    OUT=/some/dir python tests/gpu/check_fp8.py    # also writes /some/dir/fp8_check.json
    python tests/gpu/check_fp8.py --self-test-cpu  # the same logic on the CPU, small and emulated (tests the script)

Each check runs in a fresh interpreter and prints ``PASS|FAIL|SKIP <name>: <detail>``.

Checks:
* ``fp8_blocks``  a Llama-style block stack (RMSNorm, attention through SDPA, SwiGLU MLP; no
                  embedding), compiled (``dynamo_backend="inductor"``), trained N steps on a fixed
                  regression task in bf16, fp8 tensorwise and fp8 rowwise: median step time, tokens/s,
                  peak memory and the loss after N steps of each, with fp8's speed-up over bf16. Passes
                  when every run trains, fp8 is not emulated (the GPU multiplies in fp8), and each fp8
                  loss after N steps is within 5 % of bf16's. Needs compute capability 8.9+ (else SKIP).
* ``fp8_fsdp``    FSDP2 with the fp8 all-gather on CUDA (a group of one process on one GPU; with 2+
                  GPUs, tests/training/fp8_checks.py's DDP / FSDP2 / checkpoint checks on 2 processes).
* ``fp8_te``      Transformer Engine, when installed: the same block stack trains under TERecipeKwargs.

The figures go into the JSON (``make gpu-check`` copies it into its results file), one row per
run: precision, recipe, ms per step, tokens/s, peak GiB, first and last loss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SELF_TEST = os.environ.get("ANYACCEL_CHECK_SELF_TEST") == "1"
#: block stack sizes: Llama-3-8B's layer shape on a GPU (where fp8 pays: large matmuls); tiny on the CPU
SIZES = (dict(dim=128, ffn=256, heads=4, blocks=2, batch=2, seq=32, steps=6, warmup=2) if SELF_TEST else
         dict(dim=4096, ffn=14336, heads=32, blocks=4, batch=4, seq=2048, steps=40, warmup=10))


class Skip(Exception):
    """The check cannot run here."""


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(message)


def _blocks():
    """The model: ``blocks`` Llama-style blocks over hidden states (dim), then a head to one output."""
    import torch

    class RMSNorm(torch.nn.Module):
        def __init__(self, dim: int):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(dim))

        def forward(self, x):
            return self.weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x)

    class Block(torch.nn.Module):
        def __init__(self, dim: int, ffn: int, heads: int):
            super().__init__()
            self.heads = heads
            self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
            self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))
            self.w1, self.w3 = torch.nn.Linear(dim, ffn, bias=False), torch.nn.Linear(dim, ffn, bias=False)
            self.w2 = torch.nn.Linear(ffn, dim, bias=False)

        def forward(self, x):
            b, s, d = x.shape
            h = self.attn_norm(x)
            q, k, v = (w(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.wo(a.transpose(1, 2).reshape(b, s, d))
            h = self.mlp_norm(x)
            return x + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))

    class Stack(torch.nn.Module):
        def __init__(self, dim: int, ffn: int, heads: int, blocks: int):
            super().__init__()
            self.inp = torch.nn.Linear(dim, dim, bias=False)  # first linear: kept in high precision
            self.layers = torch.nn.ModuleList(Block(dim, ffn, heads) for _ in range(blocks))
            self.norm = RMSNorm(dim)
            self.out = torch.nn.Linear(dim, dim, bias=False)  # last linear: kept in high precision

        def forward(self, x):
            h = self.inp(x)
            for layer in self.layers:
                h = layer(h)
            return self.out(self.norm(h))

    return Stack


def _measure(precision: str, recipe=None, te: bool = False, strategy=None) -> dict:
    """Train the block stack compiled for ``steps`` steps; the figures of one run."""
    import torch

    from anyaccel import Accelerator
    from anyaccel.precision_fp8 import report
    from anyaccel.utils import AORecipeKwargs, TERecipeKwargs

    z = SIZES
    handlers = [TERecipeKwargs()] if te else [AORecipeKwargs(recipe=recipe)] if recipe else None
    kwargs = dict(cpu=True, dynamo_backend="eager") if SELF_TEST else dict(dynamo_backend="inductor")
    acc = Accelerator(mixed_precision=precision, kwargs_handlers=handlers, strategy=strategy, **kwargs)
    torch.manual_seed(0)
    model = _blocks()(z["dim"], z["ffn"], z["heads"], z["blocks"])
    teacher = torch.nn.Linear(z["dim"], z["dim"], bias=False)  # the task: match a fixed random linear map
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(z["batch"], z["seq"], z["dim"], generator=g).to(acc.device) for _ in range(4)]
    with torch.no_grad():
        ys = [teacher.to(acc.device)(x) for x in xs]
    cuda = acc.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(acc.device)
    losses, times = [], []
    for step in range(z["steps"]):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(xs[step % 4]).float(), ys[step % 4])
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    timed = sorted(times[z["warmup"]:])
    step_s = timed[len(timed) // 2]
    found = report(model)
    peak = round(torch.cuda.max_memory_allocated(acc.device) / 2**30, 2) if cuda else None
    acc.free_memory()  # the next run of this process starts from an empty device (and no compiled graphs)
    del model, opt
    torch._dynamo.reset()
    if cuda:
        torch.cuda.empty_cache()
    return {"precision": precision, "recipe": "te" if te else (recipe or ("tensorwise" if precision == "fp8" else "-")),
            "strategy": strategy or "single", "ms_per_step": round(step_s * 1e3, 2),
            "tokens_per_s": round(z["batch"] * z["seq"] / step_s), "first_step_s": round(times[0], 1),
            "peak_gib": peak,
            "first_loss": losses[0], "last_loss": losses[-1], "steps": z["steps"],
            "fp8_layers": len(found.converted) if found else 0, "emulated": bool(found and found.emulated),
            "all_gather": found.fsdp_float8_all_gather if found else None}


def _fp8_gpu() -> None:
    import importlib.util

    import torch

    if importlib.util.find_spec("torchao") is None:
        raise Skip("torchao is not installed (pip install 'anyaccel[fp8]'; offline: PIP_FIND_LINKS=<dir with its wheel>)")
    if SELF_TEST:
        return
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        raise Skip(f"{torch.cuda.get_device_name()} has compute capability {major}.{minor}; fp8 matmuls need 8.9+")


ROWS: list = []


def check_fp8_blocks() -> str:
    _fp8_gpu()
    runs = [_measure("bf16"), _measure("fp8", "tensorwise"), _measure("fp8", "rowwise")]
    ROWS.extend(runs)
    bf16 = runs[0]
    for run in runs:
        _expect(run["last_loss"] < 0.9 * run["first_loss"], f"{run['recipe']} did not train: {run}")
    for run in runs[1:]:
        _expect(run["fp8_layers"] == 7 * SIZES["blocks"], f"{run['recipe']}: {run['fp8_layers']} fp8 layers")
        _expect(run["emulated"] == SELF_TEST, f"{run['recipe']}: emulated={run['emulated']} on this device")
        drift = abs(run["last_loss"] - bf16["last_loss"]) / bf16["last_loss"]
        _expect(drift < 0.05, f"{run['recipe']}: loss after {run['steps']} steps {run['last_loss']:.4f} vs bf16 "
                              f"{bf16['last_loss']:.4f} ({drift:.1%})")
    parts = [f"{r['precision']} {r['recipe']}".replace(" -", "") + f": {r['ms_per_step']} ms/step ({bf16['ms_per_step'] / r['ms_per_step']:.2f}x bf16), "
             f"{r['tokens_per_s']:,} tok/s, peak {r['peak_gib']} GiB, loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}"
             for r in runs]
    return "; ".join(parts)


def check_fp8_fsdp() -> str:
    import torch

    _fp8_gpu()
    run = _measure("fp8", "tensorwise", strategy="fsdp")
    ROWS.append(run)
    _expect(run["all_gather"] is True, f"FSDP2's fp8 all-gather is not on: {run}")
    _expect(run["last_loss"] < 0.9 * run["first_loss"], f"FSDP2 + fp8 did not train: {run}")
    detail = f"FSDP2 (one process), fp8 all-gather: {run['ms_per_step']} ms/step, loss {run['last_loss']:.4f}"
    if SELF_TEST or torch.cuda.device_count() < 2:
        return detail + " (2 processes: 1 GPU visible; tests/training/test_precision_fp8_multiprocess.py covers them on CPUs)"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "anyaccel.cli", "launch", "--num_processes", "2",
               os.path.join(ROOT, "tests", "training", "fp8_checks.py"), tmp, "two"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        _expect(proc.returncode == 0, f"2-GPU fp8 run failed: {proc.stderr[-1500:]}")
        res = json.load(open(os.path.join(tmp, "rank0.json")))
    _expect(res["checkpoints"]["bitwise"], "resume under FSDP2 + fp8 is not bitwise")
    return detail + f"; 2 GPUs: DDP weights vs one process {res['ddp']['max_weight_diff']:.1e}, FSDP2 " \
                    f"{res['fsdp']['max_weight_diff']:.1e}, resume bitwise"


def check_fp8_te() -> str:
    import importlib.util

    if SELF_TEST or importlib.util.find_spec("transformer_engine") is None:
        raise Skip("Transformer Engine is not installed (pip install 'transformer-engine[pytorch]')")
    _fp8_gpu()
    run = _measure("fp8", te=True)
    ROWS.append(run)
    _expect(run["last_loss"] < 0.9 * run["first_loss"], f"TE did not train: {run}")
    return f"Transformer Engine: {run['ms_per_step']} ms/step, loss {run['first_loss']:.4f} -> {run['last_loss']:.4f}"


CHECKS = {"fp8_blocks": check_fp8_blocks, "fp8_fsdp": check_fp8_fsdp, "fp8_te": check_fp8_te}


def _run_one(name: str) -> dict:
    start = time.time()
    try:
        status, detail = "PASS", CHECKS[name]()
    except Skip as e:
        status, detail = "SKIP", str(e)
    except AssertionError as e:
        status, detail = "FAIL", str(e) or traceback.format_exc(limit=3)
    except Exception as e:  # noqa: BLE001
        status, detail = "FAIL", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
    return {"name": name, "status": status, "detail": detail, "seconds": round(time.time() - start, 2), "rows": ROWS}


def _run_isolated(name: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", name], capture_output=True,
                              text=True, timeout=900, env=env)
    except subprocess.TimeoutExpired:
        return {"name": name, "status": "FAIL", "detail": "timed out after 900 s", "seconds": 900, "rows": []}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("@@RESULT "):
            return json.loads(line[len("@@RESULT "):])
    return {"name": name, "status": "FAIL", "seconds": None, "rows": [],
            "detail": f"check process exited {proc.returncode} without a result: {proc.stderr[-1500:]}"}


def main(argv) -> int:
    global SELF_TEST
    if "--one" in argv:
        print("@@RESULT " + json.dumps(_run_one(argv[argv.index("--one") + 1])), flush=True)
        return 0
    if "--self-test-cpu" in argv:
        os.environ["ANYACCEL_CHECK_SELF_TEST"] = "1"
        SELF_TEST = True
    names = [a for a in argv if not a.startswith("--")] or list(CHECKS)
    import torch

    if not SELF_TEST and not torch.cuda.is_available():
        results = [{"name": n, "status": "SKIP", "detail": "no CUDA device visible", "seconds": 0, "rows": []}
                   for n in names]
    else:
        results = [_run_isolated(n) for n in names]
    for r in results:
        print(f"{r['status']} {r['name']}: {r['detail']}  ({r['seconds']} s)", flush=True)
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    print(f"summary: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        device = torch.cuda.get_device_name() if torch.cuda.is_available() and not SELF_TEST else "cpu (self-test)"
        with open(os.path.join(os.environ["OUT"], "fp8_check.json"), "w") as fh:
            json.dump({"torch": torch.__version__, "device": device, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                          time.gmtime()),
                       "sizes": SIZES, "rows": [row for r in results for row in r.get("rows", [])],
                       "results": [{k: v for k, v in r.items() if k != "rows"} for r in results], "counts": counts},
                      fh, indent=2)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main(sys.argv[1:]))
