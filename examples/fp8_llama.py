"""fp8 training (torchao): a tiny transformers Llama (random weights, nothing downloaded) whose linear
layers compute in fp8, the rest under bf16 autocast — on a GPU with fp8 matmuls (H100, L4, RTX 4090,
...) for speed, on a CPU through torchao's emulation (the same numerics, for trying it out; slower).

The script is the plain training loop; only the ``Accelerator`` line says fp8::

    # before (Accelerate 1.15)                                # after (anyaccel)
    from accelerate import Accelerator                        from anyaccel import Accelerator
    from accelerate.utils import AORecipeKwargs               from anyaccel.utils import AORecipeKwargs
    accelerator = Accelerator(                                accelerator = Accelerator(
        mixed_precision="fp8",                                    mixed_precision="fp8",
        kwargs_handlers=[AORecipeKwargs()])                       kwargs_handlers=[AORecipeKwargs(recipe="rowwise")])
    # rowwise: build a Float8LinearConfig yourself            # or: anyaccel launch --mixed_precision fp8
                                                              #       --fp8_recipe rowwise script.py

At ``prepare`` anyaccel prints which layers compute in fp8 and which stay in high precision and why
(the first and the last linear layer, sizes that are not multiples of 16). The task is synthetic:
each sequence counts up from a random start by a random stride, so the next token follows from the
two before it.

Run::

    python examples/fp8_llama.py                                              # one process (CPU: emulated)
    python examples/fp8_llama.py --precision bf16                             # the same run in bf16, to compare
    anyaccel launch --num_processes 2 --cpu --strategy fsdp examples/fp8_llama.py  # FSDP2, fp8 all-gather
"""

import argparse

import torch
import transformers
from torch.utils.data import DataLoader

from anyaccel import Accelerator, set_seed
from anyaccel.utils import AORecipeKwargs


def counting_sequences(n, vocab, length, seed):
    """``n`` sequences ``start, start + stride, ...`` (mod ``vocab``), as transformers batches want them."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    ids = (start + stride * torch.arange(length)) % vocab
    return [{"input_ids": row, "labels": row} for row in ids]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="fp8", choices=["fp8", "bf16", "no"])
    parser.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise", "rowwise_with_gw_hp"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    handlers = [AORecipeKwargs(recipe=args.recipe)] if args.precision == "fp8" else None
    accelerator = Accelerator(mixed_precision=args.precision, kwargs_handlers=handlers)
    set_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=64,
                                      max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(counting_sequences(512, 64, 32, seed=1), batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    step, total = 0, 0.0
    while step < args.steps:
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            total += accelerator.reduce(loss.detach(), "mean").item()
            step += 1
            if step % 10 == 0 or step == args.steps:
                accelerator.print(f"step {step}: loss {total / (10 if step % 10 == 0 else step % 10):.4f} "
                                  f"({args.precision}{' ' + args.recipe if args.precision == 'fp8' else ''})")
                total = 0.0
            if step == args.steps:
                break
    accelerator.end_training()


if __name__ == "__main__":
    main()
