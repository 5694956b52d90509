"""Checkpoint the whole training state and resume exactly where a run stopped — mid-epoch included.

``accelerator.save_state()`` writes model, optimizer, scheduler, fp16 scaler, every process's RNG
state, objects given to ``register_for_checkpointing`` *and the data loaders' positions*;
``accelerator.resume()`` finds the newest complete checkpoint, puts all of them back and says
which epoch and step the run is at. Starting the same command again is all a stopped run needs —
whether it was killed, restarted by ``anyaccel launch --max_restarts``, or preempted (SIGTERM or
SLURM's SIGUSR1 make every rank save at the same step and exit 75 by themselves). A resumed run
ends with the same weights as one that never stopped (this example prints a checksum)::

    # first run: checkpoints every 10 steps under outputs/resume/checkpoints/checkpoint_<n>;
    # --stop_after_step simulates a job killed by the scheduler
    anyaccel launch --num_processes 2 --cpu examples/resume_from_checkpoint.py --stop_after_step 25
    # the same command again continues from the newest checkpoint (step 20) and finishes
    anyaccel launch --num_processes 2 --cpu examples/resume_from_checkpoint.py

Compared with the Hugging Face Accelerate example (``checkpointing/`` in its repository)::

    # before (Accelerate)                                   # after (anyaccel)
    accelerator.load_state(path)                            start = accelerator.resume()
    path = os.path.basename(path)
    training_difference = os.path.splitext(path)[0]
    if "epoch" in training_difference: ...
    resume_step = int(training_difference.replace("step_", ""))
    starting_epoch = resume_step // len(train_dataloader)
    active = accelerator.skip_first_batches(
        train_dataloader, resume_step)
    for epoch in range(starting_epoch, epochs):             for epoch in range(start.epoch, epochs):

``save_state`` writes into a temporary sibling directory and renames it into place when every
process has finished, so a job killed during a save leaves the previous checkpoint loadable; with
``total_limit`` only the newest checkpoints are kept. Every process must call ``save_state`` and
``resume`` (never under ``if accelerator.is_main_process``).
"""

import argparse
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SmallCNN, add_common_args, image_datasets, param_checksum  # noqa: E402

from anyaccel import Accelerator, ProjectConfiguration, set_seed  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, epochs=3, batch_size=16, lr=0.05, max_steps=False)
    parser.add_argument("--checkpointing_steps", default="10",
                        help="save every N batches, or 'epoch' to save at the end of each epoch")
    parser.add_argument("--total_limit", type=int, default=2, help="keep only the newest N checkpoints")
    parser.add_argument("--stop_after_step", type=int, default=None,
                        help="exit after this many batches (simulates an interrupted job)")
    parser.set_defaults(output_dir="outputs/resume")
    args = parser.parse_args()

    config = ProjectConfiguration(project_dir=args.output_dir, automatic_checkpoint_naming=True,
                                  total_limit=args.total_limit)
    accelerator = Accelerator(project_config=config, mixed_precision=args.mixed_precision)
    set_seed(args.seed)

    train_set, test_set, num_classes = image_datasets("cifar10", args.data, 16, 3, print_fn=accelerator.print,
                                                      limit=args.limit)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=64)
    model = SmallCNN(3, num_classes, width=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)  # stepped per batch
    criterion = nn.CrossEntropyLoss()

    model, optimizer, train_loader, test_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, test_loader, scheduler)
    start = accelerator.resume()  # the newest complete checkpoint, if any: weights, optimizer, ..., loader position
    if start.checkpoint:
        accelerator.print(f"resumed from {start.checkpoint}: epoch {start.epoch}, step {start.step}")
    step = start.step

    every = None if args.checkpointing_steps == "epoch" else int(args.checkpointing_steps)
    for epoch in range(start.epoch, args.epochs):
        model.train()
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            step += 1
            if every and step % every == 0:
                saved = accelerator.save_state()  # collective: every rank calls it
                accelerator.print(f"step {step}: saved {saved}")
            if args.stop_after_step is not None and step >= args.stop_after_step:
                accelerator.print(f"stopping after step {step} (simulated interruption)")
                accelerator.end_training()
                return
        if every is None:
            saved = accelerator.save_state()
            accelerator.print(f"end of epoch {epoch}: saved {saved}")

        model.eval()
        correct = total = 0
        for x, y in test_loader:
            with torch.no_grad():
                pred = model(x).argmax(dim=1)
            pred, y = accelerator.gather_for_metrics((pred, y))
            correct += (pred == y).sum().item()
            total += y.numel()
        accelerator.print(f"epoch {epoch}: loss {loss.item():.4f}, test accuracy {correct / total:.4f}, "
                          f"step {step}")

    accelerator.print(f"finished at step {step}; weights checksum "
                      f"{param_checksum(accelerator.unwrap_model(model)):.10f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
