"""ResNet on CIFAR10 in the ColossalAI engine style, migrated to anyaccel.

ColossalAI's Engine/Trainer API (``colossalai.launch_from_torch`` → ``colossalai.initialize`` →
``engine.zero_grad/backward/step``, ``config.py`` with ``fp16=dict(mode=AMP_TYPE.TORCH)``) was
retired in 2023, so tutorials written for it no longer run. This is such a tutorial's training
loop, kept line for line, with the engine calls replaced::

    # before (ColossalAI, legacy engine)            # after (anyaccel)
    colossalai.launch_from_torch(config=CONFIG)     accelerator = Accelerator(mixed_precision=precision_from(CONFIG))
    engine, train_dl, test_dl, _ = \\                model, optimizer, train_dl, test_dl = \\
        colossalai.initialize(model, optimizer,          accelerator.prepare(model, optimizer, train_dl, test_dl)
                              criterion, train_dl, test_dl)
    img, label = img.cuda(), label.cuda()           # (gone: batches arrive on accelerator.device)
    engine.train() / engine.eval()                  model.train() / model.eval()
    engine.zero_grad()                              optimizer.zero_grad()
    output = engine(img)                            output = model(img)
    loss = engine.criterion(output, label)          loss = criterion(output, label)
    engine.backward(loss)                           accelerator.backward(loss)
    engine.step()                                   optimizer.step()
    lr_scheduler.step()   # per epoch               lr_scheduler.step()   # unchanged, per epoch
    logger = get_dist_logger()                      logger = get_logger(__name__)
    logger.info(msg, ranks=[0])                     logger.info(msg)            # main process by default
    correct / total       # this rank only          correct / total of gather_for_metrics(...)  # all ranks
    gpc.config.BATCH_SIZE                           CONFIG["BATCH_SIZE"]

``fp16=dict(mode=AMP_TYPE.TORCH)`` (also ``"apex"``/``"naive"``) becomes ``mixed_precision="fp16"``;
``bf16`` is accepted too. In your own ``config.py`` write ``fp16 = dict(mode="torch")`` (the
``AMP_TYPE`` enum is not needed) and pass ``--config config.py``; ``BATCH_SIZE``, ``NUM_EPOCHS``,
``LEARNING_RATE`` are read from it when present.

Start it as before, with torch's launcher, or with anyaccel's::

    python -m torch.distributed.run --nproc_per_node 2 examples/resnet_cifar_engine.py --data ~/cifar10
    anyaccel launch --num_processes 2 examples/resnet_cifar_engine.py            # offline: bundled digits
"""

import argparse
import logging
import os
import runpy
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import add_synthetic_arg, image_datasets, vision_model  # noqa: E402

from anyaccel import Accelerator, get_logger, set_seed  # noqa: E402

# The tutorial's config.py, as a dict. `fp16=dict(mode=AMP_TYPE.TORCH)` → "torch".
CONFIG = dict(BATCH_SIZE=128, NUM_EPOCHS=2, LEARNING_RATE=0.1, fp16=dict(mode="torch"))


def load_config(path):
    """Read a ColossalAI-style config.py (module-level names) into a dict."""
    names = runpy.run_path(path)
    return {k: v for k, v in names.items() if not k.startswith("_")}


def precision_from(config):
    """ColossalAI's ``fp16=dict(mode=...)`` / ``bf16=...`` → anyaccel's ``mixed_precision``."""
    if config.get("bf16"):
        return "bf16"
    fp16 = config.get("fp16")
    if not fp16:
        return "no"
    mode = str(getattr(fp16.get("mode"), "value", fp16.get("mode", "torch"))).lower().split(".")[-1]
    if mode not in ("torch", "apex", "naive"):
        raise ValueError(f"fp16 mode {mode!r}: use 'torch', 'apex' or 'naive' (all mean torch AMP fp16 here)")
    return "fp16"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="a ColossalAI-style config.py")
    parser.add_argument("--data", default=None, help="CIFAR10 root (torchvision layout); default: bundled digits")
    add_synthetic_arg(parser)
    parser.add_argument("--arch", default="resnet18", help="torchvision model name, or 'small'")
    parser.add_argument("--epochs", type=int, default=None, help="overrides NUM_EPOCHS")
    parser.add_argument("--batch_size", type=int, default=None, help="overrides BATCH_SIZE (per process)")
    parser.add_argument("--fp16", default=None, choices=["torch", "apex", "naive", "none"],
                        help="overrides the config's fp16 mode ('none': full precision)")
    parser.add_argument("--max_steps", type=int, default=None, help="stop each epoch after this many steps")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N samples")
    args = parser.parse_args()

    config = dict(CONFIG)
    if args.config:
        config.update(load_config(args.config))
    if args.epochs is not None:
        config["NUM_EPOCHS"] = args.epochs
    if args.batch_size is not None:
        config["BATCH_SIZE"] = args.batch_size
    if args.fp16 is not None:
        config["fp16"] = None if args.fp16 == "none" else dict(mode=args.fp16)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    accelerator = Accelerator(mixed_precision=precision_from(config))  # was: colossalai.launch_from_torch
    logger = get_logger(__name__)
    set_seed(42)
    logger.info(f"{accelerator.num_processes} process(es), device {accelerator.device}, "
                f"mixed precision {accelerator.mixed_precision}")

    with accelerator.main_process_first():  # rank 0 reads/caches the data first
        train_set, test_set, num_classes = image_datasets("cifar10", args.data, 32, 3, print_fn=logger.info,
                                                          limit=args.limit, synthetic=args.synthetic)
    model = vision_model(args.arch, num_classes, 3, print_fn=logger.info)
    train_dataloader = DataLoader(train_set, batch_size=config["BATCH_SIZE"], shuffle=True)
    test_dataloader = DataLoader(test_set, batch_size=config["BATCH_SIZE"])
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=config["LEARNING_RATE"], momentum=0.9, weight_decay=5e-4)
    # Stepped once per epoch by us, as in the tutorial: no need to prepare() it.
    lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config["NUM_EPOCHS"])

    # was: engine, train_dataloader, test_dataloader, _ = colossalai.initialize(...)
    model, optimizer, train_dataloader, test_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, test_dataloader)

    for epoch in range(config["NUM_EPOCHS"]):
        start = time.perf_counter()
        model.train()
        for step, (img, label) in enumerate(accelerator.progress(train_dataloader, desc=f"epoch {epoch}")):
            if args.max_steps is not None and step >= args.max_steps:
                break
            optimizer.zero_grad()
            output = model(img)
            train_loss = criterion(output, label)
            accelerator.backward(train_loss)
            optimizer.step()
        lr_scheduler.step()

        model.eval()
        correct = total = 0
        test_loss = 0.0
        for img, label in test_dataloader:
            with torch.no_grad():
                output = model(img)
                losses = nn.functional.cross_entropy(output, label, reduction="none")
            # every rank receives every rank's predictions, each test sample exactly once
            pred, label, losses = accelerator.gather_for_metrics((output.argmax(dim=-1), label, losses))
            correct += (pred == label).sum().item()
            total += label.numel()
            test_loss += losses.sum().item()
        test_loss /= total
        logger.info(f"Epoch {epoch} - train loss: {train_loss.item():.5}, test loss: {test_loss:.5}, "
                    f"acc: {correct / total:.5} ({total} samples), lr: {lr_scheduler.get_last_lr()[0]:.5g}, "
                    f"time: {time.perf_counter() - start:.1f}s")

    accelerator.end_training()


if __name__ == "__main__":
    main()
