"""Sequence-parallel measurements inside each worker of a torchrun job (never imported by the parent).

    python -m torch.distributed.run --nproc_per_node 2 ... benchmarks/sequence_worker.py --mode step --out r.json
    python -m torch.distributed.run --nproc_per_node N ... benchmarks/sequence_worker.py --mode memory --out r.json

The model is a transformers Llama built from a config (random weights, nothing downloaded), SDPA
attention, AdamW.

``step`` (2 processes, sp 2): contenders in the same process group, rounds alternating:

* ``hand-written Ulysses``: what a user writes without a framework (and without importing
  anyaccel's sequence code): an attention function registered with transformers that all-to-alls
  query/key/value from sequence slices to head slices and back around SDPA, ``fully_shard`` of
  each decoder layer and of the root over the 2 ranks, the batch cut by hand with global position
  ids, labels shifted across the slice border by an all-gather, the loss a token-weighted
  all-reduce scaled for FSDP's gradient averaging;
* ``hand-written Ulysses'``: an independent second copy: the run's noise floor;
* ``anyaccel sp``: ``Accelerator(parallelism_config=ParallelismConfig(sp_size=2))``, the model,
  AdamW and the DataLoader prepared, ``model(**batch).loss``, ``accelerator.backward``.

Proof that both did what is timed: the first loss of each on the same weights and batch (equal to
rounding), the local batch shape each rank's model saw, and the attention function each model's
config names.

``memory`` (1 process without sp, or 2 with sp 2; one contender per job, so that nothing else
lives in the process): the resident-set peak of a warm training step above the resident set just
before it, measured by resetting the kernel's high-water mark (``/proc/self/clear_refs``) and
reading ``VmHWM``. Large tensors are mmapped (``MALLOC_MMAP_THRESHOLD_``, set by the parent), so
freed activations leave the resident set and the baseline is what the step starts with. The
bytes autograd saved for backward (``saved_tensors_hooks``) are reported beside it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import common  # noqa: E402

SIZES = dict(hidden=256, heads=8, layers=2, vocab=512, seq=1024, batch=2)
QUICK_SIZES = dict(hidden=64, heads=4, layers=2, vocab=128, seq=128, batch=2)
MEMORY_SIZES = dict(hidden=128, heads=4, layers=2, vocab=256, seq=4096, batch=1)
QUICK_MEMORY_SIZES = dict(hidden=64, heads=4, layers=2, vocab=128, seq=1024, batch=1)
HAND = "hand-written Ulysses"


def _model(s: Dict[str, int]) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=s["hidden"], intermediate_size=4 * s["hidden"],
                                      num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
                                      num_hidden_layers=s["layers"], vocab_size=s["vocab"],
                                      max_position_embeddings=s["seq"], attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


def _data(s: Dict[str, int], n: int) -> List[Dict[str, torch.Tensor]]:
    ids = torch.randint(0, s["vocab"], (n, s["seq"]), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": ids[i], "labels": ids[i]} for i in range(n)]


# ---- the hand-written Ulysses (torch and transformers only) -----------------------------------------
class _A2A(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter, gather):
        ctx.dims = (scatter, gather)
        return _a2a(x, scatter, gather)

    @staticmethod
    def backward(ctx, grad):
        scatter, gather = ctx.dims
        return _a2a(grad, gather, scatter), None, None


def _a2a(x: torch.Tensor, scatter: int, gather: int) -> torch.Tensor:
    world = dist.get_world_size()
    send = torch.stack(x.chunk(world, dim=scatter)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send)
    return torch.cat(received.unbind(0), dim=gather)


def _hand_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = (_A2A.apply(t, 1, 2) for t in (query, key, value))  # (b, h/2, s, d)
    out, weights = sdpa_attention_forward(module, q, k, v, None, **kwargs)  # (b, s, h/2, d)
    return _A2A.apply(out, 1, 2), weights


class _Scaled(torch.autograd.Function):
    """The loss value summed over ranks; the gradient times the number of ranks (FSDP averages)."""

    @staticmethod
    def forward(ctx, part):
        total = part.detach().clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad * dist.get_world_size()


def hand_written(s: Dict[str, int], data: List[Dict[str, torch.Tensor]]):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AttentionInterface

    AttentionInterface.register("hand_ulysses", _hand_attention)
    model = _model(s)
    model.config._attn_implementation = "hand_ulysses"
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    world, rank = dist.get_world_size(), dist.get_rank()
    loader = torch.utils.data.DataLoader(data, batch_size=s["batch"])
    batches = iter(())

    def cut(batch):
        part = s["seq"] // world
        ids, labels = (batch[k][:, rank * part:(rank + 1) * part] for k in ("input_ids", "labels"))
        firsts = [torch.empty_like(labels[:, :1]) for _ in range(world)]
        dist.all_gather(firsts, labels[:, :1].contiguous())
        following = firsts[rank + 1] if rank + 1 < world else torch.full_like(labels[:, :1], -100)
        shift = torch.cat([labels[:, 1:], following], dim=1)
        positions = torch.arange(rank * part, (rank + 1) * part)[None]
        return ids, shift, positions

    def loss_of(batch):
        ids, shift, positions = cut(batch)
        logits = model(input_ids=ids, position_ids=positions).logits
        summed = torch.nn.functional.cross_entropy(logits.float().reshape(-1, s["vocab"]), shift.reshape(-1),
                                                   ignore_index=-100, reduction="sum")
        count = (shift != -100).sum().float()
        dist.all_reduce(count)
        return _Scaled.apply(summed / count), ids.shape

    def step():
        nonlocal batches
        batch = next(batches, None)
        if batch is None:
            batches = iter(loader)
            batch = next(batches)
        loss, _ = loss_of(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return model, step, loss_of, loader


def with_anyaccel(s: Dict[str, int], data: List[Dict[str, torch.Tensor]]):
    from anyaccel import Accelerator, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(sp_size=dist.get_world_size()))
    model = _model(s)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # before prepare, as users do
    model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=s["batch"]))
    batches = iter(())

    def step():
        nonlocal batches
        batch = next(batches, None)
        if batch is None:
            batches = iter(loader)
            batch = next(batches)
        loss = model(**batch).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()

    def loss_of(batch):
        return model(**batch).loss, batch["input_ids"].shape

    return model, step, loss_of, loader, acc


def run_step(quick: bool) -> Dict[str, Any]:
    s = QUICK_SIZES if quick else SIZES
    data = _data(s, 4 * s["batch"])
    raw_model, raw_step, raw_loss, raw_loader = hand_written(s, data)
    any_model, any_step, any_loss, any_loader, acc = with_anyaccel(s, data)
    with torch.no_grad():  # same weights, same first batch: the losses agree to rounding
        first_raw, raw_shape = raw_loss(next(iter(raw_loader)))
        first_any, any_shape = any_loss(next(iter(any_loader)))
    proof = {"first loss": {HAND: float(first_raw), "anyaccel sp": float(first_any)},
             "local batch": {HAND: list(raw_shape), "anyaccel sp": list(any_shape)},
             "attention": {HAND: raw_model.config._attn_implementation,
                           "anyaccel sp": acc.unwrap_model(any_model).config._attn_implementation},
             "anyaccel mesh": str(acc.torch_device_mesh)}
    floor_step = hand_written(s, data)[1]
    steppers = {HAND: raw_step, HAND + "'": floor_step, "anyaccel sp": any_step}
    chunk = 2 if quick else 3

    def measure(step):
        return lambda: common.timed_collective(lambda: [step() for _ in range(chunk)], chunk)

    res = common.interleaved({n: measure(st) for n, st in steppers.items()}, rounds=3 if quick else 12, warmup=1,
                             baseline=HAND)
    calls = {n: common.python_calls((st() for _ in iter(int, 1)), 2, enabled=dist.get_rank() == 0)
             for n, st in steppers.items()}
    acc.end_training()
    return {"world": dist.get_world_size(), "sizes": s, "proof": proof, "calls": calls,
            "step": common.step_summary(res)}


# ---- memory ------------------------------------------------------------------------------------------
def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set


def run_memory(quick: bool) -> Dict[str, Any]:
    from anyaccel import Accelerator, ParallelismConfig

    s = QUICK_MEMORY_SIZES if quick else MEMORY_SIZES
    world = dist.get_world_size()
    acc = Accelerator(parallelism_config=ParallelismConfig(sp_size=world)) if world > 1 else Accelerator()
    model = _model(s)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(_data(s, 2 * s["batch"]),
                                                                             batch_size=s["batch"]))
    peaks, saved_bytes = [], []
    for batch in loader:  # step 1 warms up (optimizer state, buffers); step 2 is measured
        saved: Dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        dist.barrier()
        _reset_peak()
        before = _rss_kib("VmRSS")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**batch).loss
        acc.backward(loss)
        peaks.append((_rss_kib("VmHWM") - before) * 1024)
        saved_bytes.append(sum(saved.values()))
        opt.step()
        opt.zero_grad()
    params = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in model.parameters())
    local = {"peak": peaks[-1], "saved": saved_bytes[-1], "local_length": int(batch["input_ids"].shape[1]),
             "params": params}
    every: List[Any] = [None] * world
    dist.all_gather_object(every, local)
    acc.end_training()
    return {"world": world, "sizes": s, "ranks": every}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["step", "memory"], required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = run_step(args.quick) if args.mode == "step" else run_memory(args.quick)
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
