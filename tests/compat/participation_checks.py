"""Worker for tests/compat/test_diffusers_shapes_multiprocess.py: who calls save_state/load_state when the
processes' counts differ (``anyaccel launch --num_processes 3 --cpu participation_checks.py OUT``),
all in one job of three DDP processes. Each case must neither end the job nor save alone what every
process saves, and a save on the main process alone must write what a save on every process writes
at the same point:

1. loaders with ``even_batches=False`` (the processes run different numbers of batches and
   ``backward`` calls, local ones), then an evaluation on the main process alone
   (more batches there), then ``save_state`` on every process (the main process comes last);
2. one late process of three (it runs batches of its own first), ``save_state`` on every process,
   then on the main process alone at the same point;
3. gradient accumulation: ``save_state`` between two micro-steps, on every process and on the main
   process alone; ``load_state`` on the main process alone is refused there (the replicas would
   train apart), and training goes on in step;
4. the hang doctor: processes 1 and 2 ask where everyone is at the same moment; both are answered.

Every process prints ``CASE <name> <rank> ok`` per case; the test reads them and the checkpoints.
"""

import json
import os
import sys
import time

import torch

from anyaccel import Accelerator, doctor
from anyaccel.errors import CheckpointError
from anyaccel.utils import DataLoaderConfiguration

out = sys.argv[1]
acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=False))
rank, world = acc.process_index, acc.num_processes
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
# 19 samples, batches of 2: 10 batches, so ranks 0, 1, 2 run 4, 3, 3 of them
uneven = torch.utils.data.DataLoader(torch.randn(19, 4, generator=torch.Generator().manual_seed(1)), batch_size=2)
even = torch.utils.data.DataLoader(torch.randn(48, 4, generator=torch.Generator().manual_seed(2)), batch_size=2)
model, optimizer, uneven, even = acc.prepare(model, optimizer, uneven, even)


def step(batch):
    acc.backward(model(batch).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()


def same_weights_everywhere(case):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = acc.gather(flat.unsqueeze(0))
    assert all(torch.equal(rows[0], row) for row in rows), f"{case}: the replicas differ"


def done(case):
    same_weights_everywhere(case)
    print(f"CASE {case} {rank} ok", flush=True)


# 1. uneven loaders, an evaluation on the main process alone, then save_state on every process
for batch in uneven:  # 4, 3, 3 batches and backward calls (local: DDP cannot all-reduce uneven steps)
    with acc.no_sync(model):
        acc.backward(model(batch).pow(2).mean())
optimizer.zero_grad()
if acc.is_main_process:  # main-only evaluation: more batches here, no collective
    with torch.no_grad():
        for _ in range(2):
            for batch in uneven:
                acc.unwrap_model(model)(batch)  # (the DDP wrapper's forward may be collective)
    time.sleep(1.5)  # the others arrive first and wait
acc.save_state(os.path.join(out, "uneven"))
done("uneven")

# 2. a late process of three, then the main process alone at the same point
if rank == world - 1:
    for batch in even:  # its own batches first (more than anyone's)
        pass
    time.sleep(2.5)
acc.save_state(os.path.join(out, "late"))
if acc.is_main_process:
    acc.save_state(os.path.join(out, "late-main-only"))
for batch in even:
    step(batch)
    break
done("late")

# 3. gradient accumulation: saves between micro-steps
acc.gradient_accumulation_steps = 2
for i, batch in enumerate(even):
    with acc.accumulate(model):
        step(batch)
    if i == 2:  # after a local micro-step (the group's first)
        assert not acc.sync_gradients
        acc.save_state(os.path.join(out, "micro"))
        if acc.is_main_process:
            acc.save_state(os.path.join(out, "micro-main-only"))
    if i == 4 and acc.is_main_process:
        try:
            acc.load_state(os.path.join(out, "micro"))
            print("MAIN-ONLY LOAD NOT REFUSED", flush=True)
        except CheckpointError as exc:
            print(f"MAIN-ONLY LOAD REFUSED: {exc}", flush=True)
    if i == 7:
        break
done("accumulation")

# 4. two processes ask the hang doctor at once: both get every process's answer
found = doctor.current()
acc.wait_for_everyone()
if rank in (1, 2):
    generation = found.ask()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len([s for s in found.answers(generation).values()
                                               if not s.get("missing")]) < world:
        time.sleep(0.05)
    answered = sorted(r for r, s in found.answers(generation).items() if not s.get("missing"))
    print(f"ASKED {rank} {json.dumps({'generation': generation, 'answered': answered})}", flush=True)
acc.wait_for_everyone()
done("ask")
acc.end_training()
