"""FashionMNIST CNN trained from a notebook with ``notebook_launcher`` (the Accelerate notebook flow).

In a Jupyter cell you define ``training_function`` and call
``notebook_launcher(training_function, args=(config,), num_processes=2)``; this file is the same
code as a script, so it also runs from a terminal::

    python examples/fashion_cnn_notebook.py                       # starts 2 processes itself
    python examples/fashion_cnn_notebook.py --data ~/data --num_processes 4   # real FashionMNIST

Coming from Hugging Face Accelerate, only the imports change::

    # before
    from accelerate import Accelerator, notebook_launcher
    from accelerate.utils import set_seed
    # after
    from anyaccel import Accelerator, notebook_launcher, set_seed

Coming from a single-process notebook, these lines change::

    # before                                   # after
    device = "cuda"                            accelerator = Accelerator(mixed_precision=...)
    model = CNN().to(device)                   model, optimizer, train_dl, test_dl = \\
                                                   accelerator.prepare(CNN(), optimizer, train_dl, test_dl)
    x, y = x.to(device), y.to(device)          # (gone: batches arrive on accelerator.device)
    loss.backward()                            accelerator.backward(loss)
    correct += (preds == y).sum()              preds, y = accelerator.gather_for_metrics((preds, y))
                                               correct += (preds == y).sum()
    torch.save(model.state_dict(), path)       accelerator.wait_for_everyone()
                                               accelerator.save(accelerator.unwrap_model(model).state_dict(), path)
    training_function(config)                  notebook_launcher(training_function, args=(config,), num_processes=2)

``notebook_launcher`` works on a CPU-only machine too (it starts real processes and says how many).
Do not touch CUDA in the notebook before calling it: each process must initialise its own GPU.
"""

import argparse
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _common when run from elsewhere
from _common import image_datasets  # noqa: E402

from anyaccel import Accelerator, set_seed  # noqa: E402


class FashionCNN(nn.Module):
    """The classic FashionMNIST CNN: two conv/pool blocks and two linear layers."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.layer2 = nn.Sequential(nn.Conv2d(32, 64, 3), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2))
        self.fc1 = nn.Linear(64 * 6 * 6, 600)
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(600, 120)
        self.fc3 = nn.Linear(120, num_classes)

    def forward(self, x):
        out = self.layer2(self.layer1(x))
        out = self.drop(self.fc1(out.flatten(1)))
        return self.fc3(self.fc2(out))


def training_function(config):
    """Runs in every process started by notebook_launcher."""
    accelerator = Accelerator(mixed_precision=config["mixed_precision"])
    set_seed(config["seed"])
    accelerator.print(f"training on {accelerator.num_processes} process(es), device {accelerator.device}")

    train_set, test_set, num_classes = image_datasets("fashion_mnist", config["data"], 28, 1,
                                                      print_fn=accelerator.print, limit=config["limit"])
    train_dl = DataLoader(train_set, batch_size=config["batch_size"], shuffle=True)
    test_dl = DataLoader(test_set, batch_size=100)
    model = FashionCNN(num_classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    criterion = nn.CrossEntropyLoss()

    model, optimizer, train_dl, test_dl = accelerator.prepare(model, optimizer, train_dl, test_dl)

    for epoch in range(config["epochs"]):
        model.train()
        for step, (images, labels) in enumerate(accelerator.progress(train_dl, desc=f"epoch {epoch}")):
            if config["max_steps"] is not None and step >= config["max_steps"]:
                break
            optimizer.zero_grad()
            loss = criterion(model(images), labels)
            accelerator.backward(loss)
            optimizer.step()

        model.eval()
        correct = total = 0
        for images, labels in test_dl:
            with torch.no_grad():
                preds = model(images).argmax(dim=1)
            preds, labels = accelerator.gather_for_metrics((preds, labels))
            correct += (preds == labels).sum().item()
            total += labels.numel()
        accelerator.print(f"epoch {epoch}: loss {loss.item():.4f}, test accuracy {correct / total:.4f} "
                          f"({total} samples)")

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    accelerator.save(unwrapped.state_dict(), config["output"])  # rank 0 writes, atomically
    accelerator.print(f"saved {config['output']}")
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="FashionMNIST root (torchvision layout); default: bundled digits")
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max_steps", type=int, default=None)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mixed_precision", default="no", choices=["no", "fp16", "bf16"])
    parser.add_argument("--output", default="outputs/fashion_cnn.pt")
    config = vars(parser.parse_args())

    if os.environ.get("WORLD_SIZE"):
        # Already started by a launcher (anyaccel launch / torchrun): this process is one worker.
        training_function(config)
        return
    # In a notebook this is the only line you run after defining training_function:
    from anyaccel import notebook_launcher

    notebook_launcher(training_function, args=(config,), num_processes=config["num_processes"])

    # Back in the notebook's own process: the saved weights load into a plain model.
    model = FashionCNN()
    model.load_state_dict(torch.load(config["output"], weights_only=True))
    print(f"reloaded {config['output']} into a plain FashionCNN "
          f"({sum(p.numel() for p in model.parameters())} parameters)")


if __name__ == "__main__":
    main()
