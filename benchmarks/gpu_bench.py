"""One-GPU training throughput and peak memory: raw PyTorch vs anyaccel vs Accelerate, bf16.

    python benchmarks/gpu_bench.py                 # on a machine with a CUDA GPU
    python benchmarks/gpu_bench.py --quick         # fewer steps/rounds
    python benchmarks/gpu_bench.py --cpu-smoke     # tiny sizes on the CPU: checks the script, no numbers

Workloads (synthetic data, nothing downloaded):

* ``resnet50``     torchvision ResNet-50, 224x224 images, batch 64, SGD; images/s. Skipped when
                   torchvision is missing.
* ``transformer``  ``nn.TransformerEncoder`` (6 layers, d_model 512, 8 heads, seq 256, batch 32)
                   with a token embedding and an LM head (vocab 8192), AdamW; tokens/s.

Each contender runs the same loop from a DataLoader over CPU tensors (``pin_memory=True``): raw
PyTorch moves batches with ``.to(device, non_blocking=True)`` and runs the forward under
``torch.autocast("cuda", torch.bfloat16)``; anyaccel and Accelerate get
``mixed_precision="bf16"`` and ``prepare``. Throughput is timed over ``--steps`` steps between
``torch.cuda.synchronize()`` calls, contenders alternating over rounds (medians). Peak memory is
``torch.cuda.max_memory_allocated()`` while building and running each contender, minus what was
allocated before it was built (so the other contenders' resident models do not count).

Without CUDA (and without ``--cpu-smoke``) it prints why and exits 0. When ``$OUT`` is set the
results (or the reason for skipping) are written to ``$OUT/gpu_bench.json``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import platform
import sys
import time
from typing import Dict, List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402


def _write(payload: dict) -> None:
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_bench.json"), "w") as f:
            json.dump(payload, f, indent=1)
        print(f"wrote {os.path.join(out, 'gpu_bench.json')}")


# ---------------------------------------------------------------------------------------------
# workloads: build(model, dataset, loss_fn, optimizer factory, items per batch)
# ---------------------------------------------------------------------------------------------


def _resnet(smoke: bool):
    import torch
    import torchvision

    batch = 4 if smoke else 64
    size = 64 if smoke else 224
    n = batch * (4 if smoke else 8)
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 3, size, size, generator=g),
                                        torch.randint(0, 1000, (n,), generator=g))
    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=1000)

    def loss_fn(model, batch_):
        x, y = batch_
        return torch.nn.functional.cross_entropy(model(x).float(), y)

    opt = lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9)  # noqa: E731
    return model, ds, batch, loss_fn, opt, batch, "images/s"



def _transformer(smoke: bool):
    import torch

    vocab, d, heads, layers, seq, batch = (256, 64, 4, 2, 32, 4) if smoke else (8192, 512, 8, 6, 256, 32)

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, d)
            layer = torch.nn.TransformerEncoderLayer(d, heads, dim_feedforward=4 * d, batch_first=True,
                                                     dropout=0.0, norm_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = torch.nn.Linear(d, vocab)

        def forward(self, tokens):
            mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
            return self.head(self.encoder(self.embed(tokens), mask=mask, is_causal=True))

    n = batch * (4 if smoke else 8)
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randint(0, vocab, (n, seq + 1), generator=g))
    torch.manual_seed(0)
    model = LM()

    def loss_fn(model, batch_):
        (tokens,) = batch_
        logits = model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))

    opt = lambda params: torch.optim.AdamW(params, lr=1e-4)  # noqa: E731
    return model, ds, batch, loss_fn, opt, batch * seq, "tokens/s"


WORKLOADS = {"resnet50": _resnet, "transformer": _transformer}


# ---------------------------------------------------------------------------------------------
# contenders: each returns an endless step generator
# ---------------------------------------------------------------------------------------------


def _loader(ds, batch, device_type):
    import torch

    return torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, drop_last=True,
                                       pin_memory=device_type == "cuda")


def _raw(model, ds, batch, loss_fn, opt_factory, device):
    import torch

    model = copy.deepcopy(model).to(device)
    opt = opt_factory(model.parameters())
    loader = _loader(ds, batch, device.type)

    def steps():
        while True:
            for b in loader:
                b = [t.to(device, non_blocking=True) for t in b]
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = loss_fn(model, b)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                yield

    return steps()


def _prepared(accelerator_class, model, ds, batch, loss_fn, opt_factory, device):
    """The loop an Accelerate user writes; the same for anyaccel and Accelerate (only the class differs)."""
    acc = accelerator_class(mixed_precision="bf16", cpu=device.type == "cpu")
    model = copy.deepcopy(model)
    model, opt, loader = acc.prepare(model, opt_factory(model.parameters()), _loader(ds, batch, device.type))

    def steps():
        while True:
            for b in loader:
                loss = loss_fn(model, b)
                acc.backward(loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
                yield

    return steps()


def _anyaccel(*args):
    from anyaccel import Accelerator

    return _prepared(Accelerator, *args)


def _accelerate(*args):
    from accelerate import Accelerator

    return _prepared(Accelerator, *args)


CONTENDERS = {"raw": (_raw, None), "anyaccel": (_anyaccel, None), "accelerate": (_accelerate, "accelerate")}


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_workload(name: str, device, steps: int, rounds: int, smoke: bool) -> List[dict]:
    import torch

    rows: List[dict] = []
    label = f"{name}, bf16, 1 {'GPU' if device.type == 'cuda' else 'CPU (smoke)'}"
    try:
        model, ds, batch, loss_fn, opt_factory, items, unit = WORKLOADS[name](smoke)
    except ImportError as exc:
        return [common.skip_row("gpu", label, "all", f"skipped: {exc}")]
    gens: Dict[str, object] = {}
    peak: Dict[str, float] = {}
    for cname, (setup, needs) in CONTENDERS.items():
        if needs and not common.have(needs):
            rows.append(common.skip_row("gpu", label, cname, f"{needs} not installed"))
            continue
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            gen = setup(model, ds, batch, loss_fn, opt_factory, device)
            for _ in itertools.islice(gen, 3):  # warm-up: cuDNN autotune, optimizer state, allocator
                pass
            _sync(device)
            if device.type == "cuda":
                peak[cname] = (torch.cuda.max_memory_allocated(device) - before) / 2**20
            gens[cname] = gen
        except Exception as exc:  # noqa: BLE001 - report the contender, keep the others
            rows.append(common.skip_row("gpu", label, cname, f"failed: {type(exc).__name__}: {exc}"[:300]))

    def timed(gen):
        def one() -> float:
            _sync(device)
            t0 = time.perf_counter()
            for _ in itertools.islice(gen, steps):
                pass
            _sync(device)
            return steps * items / (time.perf_counter() - t0)

        return one

    if "raw" not in gens:
        return rows + [common.skip_row("gpu", label, "raw", "raw baseline failed; no ratios")]
    res = common.interleaved({k: timed(g) for k, g in gens.items()}, rounds=rounds, warmup=1, baseline="raw")
    for cname in gens:
        is_base = cname == "raw"
        note = f"peak memory {peak[cname]:.0f} MiB" if cname in peak else ""
        if cname in peak and not is_base and peak.get("raw"):
            note += f" ({peak[cname] / peak['raw']:.3f}x raw)"
        rows.append(common.row("gpu", label, cname, res[cname]["median"], unit, ratio=None if is_base else res[cname]["ratio"],
                               baseline=None if is_base else "raw", target=">= 0.99" if cname == "anyaccel" and device.type == "cuda" else None,
                               note=note))
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (checks the script; no numbers)")
    p.add_argument("--only", choices=sorted(WORKLOADS), action="append", help="only these workloads")
    p.add_argument("--steps", type=int, help="steps per measurement")
    p.add_argument("--rounds", type=int, help="alternating rounds")
    args = p.parse_args(argv)
    import torch

    versions = common.versions()
    head = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(), "versions": versions,
            "command": "python benchmarks/gpu_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    if args.cpu_smoke:
        device = torch.device("cpu")
        steps, rounds = args.steps or 2, args.rounds or 2
    elif not torch.cuda.is_available():
        why = f"no CUDA device (torch {torch.__version__}, cuda build: {torch.version.cuda}); nothing measured"
        print(f"gpu_bench: skipped: {why}")
        _write({**head, "skipped": why, "rows": []})
        return 0
    else:
        device = torch.device("cuda", 0)
        head["gpu"] = torch.cuda.get_device_name(device)
        torch.backends.cudnn.benchmark = True
        steps, rounds = args.steps or (10 if args.quick else 30), args.rounds or (3 if args.quick else 7)
    print("# " + json.dumps(head))
    rows: List[dict] = []
    for name in WORKLOADS:
        if args.only and name not in args.only:
            continue
        rows += bench_workload(name, device, steps, rounds, smoke=args.cpu_smoke)
        common.print_table(rows[-len(CONTENDERS):])
    print()
    common.print_table(rows)
    _write({**head, "device": str(device), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
