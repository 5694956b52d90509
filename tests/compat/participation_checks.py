"""Worker for tests/compat/test_diffusers_shapes_multiprocess.py: who calls save_state/load_state when the
processes' counts differ (``anyaccel launch --num_processes 3 --cpu participation_checks.py OUT``),
all in one job of three DDP processes. Each case must neither end the job nor save alone what every
process saves, and a save on the main process alone must write what a save on every process writes
at the same point:

1. loaders with ``even_batches=False`` (the processes run different numbers of batches and
   ``backward`` calls, local ones), then an evaluation on the main process alone
   (more batches there), then ``save_state`` on every process (the main process comes last);
2. one late process of three (it runs batches of its own first), ``save_state`` on every process,
   then on the main process alone at the same point (the others wait in their next forward, where
   DDP broadcasts the model's buffer);
3. gradient accumulation: ``save_state`` between two micro-steps, on every process and on the main
   process alone; then ``load_state`` on the main process alone, twice, between micro-steps (as
   under Accelerate with DDP: it loads there — the checkpoint's weights and process 0's RNG — warns
   once, and keeps its place in the accumulation group; a load pre-hook calling a collective
   raises ``CheckpointError`` there) while the others go on into the next
   synchronising ``backward``: nobody waits, the others' weights stay theirs, and the replicas
   stay apart by what the load changed until ``load_state`` on every process brings them together;
4. ``resume()`` on the main process alone raises ``CheckpointError`` (nobody waits); the hang
   doctor: processes 1 and 2 ask where everyone is at the same moment; both are answered.

Every process prints ``CASE <name> <rank> ok`` per case; the test reads them and the checkpoints.
"""

import json
import os
import sys
import time
import warnings

import torch

from anyaccel import Accelerator, doctor
from anyaccel.checkpoint.serialize import load_model_file
from anyaccel.errors import CheckpointError
from anyaccel.utils import DataLoaderConfiguration

out = sys.argv[1]
acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=False))
rank, world = acc.process_index, acc.num_processes
torch.manual_seed(0)


class Scaled(torch.nn.Module):
    """A linear model with a buffer: DDP broadcasts it from rank 0 in the forward after a training step."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x):
        return self.linear(x) * self.scale


model = Scaled()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
# 19 samples, batches of 2: 10 batches, so ranks 0, 1, 2 run 4, 3, 3 of them
uneven = torch.utils.data.DataLoader(torch.randn(19, 4, generator=torch.Generator().manual_seed(1)), batch_size=2)
even = torch.utils.data.DataLoader(torch.randn(48, 4, generator=torch.Generator().manual_seed(2)), batch_size=2)
model, optimizer, uneven, even = acc.prepare(model, optimizer, uneven, even)


def step(batch):
    acc.backward(model(batch).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()


def flat():
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def same_weights_everywhere(case):
    rows = acc.gather(flat().unsqueeze(0))
    assert all(torch.equal(rows[0], row) for row in rows), f"{case}: the replicas differ"


def load_on_the_main_process_alone(directory):
    """``load_state`` twice under ``if accelerator.is_main_process:``; returns what it changed here."""
    before, micro_step = flat(), acc.gradient_state.micro_step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state(directory)
        acc.load_state(directory)
    alone = [str(w.message) for w in caught if "called by the main process alone" in str(w.message)]
    hook_calls_a_collective.append(True)  # a load pre-hook that calls one: an error, never a wait
    try:
        acc.load_state(directory)
        refused = None
    except CheckpointError as exc:
        refused = str(exc)[:200]
    hook_calls_a_collective.clear()
    saved = load_model_file(directory, "model")
    facts = {"warnings": len(alone), "first": alone[0][:300] if alone else None,
             "weights_loaded": all(torch.equal(v, saved[k]) for k, v in acc.unwrap_model(model).state_dict().items()),
             "rng_restored": torch.equal(torch.get_rng_state(),
                                         torch.load(os.path.join(directory, "random_states_0.pkl"))["torch"]),
             "micro_step_kept": acc.gradient_state.micro_step == micro_step != 0, "hook_refused": refused}
    print(f"MAIN-ONLY LOAD {json.dumps(facts)}", flush=True)
    return flat() - before


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
for batch in even:  # a synchronising step: the next forward of the DDP model broadcasts its buffer (a collective)
    step(batch)
    break
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
hook_calls_a_collective = []
acc.register_load_state_pre_hook(lambda models, directory: acc.wait_for_everyone() if hook_calls_a_collective else None)
acc.gradient_accumulation_steps = 2
for i, batch in enumerate(even):
    with acc.accumulate(model):
        step(batch)
    if i == 2:  # after a local micro-step (the group's first)
        assert not acc.sync_gradients
        acc.save_state(os.path.join(out, "micro"))
        if acc.is_main_process:
            acc.save_state(os.path.join(out, "micro-main-only"))
    if i == 4:  # a local micro-step: the main process loads alone, the others go on into the sync of i == 5
        changed = load_on_the_main_process_alone(os.path.join(out, "micro")) if acc.is_main_process else None
    if i == 7:
        break
# each sync applied the same averaged gradients to every replica: they differ by what the load changed
n = changed.numel() if changed is not None else flat().numel()
rows = acc.gather(torch.cat([flat(), changed if changed is not None else torch.zeros(n)]).unsqueeze(0))
apart = {"others_equal": torch.equal(rows[1], rows[2]), "main_differs": not torch.equal(rows[0][:n], rows[1][:n]),
         "by_the_load": torch.allclose(rows[0][:n] - rows[1][:n], rows[0][n:], atol=1e-6)}
print(f"APART {rank} {json.dumps(apart)}", flush=True)
acc.load_state(os.path.join(out, "micro"))  # on every process: the replicas are one again
done("accumulation")

# 4. two processes ask the hang doctor at once: both get every process's answer
found = doctor.current()
acc.wait_for_everyone()
if acc.is_main_process:  # resume() on the main process alone: one error once the others are in the barrier
    try:
        acc.resume(os.path.join(out, "micro"))
        print("MAIN-ONLY RESUME NOT REFUSED", flush=True)
    except CheckpointError as exc:
        print(f"MAIN-ONLY RESUME REFUSED: {exc}", flush=True)
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
