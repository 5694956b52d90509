"""Checkpoint the whole training state and resume exactly where a run stopped — mid-epoch included.

``accelerator.save_state()`` writes model, optimizer, scheduler, fp16 scaler, every process's RNG
state, objects given to ``register_for_checkpointing`` *and the data loaders' positions*;
``accelerator.load_state()`` puts all of them back. A run that is stopped and resumed ends with
the same weights as one that never stopped (this example prints a checksum to compare)::

    # first run: checkpoints every 10 steps under outputs/resume/checkpoints/checkpoint_<n>;
    # --stop_after_step simulates a job killed by the scheduler
    python -m torch.distributed.run --nproc_per_node 2 examples/resume_from_checkpoint.py --stop_after_step 25
    # second run: picks up the newest complete checkpoint (step 20) and finishes
    python -m torch.distributed.run --nproc_per_node 2 examples/resume_from_checkpoint.py --resume_from_checkpoint latest

Compared with the Hugging Face Accelerate example (``checkpointing/`` in its repository)::

    # before (Accelerate)                                   # after (anyaccel)
    accelerator.load_state(path)                            accelerator.load_state(path)
    path = os.path.basename(path)                           (step counter saved with register_for_checkpointing)
    training_difference = os.path.splitext(path)[0]
    if "epoch" in training_difference: ...
    resume_step = int(training_difference.replace("step_", ""))
    starting_epoch = resume_step // len(train_dataloader)   starting_epoch, resume_step = divmod(progress.step, len(train_loader))
    active = accelerator.skip_first_batches(                accelerator.skip_first_batches(train_loader, resume_step)
        train_dataloader, resume_step)                      # optional here: load_state already restored the
                                                            # loader position; this sets the same position

``save_state`` writes into a temporary sibling directory and renames it into place when every
process has finished, so a job killed during a save leaves the previous checkpoint loadable; with
``total_limit`` only the newest checkpoints are kept. Every process must call ``save_state`` and
``load_state`` (never under ``if accelerator.is_main_process``).
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


class TrainingProgress:
    """How many training batches have been done (saved with the checkpoint)."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = int(state["step"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, epochs=3, batch_size=16, lr=0.05, max_steps=False)
    parser.add_argument("--checkpointing_steps", default="10",
                        help="save every N batches, or 'epoch' to save at the end of each epoch")
    parser.add_argument("--total_limit", type=int, default=2, help="keep only the newest N checkpoints")
    parser.add_argument("--resume_from_checkpoint", default=None,
                        help="a checkpoint directory, or 'latest' for the newest under --output_dir")
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
    progress = TrainingProgress()

    model, optimizer, train_loader, test_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, test_loader, scheduler)
    accelerator.register_for_checkpointing(progress)

    starting_epoch = resume_step = 0
    if args.resume_from_checkpoint:
        # Same objects prepared in the same order as in the run that saved it, then load.
        path = None if args.resume_from_checkpoint == "latest" else args.resume_from_checkpoint
        loaded = accelerator.load_state(path)
        starting_epoch, resume_step = divmod(progress.step, len(train_loader))
        accelerator.skip_first_batches(train_loader, resume_step)
        accelerator.print(f"resumed from {loaded}: epoch {starting_epoch}, skipping the {resume_step} batches "
                          f"of it already done (step {progress.step})")

    every = None if args.checkpointing_steps == "epoch" else int(args.checkpointing_steps)
    for epoch in range(starting_epoch, args.epochs):
        model.train()
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            progress.step += 1
            if every and progress.step % every == 0:
                saved = accelerator.save_state()  # collective: every rank calls it
                accelerator.print(f"step {progress.step}: saved {saved}")
            if args.stop_after_step is not None and progress.step >= args.stop_after_step:
                accelerator.print(f"stopping after step {progress.step} (simulated interruption)")
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
                          f"step {progress.step}")

    accelerator.print(f"finished at step {progress.step}; weights checksum "
                      f"{param_checksum(accelerator.unwrap_model(model)):.10f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
