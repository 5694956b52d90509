"""Run with 4 processes (anyaccel launch --num_processes 4 --cpu): the rest of the training loop
under N-D parallelism, each checked against the same training in one process (rank 0 runs it).

    python nd_more_checks.py OUT_DIR LAYOUT [LAYOUT ...]

LAYOUT:
  loop  TP2 x DP2 with gradient accumulation (2 micro-batches), an LR scheduler, torch.compile
        (backend "eager": Dynamo's frames are counted, no inductor needed) and reduce
  tp4   tensor parallel over all 4 processes; parameter and optimizer bytes per rank
  bf16  TP2 x DP2 with mixed_precision="bf16" (CPU autocast; FSDP2 computes in bf16)

The layouts run one after the other in one job (a launch of 4 processes costs ~25 CPU-s; a layout's
training well under one), each with its own ``Accelerator`` on the job's process group, ended with
``end_training()`` (which keeps the group for the next one). Each rank writes
OUT_DIR/<layout>_rank<r>.json.
"""

import copy
import functools
import os
import sys
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

from anyaccel import Accelerator, ParallelismConfig, set_seed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))  # tiny_models
import rank_results  # noqa: E402
import tiny_models  # noqa: E402
from anyaccel.strategies.compile import dynamo_counts

WIDTH, STEPS, BATCH, LR, GAMMA = 32, 4, 4, 0.05, 0.8

# The model (tests/scripts/tiny_models.py): 2 blocks whose fc1 doubles the width (TP cuts it).
Net = functools.partial(tiny_models.Net, width=WIDTH, blocks=2, hidden=2 * WIDTH)

PLAN = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}
SIZES = {"tp4": dict(tp_size=4), "loop": dict(dp_shard_size=2, tp_size=2), "bf16": dict(dp_shard_size=2, tp_size=2)}


def optimizer_for(m):
    return torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9)


def local_bytes(tensors):
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


def train(accelerator, layout, model, optimizer, loader, scheduler):
    """The prepared training loop: losses gathered over the job, what ``reduce`` returned, the dtypes
    the first TP layer computed in."""
    losses, reduced, dtypes = [], [], set()
    # the dtype the first TP layer computes in (the prepared model's output is fp32 again, as in Accelerate)
    if layout == "bf16":  # (a hook with a side effect would break the compiled graph of "loop")
        accelerator.unwrap_model(model).blocks[0].fc1.register_forward_hook(lambda m, i, o: dtypes.add(str(o.dtype)))
    for xb, yb in loader:
        with accelerator.accumulate(model):
            pred = model(xb)
            per_sample = (pred.float() - yb).pow(2).mean(1)
            accelerator.backward(per_sample.mean())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        every = accelerator.gather_for_metrics(per_sample.detach())
        losses.append(every.mean().item())
        # reduce: each data-parallel sample once (TP ranks hold the same batch); the mean of the dp ranks' values
        count = accelerator.reduce(torch.tensor([len(xb)]), "sum")
        mean = accelerator.reduce(torch.tensor([float(accelerator.data_parallel_shard_rank)]), "mean")
        biggest = accelerator.reduce(torch.tensor([float(accelerator.process_index)]), "max")
        reduced.append([int(count), float(mean), float(biggest)])
    return losses, reduced, dtypes


def one_process(layout, reference, x, y, dp, accumulate, state):
    """Rank 0: the same training in one process; each optimizer step sees every dp rank's micro-batches."""
    ref_opt = optimizer_for(reference)
    # stepped dp times per optimizer step in the job: here once per step, with the same lr
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda step: GAMMA ** (dp * step))
    ref_losses = []
    for xb, yb in DataLoader(TensorDataset(x, y), batch_size=BATCH * dp * accumulate):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=layout == "bf16"):
            per_sample = (reference(xb).float() - yb).pow(2).mean(1)
        per_sample.mean().backward()
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()
        ref_losses += [t.mean().item() for t in per_sample.detach().chunk(accumulate)]
    expected = reference.state_dict()
    return dict(ref_losses=ref_losses, ref_lr=ref_sched.get_last_lr()[0], same_keys=sorted(state) == sorted(expected),
                max_weight_diff=max(float((state[k].float() - expected[k]).abs().max()) for k in expected),
                full_shapes={k: list(v.shape) for k, v in expected.items()})


def check(layout):
    """One layout, from ``Accelerator(...)`` to ``end_training()``: what this rank writes."""
    accumulate = 2 if layout == "loop" else 1
    accelerator = Accelerator(parallelism_config=ParallelismConfig(**SIZES[layout], tp_plan=PLAN),
                              gradient_accumulation_steps=accumulate,
                              mixed_precision="bf16" if layout == "bf16" else "no",
                              dynamo_backend="eager" if layout == "loop" else None)
    dp = accelerator.parallelism_config.data_parallel_size
    set_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    n = STEPS * accumulate * BATCH * dp
    x, y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)
    optimizer = optimizer_for(model)
    # Accelerate's rule: a prepared scheduler steps once per data-parallel process per optimizer step
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: GAMMA ** step)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH)
    frames_before = dynamo_counts()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        losses, reduced, dtypes = train(accelerator, layout, model, optimizer, loader, scheduler)
    frames_after = dynamo_counts()
    state = accelerator.get_state_dict(model)
    opt_state = [v for s in optimizer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    result = {
        "layout": layout, "mesh_dims": list(accelerator.torch_device_mesh.mesh_dim_names),
        "mesh_shape": list(accelerator.torch_device_mesh.shape), "dp": dp,
        "tp_rank": accelerator.tensor_parallel_rank, "losses": losses, "reduced": reduced, "dtypes": sorted(dtypes),
        "scheduler_steps": scheduler.scheduler.last_epoch, "lr": scheduler.get_last_lr()[0],
        "frames": frames_after[0] - frames_before[0], "graphs": frames_after[1] - frames_before[1],
        "warnings": [str(w.message) for w in caught if issubclass(w.category, UserWarning)],
        "param_bytes": local_bytes(list(model.parameters())), "optimizer_bytes": local_bytes(opt_state),
        "full_param_bytes": sum(p.numel() * p.element_size() for p in reference.parameters()),
        "param_shapes": {k: list((v.to_local() if hasattr(v, "to_local") else v).shape)
                         for k, v in accelerator.unwrap_model(model).state_dict().items()},
    }
    if accelerator.is_main_process:
        result.update(one_process(layout, reference, x, y, dp, accumulate, state))
    accelerator.end_training()
    return accelerator.process_index, result


if __name__ == "__main__":
    rank_results.run_layouts(check)
