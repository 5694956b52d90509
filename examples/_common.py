"""Shared helpers for the examples: data and models that work offline, and common flags.

Nothing here is needed to use anyaccel; it keeps the examples short and lets each of them run
on a machine without datasets or torchvision:

* Data: with ``--data PATH`` the real dataset is read through torchvision (CIFAR10,
  FashionMNIST, or an ImageNet-style folder with ``train/`` and ``val/``); nothing is downloaded.
  Without it, scikit-learn's bundled 8x8 digits (1,797 images) are upscaled to the requested
  image size and channel count; without scikit-learn, a synthetic learnable data set is used.
  ``--synthetic`` asks for random CIFAR-shaped data (3x32x32 by default, 10 classes, learnable):
  no data set, no download, no scikit-learn (what ``make gpu-check`` runs on a GPU machine).
* Models: a torchvision architecture (``resnet18``, ``resnet50``, ...) when torchvision imports,
  else :class:`SmallCNN` — the example says so, and why, on the main process.

Every function is local to the calling process (each rank builds its own copy of the data set
and model; ``accelerator.prepare`` shards the data and synchronises the weights).
"""

from __future__ import annotations

import argparse
import os
from typing import Callable, Optional, Tuple

import torch
from torch import nn
from torch.utils.data import Dataset, Subset, TensorDataset

Printer = Callable[[str], None]

# per-channel normalisation used for real data sets
_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "imagefolder": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}


def add_common_args(parser: argparse.ArgumentParser, epochs: int = 3, batch_size: int = 32, lr: float = 0.05,
                    max_steps: bool = True) -> None:
    """The flags every example shares (so CI can run each one in seconds)."""
    parser.add_argument("--data", default=None,
                        help="dataset root; without it, bundled digits (or synthetic data) are used offline")
    add_synthetic_arg(parser)
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--batch_size", type=int, default=batch_size, help="per-process batch size")
    parser.add_argument("--lr", type=float, default=lr)
    if max_steps:
        parser.add_argument("--max_steps", type=int, default=None,
                            help="stop each epoch's training after this many steps (quick runs)")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N training samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"],
                        help="default: what `anyaccel launch` passed, else 'no'")
    parser.add_argument("--output_dir", default="outputs")


def add_synthetic_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--synthetic", action="store_true",
                        help="random CIFAR-shaped images (no data set, no download); ignores --data")


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def _torchvision(purpose: str):
    try:
        import torchvision  # noqa: F401  (imported lazily: never at anyaccel import time)
        from torchvision import datasets, transforms
    except Exception as exc:  # ImportError, or a torchvision built for another torch
        raise SystemExit(f"--data needs torchvision to read {purpose} ({type(exc).__name__}: {exc}); "
                         "install a torchvision matching your torch, or drop --data to use the bundled digits") from exc
    return datasets, transforms


def real_dataset(kind: str, root: str, train: bool, image_size: int = 224) -> Dataset:
    """Read a real data set from ``root`` with torchvision (no download). ``kind``: ``"cifar10"``,
    ``"fashion_mnist"`` or ``"imagefolder"`` (``root/train`` and ``root/val`` class folders)."""
    datasets, T = _torchvision(kind)
    mean, std = _STATS[kind]
    if kind == "cifar10":
        aug = [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()] if train else []
        return datasets.CIFAR10(root, train=train, download=False,
                                transform=T.Compose(aug + [T.ToTensor(), T.Normalize(mean, std)]))
    if kind == "fashion_mnist":
        return datasets.FashionMNIST(root, train=train, download=False,
                                     transform=T.Compose([T.ToTensor(), T.Normalize(mean, std)]))
    if kind == "imagefolder":
        if train:
            tf = [T.RandomResizedCrop(image_size), T.RandomHorizontalFlip()]
        else:
            tf = [T.Resize(int(image_size * 256 / 224)), T.CenterCrop(image_size)]
        folder = os.path.join(root, "train" if train else "val")
        if not os.path.isdir(folder):
            raise SystemExit(f"--data {root}: expected class folders under {folder}")
        return datasets.ImageFolder(folder, transform=T.Compose(tf + [T.ToTensor(), T.Normalize(mean, std)]))
    raise ValueError(f"unknown dataset kind {kind!r}")


def _digits_arrays() -> Tuple[torch.Tensor, torch.Tensor, str]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        g = torch.Generator().manual_seed(1234)
        protos = torch.rand(10, 64, generator=g)
        y = torch.arange(2000) % 10
        x = (protos[y] + 0.35 * torch.rand(2000, 64, generator=g)).clamp(0, 1)
        return x, y, f"synthetic data (scikit-learn not installed: {exc})"
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    return x, torch.tensor(digits.target, dtype=torch.long), "scikit-learn's bundled digits (1,797 8x8 images)"


def fallback_datasets(image_size: int, channels: int) -> Tuple[Dataset, Dataset, str]:
    """Offline stand-in for an image data set: digits upscaled to ``channels x image_size x
    image_size``, normalised, split 80/20 (same split on every rank). Returns (train, test, what)."""
    x, y, what = _digits_arrays()
    x = x.view(-1, 1, 8, 8)
    if image_size != 8:
        x = nn.functional.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    x = (x - x.mean()) / x.std()
    x = x.expand(-1, channels, -1, -1).contiguous()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(y))
    tr, te = order[:cut], order[cut:]
    return (TensorDataset(x[tr], y[tr]), TensorDataset(x[te], y[te]),
            f"{what}, upscaled to {channels}x{image_size}x{image_size}")


def synthetic_datasets(image_size: int, channels: int, num_classes: int = 10, train_size: int = 2048,
                       test_size: int = 512) -> Tuple[Dataset, Dataset, str]:
    """Random images shaped like CIFAR10 (``channels x image_size x image_size``, ``num_classes``
    classes): a fixed random prototype per class plus noise, so a model can learn it. The same
    tensors on every rank (fixed seed). Returns (train, test, what)."""
    g = torch.Generator().manual_seed(2024)
    protos = torch.randn(num_classes, channels, image_size, image_size, generator=g)

    def make(n: int) -> TensorDataset:
        y = torch.randint(0, num_classes, (n,), generator=g)
        return TensorDataset(protos[y] + 1.5 * torch.randn(n, channels, image_size, image_size, generator=g), y)

    return make(train_size), make(test_size), f"synthetic {channels}x{image_size}x{image_size} images, {num_classes} classes"


def image_datasets(kind: str, data: Optional[str], image_size: int, channels: int, print_fn: Printer = print,
                   limit: Optional[int] = None, synthetic: bool = False) -> Tuple[Dataset, Dataset, int]:
    """(train, test, num_classes): random CIFAR-shaped data with ``synthetic``, else the real
    data set under ``data``, else the offline fallback."""
    if synthetic:
        train, test, what = synthetic_datasets(image_size, channels)
        num_classes = 10
        print_fn(f"data: --synthetic, {what} ({len(train)} train / {len(test)} test samples)")
    elif data:
        train, test = real_dataset(kind, data, True, image_size), real_dataset(kind, data, False, image_size)
        num_classes = len(getattr(train, "classes", range(10)))
        print_fn(f"data: {kind} from {data} ({len(train)} train / {len(test)} test samples)")
    else:
        train, test, what = fallback_datasets(image_size, channels)
        num_classes = 10
        print_fn(f"data: no --data given, using {what} ({len(train)} train / {len(test)} test samples)")
    if limit:
        train = Subset(train, range(min(limit, len(train))))
        test = Subset(test, range(min(limit, len(test))))
    return train, test, num_classes


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


class SmallCNN(nn.Module):
    """Two conv blocks and a linear head; works for any input size >= 8x8."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
        )
        self.head = nn.Linear(2 * width * 16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


def vision_model(arch: str, num_classes: int, in_channels: int = 3, print_fn: Printer = print) -> nn.Module:
    """``torchvision.models.<arch>(num_classes=...)`` when torchvision imports, else
    :class:`SmallCNN` (saying so). ``arch="small"`` always gives the small CNN."""
    if arch == "small":
        print_fn("model: SmallCNN (--arch small)")
        return SmallCNN(in_channels, num_classes)
    try:
        import torchvision
    except Exception as exc:
        print_fn(f"model: torchvision cannot be imported ({type(exc).__name__}: {exc}); "
                 f"falling back from {arch} to SmallCNN")
        return SmallCNN(in_channels, num_classes)
    model = getattr(torchvision.models, arch)(num_classes=num_classes)
    if in_channels != 3 and hasattr(model, "conv1"):
        old = model.conv1
        model.conv1 = nn.Conv2d(in_channels, old.out_channels, old.kernel_size, old.stride, old.padding, bias=False)
    print_fn(f"model: torchvision {arch} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters)")
    return model


def param_checksum(model: nn.Module) -> float:
    """Sum of all parameters (float64): equal checksums mean (practically) equal weights."""
    return float(sum(p.detach().double().sum().item() for p in model.parameters()))
