#!/usr/bin/env python
"""Check FSDP2 and torch.compile through anyaccel on a machine with (at least) one NVIDIA GPU.

    python tests/gpu/check_fsdp.py              # every check; exit 1 if any FAILs
    OUT=/some/dir python tests/gpu/check_fsdp.py   # also writes /some/dir/fsdp_check.json
    python tests/gpu/check_fsdp.py --self-test-cpu # the same logic on the CPU (tests the script)

Each check runs in a fresh interpreter and prints ``PASS|FAIL|SKIP <name>: <detail>``. With one
GPU, FSDP2 runs over a group of one process (nothing is sharded, but the CUDA mesh, the
mixed-precision policy, CPU offload with its gloo+nccl group, sharded checkpoints and ``save_model``
all run for real); with two or more GPUs the checks also run 2 processes through ``anyaccel launch``.

Checks:
* ``fsdp_bf16``        FSDP2 on cuda, bf16 policy: trains, parameters are DTensors on cuda, the
                       loss follows a DDP-free reference within bf16 tolerance, save_state /
                       load_state round trip, save_model loads into a plain module.
* ``fsdp_offload``     cpu_offload=True: shards live in host memory, the step runs on the GPU.
* ``fsdp_two_gpus``    (2+ GPUs) 2 processes on NCCL: each holds half the parameters; matches DDP.
* ``compile_cuda``     Accelerator(dynamo_backend="inductor") on cuda: same loss as eager; step time
                       compiled / eager for a small transformer (the figure goes into the JSON).
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


class Skip(Exception):
    """The check cannot run here."""


def _device() -> str:
    return "cpu" if SELF_TEST else "cuda"


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(message)


def _net():
    import torch

    class Block(torch.nn.Module):
        def __init__(self, width: int = 256):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(32, 256)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(4))
            self.out = torch.nn.Linear(256, 1)

        def forward(self, x):
            h = self.inp(x)
            for block in self.blocks:
                h = block(h)
            return self.out(h)

    return Net


def _data(n: int = 512):
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    return torch.utils.data.TensorDataset(x, x @ torch.randn(32, 1, generator=g) / 4)


def _train(acc, model, opt, loader, epochs: int = 2):
    import torch

    losses = []
    for _ in range(epochs):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
    return losses


def _fsdp_run(**plugin_kwargs):
    import torch

    from anyaccel import Accelerator
    from anyaccel.plugins import FullyShardedDataParallelPlugin

    Net = _net()
    kwargs = dict(cpu=True) if SELF_TEST else {}
    plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"], **plugin_kwargs)
    acc = Accelerator(fsdp_plugin=plugin, mixed_precision="bf16", **kwargs)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(_data(), batch_size=32, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    return acc, model, opt, loader


def check_fsdp_bf16() -> str:
    import torch

    from anyaccel import Accelerator

    acc, model, opt, loader = _fsdp_run()
    kinds = {type(p).__name__ for p in model.parameters()}
    devices = {p.to_local().device.type for p in model.parameters()}
    _expect(kinds == {"DTensor"} and devices == {_device()}, f"parameters are {kinds} on {devices}")
    losses = _train(acc, model, opt, loader)
    # reference: no FSDP, the same precision
    ref = Accelerator(mixed_precision="bf16", **(dict(cpu=True) if SELF_TEST else {}))
    torch.manual_seed(0)
    plain = _net()()
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    ploader = torch.utils.data.DataLoader(_data(), batch_size=32, shuffle=True)
    plain, popt, ploader = ref.prepare(plain, popt, ploader)
    ref_losses = _train(ref, plain, popt, ploader)
    _expect(losses[-1] < 0.5 * losses[0], f"FSDP did not train: {losses[0]:.4f} -> {losses[-1]:.4f}")
    drift = max(abs(a - b) / max(abs(b), 1e-3) for a, b in zip(losses, ref_losses))
    _expect(drift < 0.1, f"FSDP losses drift from the unsharded run by {drift:.3f} (relative)")
    with tempfile.TemporaryDirectory() as tmp:
        acc.save_state(os.path.join(tmp, "state"))
        before = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
        _train(acc, model, opt, loader, epochs=1)
        acc.load_state(os.path.join(tmp, "state"))
        after = acc.get_state_dict(model)
        _expect(all(torch.equal(before[k], after[k]) for k in before), "load_state did not restore the weights")
        acc.save_model(model, os.path.join(tmp, "model"))
        from safetensors.torch import load_file

        fresh = _net()()
        fresh.load_state_dict(load_file(os.path.join(tmp, "model", "model.safetensors")))
    return f"bf16 FSDP2 on {_device()}: loss {losses[0]:.4f} -> {losses[-1]:.4f} (unsharded {ref_losses[-1]:.4f}), " \
           f"checkpoint round trip exact, save_model loads into a plain module"


def check_fsdp_offload() -> str:
    if SELF_TEST:
        raise Skip("CPU offload is for GPU training (on the CPU it is refused with a clear error)")
    acc, model, opt, loader = _fsdp_run(cpu_offload=True)
    devices = {p.to_local().device.type for p in model.parameters()}
    _expect(devices == {"cpu"}, f"offloaded shards live on {devices}, expected the host")
    losses = _train(acc, model, opt, loader, epochs=1)
    _expect(losses[-1] < losses[0], f"did not train with offload: {losses[0]:.4f} -> {losses[-1]:.4f}")
    import torch.distributed as dist

    return (f"shards in host memory, step on the GPU, group backends {dist.get_backend_config()!r}: "
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")


def check_fsdp_two_gpus() -> str:
    import torch

    if SELF_TEST:
        raise Skip("covered on the CPU by tests/strategies/fsdp/test_fsdp_multiprocess.py (2 real processes)")
    if torch.cuda.device_count() < 2:
        raise Skip(f"{torch.cuda.device_count()} GPU visible; 2 processes on NCCL need 2 GPUs")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "anyaccel.cli", "launch", "--num_processes", "2",
               os.path.join(ROOT, "tests", "strategies", "fsdp", "fsdp_checks.py"), tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        _expect(proc.returncode == 0, f"2-GPU FSDP run failed: {proc.stderr[-1500:]}")
        res = json.load(open(os.path.join(tmp, "rank0.json")))
    _expect(res["max_weight_diff"] < 1e-5, f"FSDP vs DDP weights differ by {res['max_weight_diff']}")
    _expect(res["resume_bitwise"], "mid-epoch resume is not bitwise")
    return f"2 GPUs: FSDP vs DDP max weight diff {res['max_weight_diff']:.2e}, bytes per rank {res['bytes']}"


def check_compile_cuda() -> str:
    import torch

    from anyaccel import Accelerator

    kwargs = dict(cpu=True) if SELF_TEST else {}
    results = {}
    for backend in (None, "inductor"):
        acc = Accelerator(dynamo_backend=backend, mixed_precision="bf16", **kwargs)
        torch.manual_seed(0)
        width, layers = (64, 1) if SELF_TEST else (256, 4)  # on a CPU inductor's C++ build of 4 layers takes minutes
        model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(width, 8, 4 * width, batch_first=True,
                                                                             dropout=0.0), layers,
                                            enable_nested_tensor=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = acc.prepare(model, opt)
        x = torch.randn(32, 64, width, device=acc.device, generator=None)
        losses, times = [], []
        for step in range(25 if not SELF_TEST else 8):
            if acc.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = model(x).float().square().mean()
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            if acc.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
        results[backend or "eager"] = {"first_loss": losses[0], "step_s": sorted(times[5:])[len(times[5:]) // 2],
                                       "first_step_s": times[0]}
    eager, compiled = results["eager"], results["inductor"]
    _expect(abs(eager["first_loss"] - compiled["first_loss"]) <= 0.02 * abs(eager["first_loss"]) + 1e-3,
            f"compiled first loss {compiled['first_loss']} vs eager {eager['first_loss']}")
    ratio = compiled["step_s"] / eager["step_s"]
    return (f"inductor on {_device()}: step {compiled['step_s'] * 1e3:.2f} ms vs eager {eager['step_s'] * 1e3:.2f} ms "
            f"(ratio {ratio:.2f}, speed-up {1 / ratio:.2f}x), first compiled step {compiled['first_step_s']:.1f} s")


CHECKS = {"fsdp_bf16": check_fsdp_bf16, "fsdp_offload": check_fsdp_offload, "fsdp_two_gpus": check_fsdp_two_gpus,
          "compile_cuda": check_compile_cuda}


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
    return {"name": name, "status": status, "detail": detail, "seconds": round(time.time() - start, 2)}


def _run_isolated(name: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", name], capture_output=True,
                              text=True, timeout=900, env=env)
    except subprocess.TimeoutExpired:
        return {"name": name, "status": "FAIL", "detail": "timed out after 900 s", "seconds": 900}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("@@RESULT "):
            return json.loads(line[len("@@RESULT "):])
    return {"name": name, "status": "FAIL", "seconds": None,
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

    results = []
    if not SELF_TEST and not torch.cuda.is_available():
        results = [{"name": n, "status": "SKIP", "detail": "no CUDA device visible", "seconds": 0} for n in names]
    else:
        results = [_run_isolated(n) for n in names]
    for r in results:
        print(f"{r['status']} {r['name']}: {r['detail']}  ({r['seconds']} s)", flush=True)
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    print(f"summary: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "fsdp_check.json"), "w") as fh:
            json.dump({"torch": torch.__version__, "results": results, "counts": counts}, fh, indent=2)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main(sys.argv[1:]))
