"""Run with 2 processes (``anyaccel launch --num_processes 2 --cpu``): the Accelerate-compatible API.

Rank r writes <outdir>/rank<r>.json with what it observed; tests/compat/test_compat_api_multiprocess.py asserts on it.
"""

import json
import os
import sys

import torch

from anyaccel import utils
from anyaccel.state import PartialState

out_dir = sys.argv[1]
results = {}

# 1. PartialState before any Accelerator: resolves the job and joins the group
state = PartialState()
results["partial"] = [state.num_processes, state.process_index, str(state.device), state.distributed_type.value]
results["gather_before_accelerator"] = utils.gather(torch.tensor([state.process_index])).tolist()
param = torch.nn.Parameter(torch.full((2,), float(state.process_index)))  # requires grad: gathers must detach
results["gather_parameter"] = [utils.gather(param[None]).tolist(), utils.gather({"a": param, "b": param[:1]})["b"].tolist()]

from anyaccel import Accelerator, GradientAccumulationPlugin  # noqa: E402
from anyaccel.kwargs import ProfileKwargs  # noqa: E402

acc = Accelerator()
results["state"] = [acc.state.num_processes, acc.state.process_index, acc.state.distributed_type.value]

# 2. defaults: utils.reduce averages (accelerate.utils), Accelerator.reduce sums (Accelerate's method)
x = torch.tensor([1.0 + 2 * acc.process_index])  # 1 on rank 0, 3 on rank 1
results["reduce"] = {"utils_default": utils.reduce(x).item(), "method_default": acc.reduce(x).item(),
                     "max": utils.reduce(x, "max").item(), "min": utils.reduce(x, "min").item()}

# 3. join_uneven_inputs: rank 0 runs 3 DDP steps, rank 1 only 1, on gloo; nobody hangs
torch.manual_seed(0)
model = acc.prepare(torch.nn.Linear(2, 1))
steps = 3 if acc.process_index == 0 else 1
with acc.join_uneven_inputs([model]):
    for _ in range(steps):
        model(torch.ones(4, 2)).sum().backward()
results["join_steps"] = steps
acc.wait_for_everyone()


# 4. sync_each_batch: gradients are all-reduced on every micro-step (equal on both ranks)
def first_micro_step_grads(sync_each_batch):
    a = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_each_batch=sync_each_batch))
    torch.manual_seed(0)
    m = a.prepare(torch.nn.Linear(2, 1))
    with a.accumulate(m):
        a.backward(m(torch.full((3, 2), float(a.process_index + 1))).sum())
    return utils.gather(m.module.weight.grad.detach().reshape(1, -1)).tolist(), a.sync_gradients


results["sync_each_batch"] = first_micro_step_grads(True)
results["no_sync_each_batch"] = first_micro_step_grads(False)

# 5. trigger_sync_in_backward: two forwards under no_sync, the second backward syncs
torch.manual_seed(0)
m = acc.prepare(torch.nn.Linear(2, 1))
with acc.no_sync(m):
    loss_a = m(torch.full((3, 2), float(acc.process_index + 1))).sum()
    loss_b = m(torch.full((3, 2), float(acc.process_index + 5))).sum()
acc.backward(loss_a)
with acc.trigger_sync_in_backward(m):
    acc.backward(loss_b)
results["trigger_sync"] = utils.gather(m.module.weight.grad.detach().reshape(1, -1)).tolist()

# 6. RNG synchronisation and a tensor that only rank 0 has
torch.manual_seed(100 + acc.process_index)
utils.synchronize_rng_states(["torch"])
results["rng_after_sync"] = torch.rand(2).tolist()
torch.manual_seed(200 + acc.process_index)
from anyaccel.utils.dataclasses import RNGType  # noqa: E402  (Accelerate's module paths)
from anyaccel.utils.random import synchronize_rng_state  # noqa: E402

synchronize_rng_state()  # Accelerate's default: torch's generator
results["rng_after_default_sync"] = torch.rand(2).tolist()
torch.manual_seed(300 + acc.process_index)
synchronize_rng_state(RNGType.TORCH)
results["rng_after_enum_sync"] = torch.rand(2).tolist()
results["copied"] = utils.copy_tensor_to_devices(torch.arange(3) if acc.is_main_process else None).tolist()

# 7. decorators and file writers: who runs
results["on_last"] = acc.on_last_process(lambda: acc.process_index)()
results["on_local"] = acc.on_local_process(lambda: acc.process_index, local_process_index=1)()
utils.save({"rank": acc.process_index}, os.path.join(out_dir, "saved.pt"))
with acc.profile(ProfileKwargs(output_trace_dir=os.path.join(out_dir, "traces"))):
    torch.ones(8, 8) @ torch.ones(8, 8)
acc.wait_for_everyone()
results["traces"] = sorted(os.listdir(os.path.join(out_dir, "traces")))
results["saved"] = torch.load(os.path.join(out_dir, "saved.pt"))["rank"]

with open(os.path.join(out_dir, f"rank{acc.process_index}.json"), "w") as f:
    json.dump(results, f)
acc.end_training()
