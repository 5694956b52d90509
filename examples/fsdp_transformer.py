"""Sharded training (FSDP2): a small transformer whose parameters, gradients and Adam state are split
over the processes — on 2 CPU processes here, the same script on GPUs.

The task is synthetic (nothing to download): sequences of tokens, the model learns to predict each
sequence reversed. Each ``nn.TransformerEncoderLayer`` is sharded as its own unit (all-gathered one
layer at a time in forward and backward), the rest with the root::

    # before (Lightning Fabric, FSDP1, GPUs only)          # after (anyaccel, FSDP2, CPUs too)
    strategy = FSDPStrategy(                                plugin = FullyShardedDataParallelPlugin(
        auto_wrap_policy={nn.TransformerEncoderLayer},          transformer_cls_names_to_wrap=["TransformerEncoderLayer"],
        activation_checkpointing_policy={...})                  activation_checkpointing=True)
    fabric = Fabric(strategy=strategy, devices=2,           accelerator = Accelerator(fsdp_plugin=plugin,
                    precision="bf16-mixed")                                            mixed_precision="bf16")
    model, optimizer = fabric.setup(model, optimizer)       model, optimizer, loader = accelerator.prepare(
    loader = fabric.setup_dataloaders(loader)                   model, optimizer, loader)
    fabric.backward(loss)                                   accelerator.backward(loss)
    fabric.save("ckpt", {"model": model, "optim": opt})     accelerator.save_state("ckpt")   # sharded, any N

    # before (Accelerate: fsdp_config in its YAML)          # after: the same YAML keys in anyaccel's
    fsdp_config:                                            strategy: fsdp
      fsdp_version: 2                                       fsdp_config:
      fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP           auto_wrap_policy: transformer_based_wrap
      fsdp_transformer_layer_cls_to_wrap: ...Layer            transformer_cls_names_to_wrap: [...Layer]
    accelerate launch train.py                              anyaccel launch train.py   (or `anyaccel config --from-accelerate`)

Run (2 CPU processes; add --bf16, --checkpointing, --compile to try them)::

    anyaccel launch --num_processes 2 --cpu examples/fsdp_transformer.py
"""

import argparse
import math
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from anyaccel import Accelerator, set_seed
from anyaccel.plugins import FullyShardedDataParallelPlugin


class ReverseTransformer(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, length: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(length, width) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def dataset(n: int, vocab: int, length: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, length), generator=g)
    return TensorDataset(x, x.flip(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=32, help="per process")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing of each layer")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (inductor)")
    parser.add_argument("--out", default="fsdp_transformer_out")
    args = parser.parse_args()

    vocab, length = 16, 12
    plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["TransformerEncoderLayer"],
                                            activation_checkpointing=args.checkpointing)
    accelerator = Accelerator(fsdp_plugin=plugin, mixed_precision="bf16" if args.bf16 else "no",
                              dynamo_backend="inductor" if args.compile else None)
    set_seed(0)
    model = ReverseTransformer(vocab, args.width, args.layers, length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train = DataLoader(dataset(4096, vocab, length, seed=1), batch_size=args.batch_size, shuffle=True)
    test = DataLoader(dataset(512, vocab, length, seed=2), batch_size=args.batch_size)
    model, optimizer, train, test = accelerator.prepare(model, optimizer, train, test)

    total = sum(p.numel() for p in model.parameters())
    held = sum(p.to_local().numel() for p in model.parameters())
    accelerator.print(f"{accelerator.num_processes} process(es), strategy {accelerator.strategy.name}: this process holds "
                      f"{held:,} of {total:,} parameters ({held / total:.0%})")
    for epoch in range(args.epochs):
        model.train()
        for tokens, target in train:
            logits = model(tokens)
            loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        correct = seen = 0
        with torch.no_grad():
            for tokens, target in test:
                predicted = model(tokens).argmax(-1)
                predicted, target = accelerator.gather_for_metrics((predicted, target))
                correct += int((predicted == target).sum())
                seen += target.numel()
        accelerator.print(f"epoch {epoch}: loss {loss.item():.3f}, token accuracy {correct / seen:.3f} "
                          f"({seen // length} sequences)")
    accelerator.save_state(os.path.join(args.out, "state"))  # sharded: each process writes its part
    accelerator.save_model(model, os.path.join(args.out, "model"))  # full safetensors, from every process's part
    accelerator.print(f"saved {os.path.join(args.out, 'model', 'model.safetensors')} "
                      f"(loadable into ReverseTransformer without anyaccel); perplexity {math.exp(loss.item()):.2f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
