"""Run by tests/strategies/nd/test_nd_more_multiprocess.py: a plain ``Accelerator()`` whose N-D sizes come from the launch
flags (``--parallelism_config_tp_size 2``), trained until the launcher is sent SIGTERM, which must
make every rank save a checkpoint and exit 75 as without N-D.

    anyaccel launch --num_processes 2 --cpu --parallelism_config_tp_size 2 nd_preempt.py PROJECT MARKER
"""

import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from anyaccel import Accelerator, ProjectConfiguration, set_seed

project, marker = sys.argv[1], sys.argv[2]
accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True))
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
model._tp_plan = {"0": "colwise", "2": "rowwise"}  # the model's own plan, as transformers models carry one
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = TensorDataset(torch.randn(4000, 8, generator=torch.Generator().manual_seed(0)))
model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4))
print(f"rank {accelerator.process_index}: strategy {accelerator.strategy.name}, tp rank "
      f"{accelerator.tensor_parallel_rank}, local fc0 {tuple(model[0].weight.to_local().shape)}", flush=True)
start = accelerator.resume()
for step, (x,) in enumerate(loader, start=start.step):
    accelerator.backward(model(x).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
    if step == 3 and accelerator.is_main_process:
        open(marker, "w").close()
    time.sleep(0.1)
print("never preempted", flush=True)
sys.exit(3)
