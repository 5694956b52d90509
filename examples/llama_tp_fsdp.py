"""Tensor parallel x FSDP2 (2-D parallelism): a small Llama-style model trained on 4 CPU processes,
with each attention head group and each MLP slice on one tensor-parallel rank and every weight
then sharded again over the data-parallel ranks.

The model is ours (no transformers): RMSNorm, rotary position embeddings, multi-head attention
with q/k/v/o projections, a SwiGLU MLP. Its tensor-parallel plan is the Megatron one: q/k/v and
gate/up cut by output features (``colwise``: each TP rank computes its own heads and its own
slice of the hidden layer), o and down cut by input features (``rowwise``: the partial results
are summed across the TP group). The attention therefore reshapes with ``-1`` heads — a TP rank
holds ``n_heads / tp_size`` of them. Embedding, norms and the output head stay whole inside a TP
group (FSDP2 still shards them over the data-parallel ranks)::

    # before (Lightning Fabric 2.6)                       # after (anyaccel)
    def parallelize(model, mesh):                         PLAN = {"layers.*.attention.q_proj": "colwise", ...,
        tp = mesh["tensor_parallel"]                              "layers.*.mlp.down_proj": "rowwise"}
        for layer in model.layers:                        config = ParallelismConfig(
            parallelize_module(layer, tp, {...})              dp_shard_size=2, tp_size=2, tp_plan=PLAN,
            fully_shard(layer, mesh=mesh["data_parallel"])    fsdp=FSDPOptions(transformer_cls_names_to_wrap=["Block"]))
        fully_shard(model, mesh=mesh["data_parallel"])    accelerator = Accelerator(parallelism_config=config)
        return model                                      model, optimizer, loader = accelerator.prepare(
    strategy = ModelParallelStrategy(parallelize,             model, optimizer, loader)
        data_parallel_size=2, tensor_parallel_size=2)     accelerator.backward(loss)
    fabric = Fabric(devices=4, strategy=strategy)         # anyaccel launch --num_processes 4 --cpu llama_tp_fsdp.py
    model = fabric.setup(model); fabric.backward(loss)    # (on GPUs: drop --cpu)

    # before (Accelerate 1.15: TP only for transformers models, applied by from_pretrained)
    pc = ParallelismConfig(dp_shard_size=2, tp_size=2)         # after: the same config, any nn.Module with a plan
    model = AutoModelForCausalLM.from_pretrained(..., tp_plan="auto", device_mesh=accelerator.torch_device_mesh)

The task is synthetic (nothing to download): each sequence counts up from a random start by a
random stride (mod the vocabulary), so predicting the next token needs the two previous ones —
attention has to work, across heads held by different TP ranks. Each rank prints the bytes of
parameters and optimizer state it holds (its local shards) against the whole model.

Run (4 CPU processes; any sizes whose product is the process count work)::

    anyaccel launch --num_processes 4 --cpu examples/llama_tp_fsdp.py            # TP 2 x FSDP 2
    anyaccel launch --num_processes 4 --cpu examples/llama_tp_fsdp.py --tp 4 --dp 1
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from anyaccel import Accelerator, ParallelismConfig, set_seed
from anyaccel.strategies.options import FSDPOptions

# The tensor-parallel plan: module-name patterns (``*`` is one name component) to styles.
PLAN = {
    "layers.*.attention.q_proj": "colwise",
    "layers.*.attention.k_proj": "colwise",
    "layers.*.attention.v_proj": "colwise",
    "layers.*.attention.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotary(length: int, head_dim: int, base: float = 10000.0):
    """cos and sin tables (length, head_dim / 2) of rotary position embeddings."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(length).float(), inv)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of features of ``x`` (batch, heads, length, head_dim) by their position's angle."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, width: int, n_heads: int):
        super().__init__()
        self.head_dim = width // n_heads
        self.q_proj = nn.Linear(width, width, bias=False)
        self.k_proj = nn.Linear(width, width, bias=False)
        self.v_proj = nn.Linear(width, width, bias=False)
        self.o_proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1, not n_heads: under TP, q/k/v hold this rank's heads only (n_heads / tp_size of them)
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))  # rowwise o_proj sums the heads' parts


class SwiGLU(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, width: int, n_heads: int, hidden: int):
        super().__init__()
        self.attention_norm = RMSNorm(width)
        self.attention = Attention(width, n_heads)
        self.mlp_norm = RMSNorm(width)
        self.mlp = SwiGLU(width, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 64, n_heads: int = 4, hidden: int = 128, layers: int = 2,
                 length: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width, n_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        cos, sin = rotary(length, width // n_heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, self.cos[:s], self.sin[:s])
        return self.head(self.norm(h))


def counting_sequences(n: int, vocab: int, length: int, seed: int) -> TensorDataset:
    """Sequences start + stride * t (mod vocab), stride in 1..3: the next token follows from the
    two before it. Inputs are tokens 0..length-1, targets tokens 1..length."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    seq = (start + stride * torch.arange(length + 1)) % vocab
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def local_bytes(tensors) -> int:
    """Bytes this process holds of ``tensors`` (a DTensor's local shard only)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (innermost mesh dimension)")
    parser.add_argument("--dp", type=int, default=2, help="FSDP shard size (dp x tp = the number of processes)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch_size", type=int, default=16, help="per data-parallel rank")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    vocab, length = 32, 16
    config = ParallelismConfig(dp_shard_size=args.dp, tp_size=args.tp, tp_plan=PLAN,
                               fsdp=FSDPOptions(transformer_cls_names_to_wrap=["Block"]))  # a Block is an FSDP unit
    accelerator = Accelerator(parallelism_config=config)
    set_seed(0)
    model = TinyLlama(vocab, args.width, args.heads, 2 * args.width, args.layers, length)
    full = {"params": local_bytes(model.parameters())}
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(counting_sequences(4096, vocab, length, seed=1), batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    q = model.layers[0].attention.q_proj.weight
    accelerator.print(f"mesh {accelerator.torch_device_mesh}; layers.0.attention.q_proj.weight: "
                      f"{tuple(q.shape)} as {tuple(q.placements)}, local shard {tuple(q.to_local().shape)}")
    step, losses = 0, []
    while step < args.steps:
        for tokens, target in loader:
            loss = nn.functional.cross_entropy(model(tokens).reshape(-1, vocab), target.reshape(-1))
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            step += 1
            if step % 10 == 0 or step == args.steps:
                accelerator.print(f"step {step}: loss {sum(losses[-10:]) / len(losses[-10:]):.3f}")
            if step == args.steps:
                break

    held = {"params": local_bytes(model.parameters()),
            "optimizer": local_bytes(v for st in optimizer.state.values() for v in st.values()
                                     if isinstance(v, torch.Tensor) and v.dim() > 0)}
    mesh_coords = (accelerator.data_parallel_shard_rank, accelerator.tensor_parallel_rank)
    for rank, (coords, h) in enumerate(accelerator.gather_object([(mesh_coords, held)])):
        accelerator.print(f"rank {rank} (dp_shard {coords[0]}, tp {coords[1]}): holds parameters {h['params']:,} B "
                          f"and optimizer state {h['optimizer']:,} B of the model's {full['params']:,} B "
                          f"({h['params'] / full['params']:.0%})")
    accelerator.print(f"loss {losses[0]:.3f} -> {sum(losses[-10:]) / len(losses[-10:]):.3f} in {step} steps")
    accelerator.end_training()


if __name__ == "__main__":
    main()
