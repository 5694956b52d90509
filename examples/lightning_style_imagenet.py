"""ImageNet classification in the PyTorch Lightning style (DataModule + LightningModule), run by anyaccel.

Lightning users keep their structure: a DataModule that builds the loaders, a module with
``training_step``/``validation_step``/``configure_optimizers`` and ``self.log(...,
sync_dist=True)``. What Lightning's ``Trainer`` did is the short ``fit`` function below, so every
step of the loop is visible and yours to change::

    # before (Lightning)                                  # after (anyaccel)
    class DM(pl.LightningDataModule): ...                 class DM: ...                 (same methods)
    class Lit(pl.LightningModule): ...                    class Lit(nn.Module): ...     (same methods)
    self.log("train_loss", loss, sync_dist=True)          self.log("train_loss", loss, sync_dist=True)
                                                            # → accelerator.reduce(loss, "mean")
    trainer = pl.Trainer(accelerator="gpu", devices=2,    accelerator = Accelerator(log_with="csv")
                         strategy="ddp", max_epochs=90)
    trainer.fit(model, datamodule=dm)                     fit(accelerator, model, dm, epochs=90)
    python train.py        # Trainer spawns processes     anyaccel launch --num_processes 2 train.py
    srun python train.py   # under SLURM                  srun python train.py          (unchanged)

Metrics: per-step values logged with ``sync_dist=True`` are averaged over processes with
``accelerator.reduce`` (a collective: every rank logs the same names in the same order, as in
Lightning); epoch accuracy is computed exactly from ``gather_for_metrics`` (each validation sample
once, no padding duplicates). Everything logged goes to ``<output_dir>/<run>/metrics.csv``
(``--log_with tensorboard`` for TensorBoard) and to the progress bar.

Data: ``--data`` is an ImageNet-style folder (``train/<class>/*.JPEG``, ``val/<class>/*.JPEG``);
without it the bundled digits stand in, so the example runs offline::

    python -m torch.distributed.run --nproc_per_node 2 examples/lightning_style_imagenet.py --epochs 1
"""

import argparse
import os
import sys
from collections import defaultdict

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import add_common_args, image_datasets, vision_model  # noqa: E402

from anyaccel import Accelerator, set_seed  # noqa: E402


class ImageNetDataModule:
    """Was ``pl.LightningDataModule``: same ``setup`` / ``train_dataloader`` / ``val_dataloader``."""

    def __init__(self, data_dir, batch_size, workers, image_size, limit=None, print_fn=print, synthetic=False):
        self.data_dir, self.batch_size, self.workers = data_dir, batch_size, workers
        self.image_size, self.limit, self.print_fn, self.synthetic = image_size, limit, print_fn, synthetic

    def setup(self, stage=None):
        if hasattr(self, "train"):  # already set up
            return
        self.train, self.val, self.num_classes = image_datasets(
            "imagefolder", self.data_dir, self.image_size, 3, print_fn=self.print_fn, limit=self.limit,
            synthetic=self.synthetic)

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, num_workers=self.workers)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.batch_size, num_workers=self.workers)


def topk_correct(output, target, ks=(1, 5)):
    """Per-sample 0/1 hits for each k (so they can be gathered and averaged exactly)."""
    top = output.topk(max(ks), dim=1).indices
    hits = top.eq(target[:, None])
    return [hits[:, :k].any(dim=1).float() for k in ks]


class ImageNetLitModule(nn.Module):
    """Was ``pl.LightningModule``: same hooks; ``self.log`` is provided by ``fit`` below."""

    def __init__(self, arch, num_classes, lr, momentum=0.9, weight_decay=1e-4, print_fn=print):
        super().__init__()
        self.model = vision_model(arch, num_classes, 3, print_fn=print_fn)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.log = None  # set by fit(): log(name, value, sync_dist=False, prog_bar=False)

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        images, target = batch
        output = self.model(images)
        loss = nn.functional.cross_entropy(output, target)
        acc1, acc5 = topk_correct(output, target)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        self.log("train_acc1", acc1.mean(), sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        images, target = batch
        output = self.model(images)
        loss = nn.functional.cross_entropy(output, target, reduction="none")
        acc1, acc5 = topk_correct(output, target)
        # Lightning habit: self.log("val_loss", loss.mean(), sync_dist=True), averaged per epoch. That
        # mean of per-batch means counts the padding that evens out the last batches across ranks;
        # returning per-sample values lets fit() gather them and average each sample exactly once.
        return {"loss": loss, "acc1": acc1, "acc5": acc5}

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum,
                                    weight_decay=self.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.1 ** (epoch // 30))
        return optimizer, scheduler


def fit(accelerator, lit, dm, epochs, max_steps=None, log_every=1):
    """What ``Trainer.fit`` did: prepare, loop, log, validate. Every rank runs it."""
    dm.setup("fit")
    optimizer, scheduler = lit.configure_optimizers()  # scheduler: per epoch, stepped here (not prepared)
    # The inner network goes through prepare() (DDP wraps it); the hooks stay on `lit`.
    lit.model, optimizer, train_dl, val_dl = accelerator.prepare(
        lit.model, optimizer, dm.train_dataloader(), dm.val_dataloader())

    step_metrics = {}

    def log(name, value, sync_dist=False, prog_bar=False):
        value = value.detach() if torch.is_tensor(value) else torch.tensor(float(value), device=accelerator.device)
        if sync_dist:  # collective: all ranks log the same names in the same order
            value = accelerator.reduce(value, "mean")
        step_metrics[name] = (value, prog_bar)

    lit.log = log
    global_step = 0
    for epoch in range(epochs):
        lit.train()
        bar = accelerator.progress(train_dl, desc=f"epoch {epoch}")
        for batch_idx, batch in enumerate(bar):
            if max_steps is not None and batch_idx >= max_steps:
                break
            optimizer.zero_grad()
            loss = lit.training_step(batch, batch_idx)
            accelerator.backward(loss)
            optimizer.step()
            if global_step % log_every == 0:
                accelerator.log({k: v for k, (v, _) in step_metrics.items()}, step=global_step)
                bar.set_postfix({k: f"{v.item():.3f}" for k, (v, shown) in step_metrics.items() if shown})
            step_metrics.clear()
            global_step += 1
        scheduler.step()

        lit.eval()
        sums = defaultdict(float)
        count = 0
        for batch_idx, batch in enumerate(val_dl):
            with torch.no_grad():
                out = lit.validation_step(batch, batch_idx)
            out = accelerator.gather_for_metrics(out)  # every rank: all ranks' samples, each once
            for key, values in out.items():
                sums[key] += values.sum().item()
            count += out["acc1"].numel()
        epoch_metrics = {f"val_{k}_epoch": v / count for k, v in sums.items()}
        accelerator.log(dict(epoch_metrics, epoch=epoch), step=global_step)
        accelerator.print(f"epoch {epoch}: val loss {epoch_metrics['val_loss_epoch']:.4f}, "
                          f"val acc1 {epoch_metrics['val_acc1_epoch']:.4f}, val acc5 "
                          f"{epoch_metrics['val_acc5_epoch']:.4f} ({count} samples), step {global_step}")
    return global_step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, epochs=2, batch_size=32, lr=0.05)
    parser.add_argument("--arch", default="resnet50", help="torchvision model name, or 'small'")
    parser.add_argument("--image_size", type=int, default=None, help="default: 224 with --data, else 32")
    parser.add_argument("--workers", type=int, default=None, help="default: 4 with --data, else 0")
    parser.add_argument("--log_with", default="csv", help="csv, tensorboard, all")
    parser.add_argument("--log_every", type=int, default=1)
    parser.add_argument("--run_name", default="lightning_style")
    args = parser.parse_args()

    accelerator = Accelerator(mixed_precision=args.mixed_precision, log_with=args.log_with,
                              project_dir=args.output_dir)
    set_seed(args.seed)
    accelerator.init_trackers(args.run_name, config=vars(args))

    dm = ImageNetDataModule(args.data, args.batch_size, args.workers if args.workers is not None else
                            (4 if args.data else 0), args.image_size or (224 if args.data else 32),
                            limit=args.limit, print_fn=accelerator.print, synthetic=args.synthetic)
    dm.setup()
    lit = ImageNetLitModule(args.arch, dm.num_classes, args.lr, print_fn=accelerator.print)
    steps = fit(accelerator, lit, dm, args.epochs, max_steps=args.max_steps, log_every=args.log_every)

    accelerator.print(f"trained {steps} steps on {accelerator.num_processes} process(es); metrics in "
                      f"{os.path.join(args.output_dir, args.run_name)}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
