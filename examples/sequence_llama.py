"""Sequence parallelism (Ulysses): a tiny transformers Llama (random weights, nothing downloaded)
trained on sequences cut over 2 CPU processes — each holds half of every sequence, and attention
runs on the whole sequence for half of the heads on each.

The training loop is the plain one: the prepared loader hands each process its half of every
sequence, the prepared model shifts the labels across the border and returns the loss of the
whole batch (the same number on both processes, what one process would compute)::

    # before (Accelerate 1.15: DeepSpeed's ALST)                 # after (anyaccel)
    pc = ParallelismConfig(sp_backend="deepspeed", sp_size=2,     pc = ParallelismConfig(sp_size=2)
        sp_handler=DeepSpeedSequenceParallelConfig(              accelerator = Accelerator(parallelism_config=pc)
            sp_attn_implementation="sdpa"))                      model, optimizer, loader = accelerator.prepare(
    accelerator = Accelerator(parallelism_config=pc,                  model, optimizer, loader)
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))      for batch in loader:
    ...                                                              loss = model(**batch).loss
    for batch in loader:                                             accelerator.backward(loss)
        loss = model(**batch).loss                                   optimizer.step()
        shift_labels = batch["shift_labels"]                         optimizer.zero_grad()
        losses = all_gather(loss, group=sp_group)                # anyaccel launch --num_processes 2 --cpu ...
        good = all_gather((shift_labels != -100).sum(), ...)
        loss = sum(l * g for l, g in zip(losses, good)) / sum(good)
        accelerator.backward(loss)

The task is synthetic: each sequence counts up from a random start by a random stride (mod the
vocabulary), so the next token follows from the two before it — the tokens at the start of the
second half need the end of the first half, which lives on the other process.

Run::

    anyaccel launch --num_processes 2 --cpu examples/sequence_llama.py            # sp 2
    anyaccel launch --num_processes 4 --cpu examples/sequence_llama.py --sp 2     # sp 2 x dp_shard 2
    python examples/sequence_llama.py                                             # one process, as it is
"""

import argparse

import torch
import transformers
from torch.utils.data import DataLoader

from anyaccel import Accelerator, ParallelismConfig, resolve_environment, set_seed


def counting_sequences(n, vocab, length, seed):
    """``n`` sequences ``start, start + stride, ...`` (mod ``vocab``), as transformers batches want them."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    ids = (start + stride * torch.arange(length)) % vocab
    return [{"input_ids": row, "labels": row} for row in ids]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sp", type=int, default=None, help="sequence-parallel processes (default: all of them)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--sequences", type=int, default=256, help="sequences in the data set")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    world = resolve_environment().world_size  # how many processes this job has (read, nothing started)
    sp = args.sp or world
    accelerator = Accelerator(parallelism_config=ParallelismConfig(sp_size=sp, dp_shard_size=world // sp))
    set_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=64,
                                      max_position_embeddings=args.seq_len, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(counting_sequences(args.sequences, 64, args.seq_len, seed=1), batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.print(f"{accelerator.num_processes} process(es), mesh {accelerator.torch_device_mesh}; each holds "
                      f"{args.seq_len // sp} of {args.seq_len} tokens per sequence")
    for epoch in range(args.epochs):
        total = 0.0
        for batch in loader:
            loss = model(**batch).loss  # the loss of the whole batch, the same on every process
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            total += loss.item()
        accelerator.print(f"epoch {epoch}: loss {total / len(loader):.3f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
