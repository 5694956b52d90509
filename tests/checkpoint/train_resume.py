"""Exact resume, on any number of processes (the test forks 2 from the warm launcher; torchrun or anyaccel launch work the same).

    train_resume.py full   OUT CKPT SAVE_AT [ACCUM] [PRECISION]
        trains EPOCHS epochs from seed 0, calls save_state(CKPT) right after global step SAVE_AT
        (mid-epoch), keeps going, writes the final weights to OUT/full.pt (rank 0)
    train_resume.py resume OUT CKPT - [ACCUM] [PRECISION]
        builds everything from a *different* seed, load_state(CKPT), skips the batches of the
        resumed epoch already done with skip_first_batches (transformers' no_trainer shape),
        finishes the run, writes OUT/resumed.pt (rank 0)

Both also write OUT/<mode>_rank<r>.json: steps taken, epochs seen, final learning rate, and a
draw from the RNG after training (it matches only if the RNG states were restored per process).
Model: MLP with dropout; Adam; StepLR; shuffled data.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))  # train_common
import rank_results  # noqa: E402
import train_common as tc  # noqa: E402

from anyaccel import Accelerator  # noqa: E402

EPOCHS = 3
mode, out, ckpt, save_at = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
accum = int(sys.argv[5]) if len(sys.argv) > 5 else 1
precision = sys.argv[6] if len(sys.argv) > 6 else "no"

acc = Accelerator(gradient_accumulation_steps=accum, mixed_precision=precision)
model, opt, loader, sched = tc.build(acc, seed=0 if mode == "full" else 99, n=60, batch_size=3)
torch.manual_seed((100 if mode == "full" else 200) + acc.process_index)  # distinct RNG streams per process
progress = tc.Progress()
acc.register_for_checkpointing(progress)
resume_step = None
if mode == "resume":
    acc.load_state(ckpt)  # the epoch, its order and the RNG states; not the loader's position
    resume_step = progress.step - progress.epoch * len(loader)

epochs_seen = []
while progress.epoch < EPOCHS:
    active = loader
    if resume_step is not None:  # transformers' no_trainer shape: skip the resumed epoch's batches done, once
        active, resume_step = acc.skip_first_batches(loader, resume_step), None
    for batch in active:
        tc.train_step(acc, model, opt, sched, batch)
        progress.step += 1
        if mode == "full" and progress.step == int(save_at):
            acc.save_state(ckpt)
    epochs_seen.append(loader.epoch)
    progress.epoch += 1

if acc.is_main_process:
    torch.save(tc.weights(acc, model), os.path.join(out, f"{mode if mode == 'full' else 'resumed'}.pt"))
    if mode == "full":  # called under `if is_main_process`: must not wait for the other ranks
        acc.save_model(model, os.path.join(out, "export"), max_shard_size="200B")
else:
    acc.save_model(model, os.path.join(out, "export_not_main"))  # other ranks: returns at once, writes nothing
rank_results.write(out, mode, acc.process_index,
                   {"steps": progress.step, "epochs": epochs_seen, "lr": sched.get_last_lr()[0],
                    "rng": torch.rand(1).item(), "scale": acc.scaler.get_scale() if acc.scaler else None})
acc.end_training()
