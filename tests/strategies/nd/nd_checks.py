"""Run with 4 processes (anyaccel launch --num_processes 4 --cpu): N-D parallelism on CPU/gloo,
checked against the same training in one process (computed on rank 0, in this script).

    python nd_checks.py OUT_DIR LAYOUT [LAYOUT ...]        # LAYOUT: tp2dp2 | hsdp

The layouts run one after the other in one job (a launch of 4 processes costs ~25 CPU-s, a layout's
training well under one), each with its own ``Accelerator`` on the job's process group, ended with
``end_training()`` (which keeps the group for the next one). Each rank writes
OUT_DIR/<layout>_rank<r>.json.
"""

import copy
import functools
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from anyaccel import Accelerator, ParallelismConfig, set_seed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))  # tiny_models
import rank_results  # noqa: E402
import tiny_models  # noqa: E402

WIDTH, STEPS, BATCH, MAX_NORM = 32, 6, 4, 0.5


# The model (tests/scripts/tiny_models.py): 2 blocks whose fc1 doubles the width (TP cuts it).
Net = functools.partial(tiny_models.Net, width=WIDTH, blocks=2, hidden=2 * WIDTH)

PLAN = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}
CONFIGS = {"tp2dp2": dict(dp_shard_size=2, tp_size=2, tp_plan=PLAN), "hsdp": dict(dp_replicate_size=2, dp_shard_size=2)}


def optimizer_for(m):
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)


def one_process(reference, x, y, dp, state):
    """Rank 0: the same training in one process, one batch of BATCH * dp per step."""
    ref_opt = optimizer_for(reference)
    ref_losses, ref_norms = [], []
    for xb, yb in DataLoader(TensorDataset(x, y), batch_size=BATCH * dp):
        per_sample = (reference(xb) - yb).pow(2).mean(1)
        per_sample.mean().backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)))
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(per_sample.mean().item())
    expected = reference.state_dict()
    return dict(ref_losses=ref_losses, ref_norms=ref_norms, same_keys=sorted(state) == sorted(expected),
                max_weight_diff=max(float((state[k].float() - expected[k]).abs().max()) for k in expected))


def check(layout):
    """One layout, from ``Accelerator(...)`` to ``end_training()``: what this rank writes."""
    accelerator = Accelerator(parallelism_config=ParallelismConfig(**CONFIGS[layout]))
    dp = accelerator.parallelism_config.data_parallel_size
    set_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(STEPS * BATCH * dp, 8, generator=g), torch.randn(STEPS * BATCH * dp, 1, generator=g)
    # a different init on every rank: prepare must start all ranks from rank 0's weights
    if accelerator.process_index:
        torch.nn.init.normal_(model.inp.weight)
    optimizer = optimizer_for(model)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, norms, gathered = [], [], []
    for xb, yb in loader:
        per_sample = (model(xb) - yb).pow(2).mean(1)
        accelerator.backward(per_sample.mean())
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        every = accelerator.gather_for_metrics(per_sample.detach())
        gathered.append(len(every))
        losses.append(every.mean().item())
    state = accelerator.get_state_dict(model)
    mesh = accelerator.torch_device_mesh
    result = {
        "layout": layout, "strategy": accelerator.strategy.name, "distributed_type": accelerator.distributed_type.value,
        "mesh_dims": list(mesh.mesh_dim_names), "mesh_shape": list(mesh.shape), "mesh_ranks": mesh.mesh.tolist(),
        "ranks": {k: getattr(accelerator, k) for k in ("data_parallel_rank", "data_parallel_shard_rank",
                                                       "tensor_parallel_rank", "context_parallel_rank")},
        "batches": len(losses), "gathered": gathered, "losses": losses, "norms": norms,
        "local_param_numel": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                 for p in model.parameters()),
        "full_param_numel": sum(p.numel() for p in reference.parameters()),
    }
    if accelerator.is_main_process:
        result.update(one_process(reference, x, y, dp, state))
    accelerator.end_training()
    return accelerator.process_index, result


if __name__ == "__main__":
    rank_results.run_layouts(check)
