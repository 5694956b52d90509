"""FSDP2 and torch.compile benchmarks, as result rows.

* ``fsdp``     2 processes: anyaccel's FSDP2 step vs a hand-written ``fully_shard`` loop (target
               <= 1.02), and peak memory per rank of FSDP2 vs DDP for a model whose parameters
               dominate (target <= 0.6 with 2 processes). Accelerate cannot run FSDP on a CPU (its
               FSDP plugin is only selected for GPU-like devices): a row says so.
* ``compile``  1 process: step time of a CPU MLP compiled with inductor through anyaccel
               (``Accelerator(dynamo_backend="inductor")``), raw ``torch.compile`` and Accelerate's
               ``dynamo_backend="inductor"``, over the raw eager step (the speed-up is 1/ratio);
               compilation itself is excluded (warm-up steps). Two models: a user subclass with its
               own ``forward`` and the same layers in an ``nn.Sequential``. Each compiling contender's
               note gives the frames and graphs Dynamo compiled for it (counted during its warm-up);
               one that compiled no graph is marked COMPILED NOTHING.

    python benchmarks/sharding.py [--quick]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Dict, List

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharding_worker.py")
# Peak memory on a CPU is read as the resident-set high-water mark. glibc raises its mmap threshold
# after large blocks are freed and then keeps freed blocks resident, so the mark would measure the
# allocator's history, not the tensors alive at the peak. A fixed threshold gives every large
# tensor its own mapping, returned when freed: what CUDA's max_memory_allocated counts on a GPU.
_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def run_fsdp(quick: bool = False) -> List[dict]:
    rows: List[dict] = []
    name = "2-proc FSDP2 step, 16 x Linear(1024) + AdamW"
    try:
        res = common.run_torchrun_json(WORKER, ["--task", "step"] + (["--quick"] if quick else []), timeout=1200)
    except RuntimeError as exc:
        return [common.skip_row("fsdp", name, "anyaccel fsdp", f"failed: {exc}"[:300], target="<= 1.02")]
    for contender, r in res.items():
        base = contender.startswith("hand-written")
        rows.append(common.row("fsdp", name, contender, r["median"] * 1e3, "ms/step",
                               ratio=None if base else r["ratio"], baseline=None if base else "hand-written fully_shard",
                               target=None if base else "<= 1.02", note="" if base else common.ci_text(r["ci"])))
    rows.append(common.skip_row("fsdp", name, "accelerate", "Accelerate selects FSDP only on GPU-like devices; "
                                "it cannot run FSDP on a CPU"))

    name = "peak memory per rank, 2 procs, 16 x Linear(1024) + AdamW"
    peaks: Dict[str, dict] = {}
    for strategy in ("ddp", "fsdp"):
        try:
            peaks[strategy] = common.run_torchrun_json(WORKER, ["--task", "memory", "--strategy", strategy]
                                                       + (["--quick"] if quick else []), timeout=600, env=_MALLOC)
        except RuntimeError as exc:
            rows.append(common.skip_row("fsdp", name, f"anyaccel {strategy}", f"failed: {exc}"[:300]))
    if len(peaks) == 2:
        ddp_peak = max(p["peak"] for p in peaks["ddp"]["per_rank"])
        unit = "MiB (CUDA allocated)" if peaks["ddp"]["device"] == "cuda" else "MiB (RSS high-water)"
        for strategy, res in peaks.items():
            peak = max(p["peak"] for p in res["per_rank"])
            held = res["per_rank"][0]
            note = (f"held by rank 0: params {held['params'] / 2**20:.1f} MiB, optimizer {held['optimizer'] / 2**20:.1f} "
                    f"MiB (model {res['model_bytes'] / 2**20:.1f} MiB fp32)")
            rows.append(common.row("fsdp", name, f"anyaccel {strategy}", peak / 2**20, unit,
                                   ratio=None if strategy == "ddp" else peak / ddp_peak,
                                   baseline=None if strategy == "ddp" else "anyaccel ddp",
                                   target="<= 0.6" if strategy == "fsdp" else None, note=note))
    return rows


# model kind -> row name; "mlp" is a user subclass with its own forward, "sequential" a torch.nn
# container (torch's forward: the case nn.Module.compile() leaves eager).
_COMPILE_MODELS = {"mlp": "compiled CPU MLP step (inductor), 1 process",
                   "sequential": "compiled CPU nn.Sequential step (inductor), 1 process"}


def run_compile(quick: bool = False) -> List[dict]:
    rows: List[dict] = []
    for kind, name in _COMPILE_MODELS.items():
        cmd = [sys.executable, os.path.abspath(__file__), "--compile-worker", kind] + (["--quick"] if quick else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=common.bench_env(),
                              cwd=common.REPO)
        if proc.returncode != 0:
            rows.append(common.skip_row("compile", name, "anyaccel", f"failed: {(proc.stdout + proc.stderr)[-300:]}"))
            continue
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        for contender, r in res["results"].items():
            base = contender == "raw eager"
            frames, graphs = res["compiled"][contender]
            note = "" if base else f"speed-up {1 / r['ratio']:.2f}x; {common.ci_text(r['ci'])}; compilation excluded"
            if "eager" not in contender:
                note = (f"COMPILED NOTHING (Dynamo: {frames} frames, 0 graphs): ran eager; " if graphs == 0 else
                        f"Dynamo compiled {frames} frame(s), {graphs} graph(s); ") + note
            rows.append(common.row("compile", name, contender, r["median"] * 1e6, "us/step (CPU)",
                                   ratio=None if base else r["ratio"], baseline=None if base else "raw eager",
                                   note=note))
        for contender, why in res.get("errors", {}).items():
            rows.append(common.skip_row("compile", name, contender, why))
    return rows


_MLP_SOURCE = {
    # Pointwise work around each matmul: what inductor fuses on a CPU.
    "mlp": """
        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(4))
                self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(256) for _ in range(4))
                self.out = torch.nn.Linear(256, 1)

            def forward(self, x):
                for layer, norm in zip(self.layers, self.norms):
                    x = x + torch.nn.functional.gelu(layer(norm(x))) * torch.sigmoid(x)
                return self.out(x)
    """,
    # The same layers in a torch.nn container (a subclass that keeps Sequential's forward, so each
    # contender has a class of its own and Dynamo guards keep their caches apart).
    "sequential": """
        class Model(torch.nn.Sequential):
            def __init__(self):
                blocks = [m for _ in range(4) for m in (torch.nn.LayerNorm(256), torch.nn.Linear(256, 256),
                                                        torch.nn.GELU(), torch.nn.Sigmoid())]
                super().__init__(*blocks, torch.nn.Linear(256, 1))
    """,
}


def _compile_worker(kind: str, quick: bool) -> None:
    """Runs in its own interpreter (dynamo state stays out of the parent)."""
    import torch
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    source = textwrap.dedent(_MLP_SOURCE[kind])
    folder = tempfile.mkdtemp(prefix="anyaccel-bench-compile-")
    classes: list = []

    def Model():  # noqa: N802 - a fresh class per contender, from a file of its own (dynamo traces files)
        import importlib.util

        path = os.path.join(folder, f"model{len(classes)}.py")
        with open(path, "w") as fh:
            fh.write("import torch\n" + source)
        spec = importlib.util.spec_from_file_location(f"bench_model{len(classes)}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        classes.append(module.Model)
        return classes[-1]()

    x, y = torch.randn(128, 256), torch.randn(128, 1)

    def stepper(model, opt, backward=lambda loss: loss.backward()):
        def step():
            loss = torch.nn.functional.mse_loss(model(x), y)
            backward(loss)
            opt.step()
            opt.zero_grad()
        return step

    def plain(compiled):
        torch.manual_seed(0)
        model = Model()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        return stepper(torch.compile(model) if compiled else model, opt)

    def anyaccel(backend):
        from anyaccel import Accelerator

        acc = Accelerator(cpu=True, dynamo_backend=backend)
        torch.manual_seed(0)
        model = Model()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        return stepper(model, opt, acc.backward)

    def accelerate():
        import accelerate

        acc = accelerate.Accelerator(cpu=True, dynamo_backend="inductor")
        torch.manual_seed(0)
        model = Model()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        return stepper(model, opt, acc.backward)

    builders = {"raw eager": lambda: plain(False), "raw torch.compile": lambda: plain(True),
                "anyaccel eager": lambda: anyaccel(None), "anyaccel inductor": lambda: anyaccel("inductor")}
    if common.have("accelerate"):
        builders["accelerate inductor"] = accelerate
    steps, errors, compiled = {}, {}, {}
    for name, build in builders.items():
        before = (counters["frames"]["ok"], counters["stats"]["unique_graphs"])
        try:
            step = build()
            for _ in range(3):
                step()  # compiles on the first calls
            steps[name] = step
        except Exception as exc:  # noqa: BLE001 - report, do not abort
            errors[name] = f"set-up failed: {exc!r}"[:200]
        compiled[name] = (counters["frames"]["ok"] - before[0], counters["stats"]["unique_graphs"] - before[1])
    chunk = 20

    def measure(step):
        def one():
            c0 = time.process_time()
            for _ in range(chunk):
                step()
            return (time.process_time() - c0) / chunk
        return one

    res = common.interleaved({n: measure(s) for n, s in steps.items()}, rounds=4 if quick else 20, warmup=1,
                             baseline="raw eager")
    print(json.dumps({"results": {n: {"median": r["median"], "ratio": r["ratio"], "ci": r["ratio_ci"]}
                                  for n, r in res.items()}, "errors": errors, "compiled": compiled}))


if __name__ == "__main__":
    if "--compile-worker" in sys.argv:
        _compile_worker(sys.argv[sys.argv.index("--compile-worker") + 1], "--quick" in sys.argv)
    else:
        q = "--quick" in sys.argv
        common.print_table(run_fsdp(q) + run_compile(q))
