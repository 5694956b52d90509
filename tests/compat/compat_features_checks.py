"""Run with 2 processes (``anyaccel launch --num_processes 2 --cpu``): what Accelerate's example
scripts need beyond the core (issue 29): DDP communication hooks, LocalSGD, the FSDP plugin's
state-dict configs, and DataLoader worker seeds with several processes.

Rank r writes <outdir>/rank<r>.json; tests/compat/test_compat_features_multiprocess.py asserts on it.
Everything runs inside ``main()`` with ``end_training()`` last, as users' scripts do.
"""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from anyaccel import Accelerator, DistributedDataParallelKwargs, FullyShardedDataParallelPlugin
from anyaccel.local_sgd import LocalSGD
from anyaccel.utils import DDPCommunicationHookType, gather


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def _equal_on_all_ranks(tensors):
    return all(bool(torch.equal(g[0], g[1])) for g in (gather(t.detach()[None]) for t in tensors))


def comm_hook_run(rank, world, hook, wrapper="no", state_option=None, steps=3):
    """Gradients of ``steps`` backward passes through the hooked DDP model, against what each
    rank's own gradients give: the fp32 all-reduce DDP does without a hook (``exact``) and the
    half-precision all-reduce the fp16/bf16 hooks do (``cast``)."""
    kwargs = DistributedDataParallelKwargs(comm_hook=hook, comm_wrapper=wrapper, comm_state_option=state_option or {})
    acc = Accelerator(kwargs_handlers=[kwargs])
    plain = _model()
    model = acc.prepare(copy.deepcopy(plain))
    hooks = getattr(model, "_comm_hooks", [])
    state = hooks[0][1] if hooks else None
    out = {"registered": len(hooks), "steps": []}
    hook, wrapper = getattr(hook, "value", hook), getattr(wrapper, "value", wrapper)
    half = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(wrapper if wrapper != "no" else hook)
    for step in range(steps):
        torch.manual_seed(100 + 10 * step + rank)
        x = torch.randn(6, 16)
        model.zero_grad()
        acc.backward(model(x).pow(2).mean())
        plain.zero_grad()
        plain(x).pow(2).mean().backward()
        local = [p.grad.detach() for p in plain.parameters()]
        every = [gather(g[None]) for g in local]  # [world, ...] per parameter
        exact = [sum(g[r] / world for r in range(world)) for g in every]
        got = [p.grad.detach() for p in model.parameters()]
        record = {"ranks_agree": _equal_on_all_ranks(got),
                  "equals_exact": all(torch.equal(a, b) for a, b in zip(got, exact)),
                  "close_to_exact": all(torch.allclose(a, b, rtol=1e-2, atol=1e-2) for a, b in zip(got, exact)),
                  "weight_ranks": [int(torch.linalg.matrix_rank(g)) for g in got if g.dim() == 2],
                  "exact_weight_ranks": [int(torch.linalg.matrix_rank(g)) for g in exact if g.dim() == 2]}
        if half is not None:
            cast = [sum((g[r].to(half) / world) for r in range(world)).float() for g in every]
            record["equals_cast"] = all(torch.equal(a, b) for a, b in zip(got, cast))
        out["steps"].append(record)
    out["powersgd_iter"] = getattr(state, "iter", None)
    return out


def local_sgd_run(rank, world, enabled=True, k=3, steps=7):
    """LocalSGD through the accelerator against a hand-written loop (plain DDP, ``no_sync``, an
    all-reduce of every parameter divided by the world size every ``k`` steps)."""
    acc = Accelerator()
    plain = _model()
    model = acc.prepare(copy.deepcopy(plain))
    optimizer = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    hand = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(plain))
    hand_opt = torch.optim.SGD(hand.parameters(), lr=0.1)
    agree_during, hand_params = [], []
    with LocalSGD(accelerator=acc, model=model, local_sgd_steps=k, enabled=enabled) as local_sgd:
        for step in range(steps):
            torch.manual_seed(200 + 10 * step + rank)
            x = torch.randn(6, 16)
            with acc.accumulate(model):
                acc.backward(model(x).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()
            agree_during.append(_equal_on_all_ranks(list(model.parameters())))
    with hand.no_sync() if enabled else _null():
        for step in range(steps):
            torch.manual_seed(200 + 10 * step + rank)
            x = torch.randn(6, 16)
            hand(x).pow(2).mean().backward()
            hand_opt.step()
            hand_opt.zero_grad()
            if enabled and (step + 1) % k == 0:
                _average(hand)
    if enabled:
        _average(hand)
    hand_params = list(hand.parameters())
    return {"num_steps": local_sgd.num_steps, "enabled": local_sgd.enabled, "agree_during": agree_during,
            "agree_after": _equal_on_all_ranks(list(model.parameters())),
            "equals_hand_written": all(torch.equal(a, b) for a, b in zip(model.parameters(), hand_params)),
            "max_diff": max(float((a - b).detach().abs().max()) for a, b in zip(model.parameters(), hand_params))}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


@torch.no_grad()
def _average(model):
    for p in model.parameters():
        dist.all_reduce(p.data)
        p.data /= dist.get_world_size()


class _Crops(Dataset):
    """In-worker randomness, as a random crop draws it."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        return {"index": i, "crop": torch.rand(()), "base_seed": info.seed - info.id}


def worker_seed_run():
    """The worker base seed each rank's workers get, and what one plain torch process draws after
    the same seed."""
    torch.manual_seed(1234)
    expected = int(torch.empty((), dtype=torch.int64).random_().item())
    torch.manual_seed(1234)
    acc = Accelerator()
    loader = acc.prepare(DataLoader(_Crops(), batch_size=2, shuffle=True, num_workers=2))
    batches = list(loader)
    return {"expected_base_seed": expected,
            "base_seeds": sorted({int(s) for b in batches for s in b["base_seed"].tolist()}),
            "samples": sorted(int(i) for b in batches for i in b["index"].tolist())}


def fsdp_state_dict_config_run(out_dir):
    """The fsdp_with_peak_mem_tracking example's plugin: Full* configs choose full checkpoints."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig

    plugin = FullyShardedDataParallelPlugin(
        state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False))
    acc = Accelerator(fsdp_plugin=plugin)
    model = acc.prepare(_model())
    optimizer = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    acc.backward(model(torch.randn(4, 16)).sum())
    optimizer.step()
    where = acc.save_state(os.path.join(out_dir, "fsdp_full"))
    with open(os.path.join(where, "anyaccel_checkpoint.json")) as f:
        manifest = json.load(f)
    return {"distributed_type": str(acc.distributed_type), "checkpoint_format": manifest.get("checkpoint_format"),
            "plugin_state_dict_type": plugin.state_dict_type, "files": sorted(os.listdir(where))}


def main():
    out_dir = sys.argv[1]
    acc = Accelerator()
    rank, world = acc.process_index, acc.num_processes
    results = {"hooks": {}}
    for name, hook, wrapper, option in (
            ("fp16", DDPCommunicationHookType.FP16, "no", None),
            ("power_sgd", "power_sgd", "no", {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}),
            ("power_sgd+fp16", "power_sgd", DDPCommunicationHookType.FP16,
             {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}),
            ("no", "no", "no", None)):
        results["hooks"][name] = comm_hook_run(rank, world, hook, wrapper, option)
    try:  # torch allows bf16 compression only with CUDA 11 + NCCL 2.10 (or XPU): elsewhere a clear error
        results["hooks"]["bf16"] = comm_hook_run(rank, world, "bf16")
    except ValueError as exc:
        results["hooks"]["bf16"] = {"error": str(exc)}
    try:  # torch 2.13's batched hook fails at its first compressed step: refused at prepare, saying so
        results["hooks"]["batched_power_sgd"] = comm_hook_run(
            rank, world, DDPCommunicationHookType.BATCHED_POWER_SGD, "no",
            {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2})
    except ValueError as exc:
        results["hooks"]["batched_power_sgd"] = {"error": str(exc)}
    results["local_sgd"] = local_sgd_run(rank, world)
    results["local_sgd_disabled"] = local_sgd_run(rank, world, enabled=False)
    results["worker_seeds"] = worker_seed_run()
    results["fsdp"] = fsdp_state_dict_config_run(out_dir)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    acc.end_training()


if __name__ == "__main__":
    main()
