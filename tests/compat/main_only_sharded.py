"""Worker for tests/compat/test_diffusers_shapes_multiprocess.py: diffusers' checkpoint lines under FSDP2
(``anyaccel launch --num_processes 2 --cpu main_only_sharded.py OUT``), where the state is sharded
over both processes. A save on every process works; ``load_state`` on the main process alone
raises ``CheckpointError`` there (caught, training goes on in step), as ``save_state`` on process 1
alone does on process 1; then ``save_state`` on the main process alone raises, uncaught, and the job
ends — nobody waits."""

import os
import sys
import time

import torch

from anyaccel import Accelerator
from anyaccel.errors import CheckpointError

out = sys.argv[1]
accelerator = Accelerator(strategy="fsdp")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.SiLU(), torch.nn.Conv2d(8, 3, 3, padding=1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = torch.utils.data.DataLoader(torch.randn(32, 3, 8, 8), batch_size=2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

for step, batch in enumerate(loader):
    loss = torch.nn.functional.mse_loss(model(batch), batch)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    if step == 0:
        accelerator.save_state(os.path.join(out, "checkpoint-1"))  # every process: fine
        print(f"rank {accelerator.process_index} saved with every process", flush=True)
    if step == 1 and accelerator.is_main_process:
        try:
            accelerator.load_state(os.path.join(out, "checkpoint-1"))
        except CheckpointError as exc:
            print(f"MAIN-ONLY LOAD REFUSED: {exc}", flush=True)
    if step == 2 and accelerator.process_index == 1:  # no process but the main one can save alone
        try:
            accelerator.save_state(os.path.join(out, "checkpoint-by-1"))
        except CheckpointError as exc:
            print(f"OTHER-ONLY SAVE REFUSED: {exc}", flush=True)
    if step == 3 and accelerator.is_main_process:
        print(f"STARTED {time.time()}", flush=True)
        accelerator.save_state(os.path.join(out, f"checkpoint-{step}"))  # diffusers' line: raises here
        print("NOT REFUSED", flush=True)
accelerator.end_training()
