"""Expert parallelism: a tiny transformers Qwen3-MoE (random weights, nothing downloaded) trained
with its experts split over 2 CPU processes — each holds half of every layer's experts, and every
token's hidden state travels to the process holding each expert its router chose, and back.

The training loop is the plain one; only the configuration says ``ep_size``::

    # before (FSDP alone: every process gathers     # after (experts split over 2 processes)
    # every expert's weights at every layer)
    pc = ParallelismConfig(dp_shard_size=2)          pc = ParallelismConfig(dp_shard_size=2, ep_size=2)
    accelerator = Accelerator(parallelism_config=pc) accelerator = Accelerator(parallelism_config=pc)
    model, optimizer, loader = accelerator.prepare(  model, optimizer, loader = accelerator.prepare(
        model, optimizer, loader)                        model, optimizer, loader)
    for batch in loader:                             for batch in loader:
        out = model(**batch)                             out = model(**batch)   # out.aux_loss: the global batch's
        accelerator.backward(out.loss)                   accelerator.backward(out.loss)

``ep_size`` borrows the processes that shard the model (``dp_shard_size``, which it must divide);
the experts are found through the model's own ``config.base_model_ep_plan`` (``layers.*.mlp.experts``),
FSDP2 shards everything else as usual, and the router's load-balancing loss
(``output_router_logits=True``) is computed over the global batch, as one process would. The first
layer here is dense (``mlp_only_layers=[0]``, as DeepSeek's first layers are): it is left as it is.
docs/guides/nd-parallel.md, "Experts", says what is split where and what is refused.

The task is synthetic: each sequence counts up from a random start by a random stride (mod the
vocabulary), so the next token follows from the two before it.

Run::

    anyaccel launch --num_processes 2 --cpu examples/expert_parallel.py     # dp_shard 2 x ep 2
    anyaccel launch --num_processes 4 --cpu examples/expert_parallel.py     # dp_shard 4 x ep 2
    python examples/expert_parallel.py                                      # one process, as it is
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


def tiny_qwen3_moe(vocab=64, num_experts=8):
    """A 3-layer Qwen3-MoE, 8 experts per MoE layer, top-2; its first layer dense."""
    config = transformers.Qwen3MoeConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                         moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=8, num_experts=num_experts,
                                         num_experts_per_tok=2, mlp_only_layers=[0], output_router_logits=True,
                                         router_aux_loss_coef=0.01)
    return transformers.Qwen3MoeForCausalLM(config)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel processes (default: 2, or 1 alone)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    world = resolve_environment().world_size  # how many processes this job has (read, nothing started)
    ep = args.ep or min(2, world)
    accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=world, ep_size=ep))
    set_seed(0)
    model = tiny_qwen3_moe()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(counting_sequences(args.steps * 4 * world, 64, args.seq_len, seed=1), batch_size=4,
                        shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    experts = accelerator.unwrap_model(model).model.layers[1].mlp.experts
    held = getattr(experts, "held", range(experts.num_experts))
    print(f"process {accelerator.process_index}: experts {held.start}..{held.stop - 1} of each MoE layer "
          f"(ep {ep}, mesh {accelerator.torch_device_mesh})", flush=True)
    for step, batch in enumerate(loader):
        out = model(**batch)  # out.loss includes router_aux_loss_coef * out.aux_loss
        accelerator.backward(out.loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % 5 == 0 or step == args.steps - 1:
            loss = accelerator.reduce(out.loss.detach(), "mean")
            accelerator.print(f"step {step}: loss {loss.item():.3f}, aux loss {out.aux_loss.item():.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
