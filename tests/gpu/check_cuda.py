#!/usr/bin/env python
"""Check anyaccel's CUDA path on a machine with (at least) one NVIDIA GPU.

Usage (from the repository root, with torch+CUDA and anyaccel installed)::

    python tests/gpu/check_cuda.py            # every check; exit 1 if any FAILs
    python tests/gpu/check_cuda.py placement fp16   # only these
    OUT=/some/dir python tests/gpu/check_cuda.py    # also writes /some/dir/cuda_check.json
    python tests/gpu/check_cuda.py --self-test-cpu  # run the same logic on the CPU (tests the script)

Each check runs in a fresh Python process (CUDA initialisation, RNG state and process groups
cannot leak from one to the next) and prints one line ``PASS|FAIL|SKIP <name>: <detail>``.
A missing piece of anyaccel (e.g. no ``notebook_launcher`` yet) is a SKIP with the reason, not a
FAIL. Exit status: 0 when nothing FAILed (``--strict``: and nothing was SKIPped), 1 otherwise.

Not collected by pytest (its name does not match ``test_*.py``); run by hand or by CI on a GPU
runner.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SELF_TEST = os.environ.get("ANYACCEL_CHECK_SELF_TEST") == "1"  # set by --self-test-cpu


class Skip(Exception):
    """A check cannot run here (missing piece of anyaccel or of the machine)."""


def _dev() -> str:
    """The device type the checks expect: ``cuda``, or ``cpu`` in the self-test."""
    return "cpu" if SELF_TEST else "cuda"


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(message)


def _accelerator(**kwargs):
    try:
        from anyaccel import Accelerator
    except ImportError as e:  # pragma: no cover - broken install
        raise Skip(f"cannot import anyaccel.Accelerator: {e}")
    if SELF_TEST:
        kwargs.setdefault("cpu", True)
    return Accelerator(**kwargs)


def _problem(n: int = 256, seed: int = 0):
    """A small, learnable regression problem (no downloads)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    y = x @ w + 0.01 * torch.randn(n, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def _record_dtype(module, seen: dict):
    """Forward hook on ``module`` storing its first output dtype in ``seen`` (returns the handle)."""

    def hook(_m, _inputs, output):
        seen.setdefault("dtype", output.dtype)  # returns None: the output is left untouched

    return module.register_forward_hook(hook)


def _train(accelerator, model, optimizer, loader, epochs: int = 3, scheduler=None):
    """Plain training loop; returns the mean loss of the first and of the last epoch."""
    import torch

    means = []
    for _ in range(epochs):
        total, count = 0.0, 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            total += float(loss.detach())
            count += 1
        means.append(total / max(count, 1))
    return means[0], means[-1]


# ------------------------------------------------------------------------------------------
# The checks. Each returns a one-line detail (PASS) or raises AssertionError (FAIL) / Skip.
# ------------------------------------------------------------------------------------------


def check_env_no_cuda_init() -> str:
    """resolve_environment() must not create a CUDA context (a later fork would be poisoned)."""
    import torch

    from anyaccel import resolve_environment

    _expect(not torch.cuda.is_initialized(), "CUDA was initialised by `import anyaccel` already")
    env = resolve_environment(cpu=SELF_TEST or None)
    _expect(not torch.cuda.is_initialized(), "resolve_environment() initialised CUDA")
    want = "cpu" if SELF_TEST else "cuda:0"
    _expect(env.device == want, f"resolved device {env.device!r}, expected {want!r}")
    return f"device={env.device}, torch.cuda.is_initialized()=False after resolve_environment()"


def check_placement() -> str:
    """accelerator.device is cuda:0; prepared model parameters and every batch live there; it trains."""
    import torch

    acc = _accelerator()
    want = torch.device(_dev(), 0) if not SELF_TEST else torch.device("cpu")
    _expect(acc.device == want, f"accelerator.device is {acc.device}, expected {want}")
    model, opt = _model(), None
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(_problem(), batch_size=32, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    bad = [n for n, p in model.named_parameters() if p.device != want]
    _expect(not bad, f"parameters not on {want}: {bad}")
    for x, y in loader:
        _expect(x.device == want and y.device == want, f"batch on {x.device}/{y.device}, expected {want}")
    first, last = _train(acc, model, opt, loader, epochs=4)
    _expect(last < first * 0.5, f"loss did not decrease enough: first epoch {first:.4f}, last {last:.4f}")
    return f"device={acc.device}, loss {first:.4f} -> {last:.4f}"


def check_fp16() -> str:
    """fp16: a GradScaler exists, training works, an inf gradient skips the step and the scheduler."""
    import torch

    acc = _accelerator(mixed_precision="fp16")
    _expect(acc.scaler is not None, "mixed_precision='fp16' but accelerator.scaler is None")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = torch.utils.data.DataLoader(_problem(), batch_size=32, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)

    # The forward runs under fp16 autocast, outputs come back in float32.
    seen = {}
    inner = acc.unwrap_model(model)
    hook = _record_dtype(inner[0], seen)
    x, y = next(iter(loader))
    out = model(x)
    hook.remove()
    _expect(seen.get("dtype") == torch.float16, f"Linear output under fp16 autocast was {seen.get('dtype')}")
    _expect(out.dtype == torch.float32, f"model output is {out.dtype}; expected float32 (convert_to_fp32)")

    # Inject an inf gradient: the scaler must skip the step, the scheduler must not step.
    lr_before = sched.get_last_lr()[0]
    params_before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    acc.backward(loss)
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    opt.step()
    sched.step()
    _expect(acc.optimizer_step_was_skipped, "optimizer_step_was_skipped is False after an inf gradient")
    _expect(sched.get_last_lr()[0] == lr_before,
            f"scheduler stepped on a skipped step: lr {lr_before} -> {sched.get_last_lr()[0]}")
    changed = [i for i, (a, b) in enumerate(zip(params_before, model.parameters())) if not torch.equal(a, b.detach())]
    _expect(not changed, f"parameters {changed} changed although the step was skipped")

    # The next steps: skipped exactly when the scaled gradients overflow (the scale halves until they fit:
    # with a loss of ~10 the first scales, 2**16 and 2**15, overflow fp16 on the CPU too), then a finite
    # step is taken and moves the scheduler.
    for _ in range(8):
        opt.zero_grad()
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
        opt.step()
        sched.step()
        _expect(acc.optimizer_step_was_skipped != finite,
                f"step with {'finite' if finite else 'overflowing'} scaled gradients reported "
                f"skipped={acc.optimizer_step_was_skipped}")
        if finite:
            break
    _expect(not acc.optimizer_step_was_skipped, "no finite step in 8 tries after the inf gradient")
    _expect(sched.get_last_lr()[0] < lr_before, "scheduler did not step after a real optimizer step")

    sched2 = None  # training for a few epochs must still reduce the loss
    first, last = _train(acc, model, opt, loader, epochs=3, scheduler=sched2)
    _expect(last < first, f"fp16 loss did not decrease: {first:.4f} -> {last:.4f}")
    return f"scaler={type(acc.scaler).__name__}, inf step skipped, scheduler held, loss {first:.4f} -> {last:.4f}"


def check_bf16() -> str:
    """bf16: autocast to bfloat16, no scaler, it trains."""
    import torch

    if not SELF_TEST and not torch.cuda.is_bf16_supported():
        raise Skip(f"{torch.cuda.get_device_name(0)} does not support bf16")
    acc = _accelerator(mixed_precision="bf16")
    _expect(acc.scaler is None, "bf16 must not use a GradScaler")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(_problem(), batch_size=32, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    seen = {}
    hook = _record_dtype(acc.unwrap_model(model)[0], seen)
    first, last = _train(acc, model, opt, loader, epochs=4)
    hook.remove()
    _expect(seen.get("dtype") == torch.bfloat16, f"Linear output under bf16 autocast was {seen.get('dtype')}")
    _expect(last < first * 0.5, f"bf16 loss did not decrease enough: {first:.4f} -> {last:.4f}")
    return f"autocast dtype bfloat16, loss {first:.4f} -> {last:.4f}"


def _notebook_launcher():
    try:
        from anyaccel import notebook_launcher
    except (ImportError, AttributeError) as e:
        raise Skip(f"anyaccel.notebook_launcher is not available: {e}")
    return notebook_launcher


def _nb_train(result_path: str) -> None:
    """Runs inside notebook_launcher: train on the launcher's device and write what was seen."""
    import torch

    acc = _accelerator()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(_problem(), batch_size=32, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    first, last = _train(acc, model, opt, loader, epochs=3)
    with open(result_path, "w") as fh:
        json.dump({"device": str(acc.device), "num_processes": acc.num_processes, "first": first, "last": last}, fh)


def check_notebook_launcher() -> str:
    """notebook_launcher with 1 GPU runs the function once, on cuda:0, and it trains."""
    launcher = _notebook_launcher()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        launcher(_nb_train, args=(path,), num_processes=1)
        _expect(os.path.exists(path), "the launched function did not run (no result file)")
        with open(path) as fh:
            res = json.load(fh)
    want = "cpu" if SELF_TEST else "cuda:0"
    _expect(res["device"] == want, f"launched function ran on {res['device']}, expected {want}")
    _expect(res["num_processes"] == 1, f"num_processes={res['num_processes']}, expected 1")
    _expect(res["last"] < res["first"], f"loss did not decrease: {res['first']:.4f} -> {res['last']:.4f}")
    return f"1 process on {res['device']}, loss {res['first']:.4f} -> {res['last']:.4f}"


def _noop() -> None:
    pass


def check_notebook_cuda_initialized_error() -> str:
    """After CUDA is initialised in the notebook, a multi-process notebook_launcher must refuse
    (forking would crash the children) with a message that says what to do."""
    import torch

    if SELF_TEST:
        raise Skip("needs a real CUDA context")
    launcher = _notebook_launcher()
    torch.zeros(1, device="cuda")
    _expect(torch.cuda.is_initialized(), "could not initialise CUDA for the test")
    # A forking launch is needed: 2 processes with 2+ GPUs; with 1 GPU, 1 process per node of a
    # (never started) 2-node job — the launcher must refuse before contacting anyone.
    if torch.cuda.device_count() >= 2:
        how = dict(num_processes=2)
    else:
        how = dict(num_processes=1, num_nodes=2, node_rank=0, use_port=_free_port())
    try:
        launcher(_noop, args=(), **how)
    except Exception as e:  # noqa: BLE001 - any error type is accepted, its message is checked
        msg = str(e)
        _expect("cuda" in msg.lower() and "initiali" in msg.lower(),
                f"{type(e).__name__} raised but its message does not explain the CUDA problem: {msg!r}")
        return f"{how}: {type(e).__name__}: {msg[:160]}"
    raise AssertionError(f"notebook_launcher({how}) after CUDA initialisation did not raise")


_DDP_WORKER = textwrap.dedent(
    """
    import json, os, sys, warnings
    sys.path.insert(0, {root!r}); sys.path.insert(0, {here!r})
    import torch
    import check_cuda as C
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = C._accelerator()
    env = acc.environment
    model = C._model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(C._problem(), batch_size=16, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    first, last = C._train(acc, model, opt, loader, epochs=3)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = acc.gather(flat.unsqueeze(0))
    same = bool(torch.allclose(gathered[0], gathered[1]))
    res = dict(rank=acc.process_index, world=acc.num_processes, device=str(acc.device), backend=env.backend,
               warnings=[str(w.message) for w in caught] + list(env.warnings), first=first, last=last,
               params_equal=same, batches=len(loader))
    with open(os.path.join({out!r}, "rank%d.json" % acc.process_index), "w") as fh:
        json.dump(res, fh)
    acc.end_training()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_two_procs_share_gpu() -> str:
    """torchrun --nproc_per_node 2 on a 1-GPU machine: both ranks on cuda:0, gloo (NCCL cannot
    put two ranks on one GPU), a warning saying so, DDP keeps the replicas identical."""
    import torch

    if not SELF_TEST and torch.cuda.device_count() != 1:
        raise Skip(f"needs exactly 1 visible GPU (found {torch.cuda.device_count()}); "
                   "set CUDA_VISIBLE_DEVICES=0 to run it")
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as tmp:
        worker = os.path.join(tmp, "worker.py")
        with open(worker, "w") as fh:
            fh.write(_DDP_WORKER.format(root=ROOT, here=here, out=tmp))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "0",
               "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), worker]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        _expect(proc.returncode == 0, f"torchrun exited {proc.returncode}: {proc.stderr[-1500:]}")
        res = []
        for r in range(2):
            with open(os.path.join(tmp, f"rank{r}.json")) as fh:
                res.append(json.load(fh))
    want = "cpu" if SELF_TEST else "cuda:0"
    for r in res:
        _expect(r["world"] == 2, f"rank {r['rank']} saw world size {r['world']}")
        _expect(r["device"] == want, f"rank {r['rank']} is on {r['device']}, expected {want}")
        _expect(r["backend"] == "gloo", f"rank {r['rank']} uses backend {r['backend']!r}, expected 'gloo'")
        _expect(r["params_equal"], "DDP replicas diverged: parameters differ across ranks")
        _expect(r["last"] < r["first"], f"rank {r['rank']} loss did not decrease: {r['first']:.4f} -> {r['last']:.4f}")
    if not SELF_TEST:
        _expect(any("share" in w and "gloo" in w for w in res[0]["warnings"]),
                f"rank 0 was not warned that 2 ranks share the GPU through gloo: {res[0]['warnings']}")
    return f"2 ranks on {want} via gloo, {res[0]['batches']} batches/rank, replicas identical"


def check_save_load_state_rng() -> str:
    """save_state/load_state restore weights, optimizer and the CUDA (and CPU) RNG streams."""
    import torch

    acc = _accelerator()
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(_problem(), batch_size=32, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    _train(acc, model, opt, loader, epochs=1)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            acc.save_state(os.path.join(tmp, "ckpt"))
        except (NotImplementedError, AttributeError) as e:
            raise Skip(f"save_state is not available: {type(e).__name__}: {e}")
        dev = acc.device
        want_gpu = torch.rand(4, device=dev)
        want_cpu = torch.rand(4)
        weights = [p.detach().clone() for p in model.parameters()]
        _train(acc, model, opt, loader, epochs=1)  # move everything on
        torch.rand(100, device=dev)
        acc.load_state(os.path.join(tmp, "ckpt"))
        got_gpu = torch.rand(4, device=dev)
        got_cpu = torch.rand(4)
    _expect(torch.equal(want_gpu, got_gpu), f"{dev} RNG not restored: {want_gpu.tolist()} vs {got_gpu.tolist()}")
    _expect(torch.equal(want_cpu, got_cpu), "CPU RNG not restored")
    diff = [i for i, (a, b) in enumerate(zip(weights, model.parameters())) if not torch.equal(a, b.detach())]
    _expect(not diff, f"parameters {diff} not restored by load_state")
    return f"{dev} RNG, CPU RNG and weights restored"


CHECKS = {
    "env_no_cuda_init": check_env_no_cuda_init,
    "placement": check_placement,
    "fp16": check_fp16,
    "bf16": check_bf16,
    "notebook_launcher": check_notebook_launcher,
    "notebook_cuda_initialized_error": check_notebook_cuda_initialized_error,
    "two_procs_share_gpu": check_two_procs_share_gpu,
    "save_load_state_rng": check_save_load_state_rng,
}


# ------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------


def _run_one(name: str) -> dict:
    """Run one check in this process; return its result record."""
    start = time.time()
    try:
        detail = CHECKS[name]()
        status = "PASS"
    except Skip as e:
        status, detail = "SKIP", str(e)
    except AssertionError as e:
        status, detail = "FAIL", str(e) or traceback.format_exc(limit=3)
    except Exception as e:  # noqa: BLE001 - an unexpected error is a failure with its traceback
        status, detail = "FAIL", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
    return {"name": name, "status": status, "detail": detail, "seconds": round(time.time() - start, 2)}


def _run_isolated(name: str) -> dict:
    """Run one check in a fresh interpreter (clean CUDA state); parse its JSON line."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", name]
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    except subprocess.TimeoutExpired:
        return {"name": name, "status": "FAIL", "detail": "timed out after 600 s", "seconds": 600}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("@@RESULT "):
            return json.loads(line[len("@@RESULT "):])
    return {"name": name, "status": "FAIL", "seconds": None,
            "detail": f"check process exited {proc.returncode} without a result: {proc.stderr[-1500:]}"}


def _machine() -> dict:
    info = {"python": sys.version.split()[0], "self_test_cpu": SELF_TEST}
    try:
        import torch

        info.update(torch=torch.__version__, cuda_build=torch.version.cuda, cuda_available=torch.cuda.is_available())
        if torch.cuda.is_available():  # asked in the driver only; checks run in their own processes
            info.update(gpu_count=torch.cuda.device_count(), gpu=torch.cuda.get_device_name(0))
    except Exception as e:  # noqa: BLE001
        info["torch_error"] = repr(e)
    return info


def main(argv) -> int:
    global SELF_TEST
    if "--one" in argv:
        name = argv[argv.index("--one") + 1]
        print("@@RESULT " + json.dumps(_run_one(name)), flush=True)
        return 0
    strict = "--strict" in argv
    if "--self-test-cpu" in argv:
        os.environ["ANYACCEL_CHECK_SELF_TEST"] = "1"
        SELF_TEST = True
    names = [a for a in argv if not a.startswith("--")] or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"unknown check(s) {unknown}; choose from {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    machine = _machine()
    print(f"machine: {json.dumps(machine)}", flush=True)
    results = []
    if not SELF_TEST and not machine.get("cuda_available"):
        reason = "no CUDA device visible to torch (torch.cuda.is_available() is False)"
        results = [{"name": n, "status": "SKIP", "detail": reason, "seconds": 0} for n in names]
        for r in results:
            print(f"SKIP {r['name']}: {reason}", flush=True)
    else:
        for n in names:
            r = _run_isolated(n)
            results.append(r)
            print(f"{r['status']} {n}: {r['detail']}  ({r['seconds']} s)", flush=True)
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    print(f"summary: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "cuda_check.json"), "w") as fh:
            json.dump({"machine": machine, "results": results, "counts": counts}, fh, indent=2)
    failed = counts["FAIL"] > 0 or (strict and counts["SKIP"] > 0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main(sys.argv[1:]))
