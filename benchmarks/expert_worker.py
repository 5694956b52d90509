"""Expert-parallel measurements inside each worker of a torchrun job (never imported by the parent).

    python -m torch.distributed.run --nproc_per_node 2 ... benchmarks/expert_worker.py --out r.json [--quick]

The model: an embedding, ``layers`` mixture-of-experts blocks (RMS norm, a top-k softmax router,
SwiGLU experts in fused weights, a residual), a head; cross entropy; AdamW. Every process holds
``num_experts / world`` experts (ep = every process, no replicas). Contenders in the same process
group, rounds alternating:

* ``hand-written (torchtitan-style)``: what a user writes without a framework, after torchtitan's
  ``AllToAllTokenDispatcher`` and ``GroupedExperts`` (no anyaccel code in its step; its initial
  expert weights are sliced from the same ``FusedExperts`` model the anyaccel contender starts
  from, so that both compute the same first loss):
  argsort by expert, an all-to-all of the counts, an autograd Function over ``all_to_all_single``
  with uneven splits, the rank-major to expert-major permutation, a loop over the local experts,
  the way back, scores applied and ``scatter_add`` per token; the expert weights DTensors
  ``Shard(0)`` on the ep mesh, ``fully_shard`` as torchtitan applies it under ep (each experts
  module over ``efsdp``, each block and the root over the data-parallel processes) and the
  experts' gradients divided by ep after backward;
* ``hand-written'``: an independent second copy (the run's noise floor);
* ``anyaccel ep (Accelerator)``: ``Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=
  world, ep_size=world))``, the same model with ``FusedExperts``, ``prepare(model, optimizer)``,
  ``accelerator.backward``.

Proof that both did what is timed: the first loss of each on the same weights and batch; the bytes
each all-to-all moved in one step against the theory for the routing seen (the (token, expert)
pairs whose expert is on another rank, gathered from every rank: rows of ``hidden x 4`` bytes out
and back, forward and backward); the expert parameters and AdamW state each rank holds (1/ep of
the experts); tokens per expert summed over ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import common  # noqa: E402

SIZES = dict(hidden=256, intermediate=512, experts=8, top_k=2, layers=2, vocab=512, tokens=1024)
QUICK_SIZES = dict(hidden=64, intermediate=128, experts=8, top_k=2, layers=2, vocab=128, tokens=128)
HAND = "hand-written (torchtitan-style)"
OURS = "anyaccel ep (Accelerator)"


# ---- the model both contenders share ------------------------------------------------------------
class Block(torch.nn.Module):
    def __init__(self, s: Dict[str, int], experts: torch.nn.Module):
        super().__init__()
        self.norm = torch.nn.RMSNorm(s["hidden"])
        self.router = torch.nn.Linear(s["hidden"], s["experts"], bias=False)
        self.experts, self.top_k = experts, s["top_k"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.norm(x).reshape(-1, x.shape[-1])
        weights, index = torch.topk(torch.softmax(self.router(flat), dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        self.last_index = index.detach()
        return x + self.experts(flat, index, weights).view_as(x)


class Net(torch.nn.Module):
    def __init__(self, s: Dict[str, int], make_experts: Callable[[], torch.nn.Module]):
        super().__init__()
        self.embed = torch.nn.Embedding(s["vocab"], s["hidden"])
        self.blocks = torch.nn.ModuleList(Block(s, make_experts()) for _ in range(s["layers"]))
        self.head = torch.nn.Linear(s["hidden"], s["vocab"])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


# ---- the hand-written dispatcher (torch only) -------------------------------------------------------
class _A2A(torch.autograd.Function):
    moved = 0  # bytes handed to other ranks, forward and backward

    @staticmethod
    def forward(ctx, x, out_splits, in_splits):
        ctx.splits = (out_splits, in_splits)
        return _a2a(x, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _a2a(grad, in_splits, out_splits), None, None


def _a2a(x, out_splits, in_splits):
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), x.shape[1]))
    dist.all_to_all_single(out, x, out_splits, in_splits)
    _A2A.moved += (sum(in_splits) - in_splits[dist.get_rank()]) * x.shape[1] * x.element_size()
    return out


def _permute(got, counts, world, local):
    """torchtitan's _permute: rank-major rows to expert-major."""
    t_mat = counts.view(world, local)
    starts = (counts.cumsum(0) - counts).view(world, local).t().reshape(-1)
    lengths = t_mat.t().reshape(-1)
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=got.shape[0])
    out_starts = lengths.cumsum(0) - lengths
    perm = starts[seg] + torch.arange(seg.shape[0]) - out_starts[seg]
    return got[perm], perm, t_mat.sum(0)


class HandExperts(torch.nn.Module):
    """This rank's block of SwiGLU experts — DTensors ``Shard(0)`` on the ep mesh, as torchtitan's
    ``ExpertParallel`` distributes them — and the all-to-all dispatch around them."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, num_experts: int, mesh):
        super().__init__()
        from torch.distributed.tensor import DTensor, Shard

        def shard(t):
            shape = (num_experts,) + tuple(t.shape[1:])
            return torch.nn.Parameter(DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=shape,
                                                         stride=torch.empty(shape, device="meta").stride()))

        self.gate_up_proj, self.down_proj = shard(gate_up), shard(down)
        self.num_experts = num_experts

    def forward(self, x, index, weights):
        world, top_k = dist.get_world_size(), index.shape[1]
        local = self.num_experts // world
        flat = index.view(-1)
        order = torch.argsort(flat, stable=True)
        with torch.no_grad():
            counts = torch.bincount(flat, minlength=self.num_experts)
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts)
            send, recv = torch.stack([counts.view(world, local).sum(1), received.view(world, local).sum(1)]).tolist()
        got = _A2A.apply(x[order // top_k], recv, send)
        rows, perm, per_expert = _permute(got, received, world, local)
        outs = []
        gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
        for e, chunk in enumerate(rows.split(per_expert.tolist())):
            gate, up = torch.nn.functional.linear(chunk, gate_up[e]).chunk(2, dim=-1)
            outs.append(torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down[e]))
        y = torch.cat(outs)
        back = y.new_empty(y.shape)
        back[perm] = y
        returned = _A2A.apply(back, send, recv) * weights.view(-1)[order].unsqueeze(-1)
        index_d = (order // top_k).unsqueeze(-1).expand(-1, x.shape[1])
        return torch.zeros_like(x).scatter_add(0, index_d, returned)


# ---- contenders ---------------------------------------------------------------------------------------
_MESH: Dict[str, Any] = {}


def _full_model(s):
    from anyaccel.strategies.nd.expert import FusedExperts

    torch.manual_seed(0)
    return Net(s, lambda: FusedExperts(s["experts"], s["hidden"], s["intermediate"]))


def _hand_mesh():
    """torchtitan's sparse mesh for ep over every process: ``(efsdp, ep)`` = ``(1, world)``, and
    the data-parallel dimension (both joined) the rest of the model is sharded over."""
    if "mesh" not in _MESH:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("efsdp", "ep"))
        _MESH.update(mesh=mesh, dp=mesh._flatten("dp"))
    return _MESH["mesh"], _MESH["dp"]


def hand_written(s):
    """The hand-written dispatcher (``HandExperts``, weights ``Shard(0)`` on ``mesh["ep"]``), FSDP2
    as torchtitan applies it under ep: each experts module over ``efsdp``, each block and the
    root over the data-parallel processes; the experts' gradients divided by ep after backward
    (torchtitan's ``set_gradient_divide_factor``, which needs PREMUL_SUM, absent on gloo)."""
    from torch.distributed.fsdp import fully_shard

    world, rank = dist.get_world_size(), dist.get_rank()
    local = s["experts"] // world
    full = _full_model(s)
    block = slice(rank * local, (rank + 1) * local)
    net = Net(s, lambda: torch.nn.Identity())
    mesh, dp = _hand_mesh()
    for mine, theirs in zip(net.blocks, full.blocks):
        mine.experts = HandExperts(theirs.experts.gate_up_proj.detach()[block].clone(),
                                   theirs.experts.down_proj.detach()[block].clone(), s["experts"], mesh["ep"])
    shared = {k: v for k, v in full.state_dict().items() if ".experts." not in k}
    missing = net.load_state_dict(shared, strict=False)
    assert all(".experts." in k for k in missing.missing_keys), missing
    for b in net.blocks:
        fully_shard(b.experts, mesh=mesh["efsdp"])
        fully_shard(b, mesh=dp)
    fully_shard(net, mesh=dp)
    experts = [p for b in net.blocks for p in b.experts.parameters()]
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

    def step(ids):
        net(ids).backward()
        for p in experts:  # every rank's tokens are already summed in: one process's gradient is 1/ep of it
            p.grad.div_(world)
        opt.step()
        opt.zero_grad()

    expert_ids = {id(p) for p in experts}
    return net, opt, step, lambda p: id(p) in expert_ids


def with_anyaccel(s):
    """``Accelerator(parallelism_config=ParallelismConfig(ep_size=world))`` (dp_shard = world),
    the model with ``FusedExperts``, the optimizer built before ``prepare`` as users do,
    ``accelerator.backward``."""
    from anyaccel import Accelerator, ParallelismConfig
    from anyaccel.strategies.nd.expert import expert_parameters
    from anyaccel.strategies.options import FSDPOptions

    world = dist.get_world_size()
    acc = Accelerator(parallelism_config=ParallelismConfig(
        dp_shard_size=world, ep_size=world, fsdp=FSDPOptions(transformer_cls_names_to_wrap=["Block"])))
    net = _full_model(s)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    net, opt = acc.prepare(net, opt)

    def step(ids):
        acc.backward(net(ids))
        opt.step()
        opt.zero_grad()

    expert_ids = {id(p) for _, p in expert_parameters(net)}
    _MESH["accelerator"] = acc
    return net, opt, step, lambda p: id(p) in expert_ids


def _stepper(step, batches):
    state = {"i": 0}

    def one():
        ids = batches[state["i"] % len(batches)]
        state["i"] += 1
        step(ids)

    return one


# ---- proof ---------------------------------------------------------------------------------------------
def _theory_bytes(net, hidden: int) -> int:
    """Bytes this rank must hand to others in one step for the routing its blocks saw: per block,
    its pairs whose expert is elsewhere (dispatch) and the pairs others sent it (combine), rows of
    ``hidden`` float32, forward and backward."""
    world, rank = dist.get_world_size(), dist.get_rank()
    total = 0
    for block in net.blocks:
        every = [torch.empty_like(block.last_index) for _ in range(world)]
        dist.all_gather(every, block.last_index.contiguous())
        per_rank = (getattr(block.experts, "num_global_experts", None) or block.experts.num_experts) // world
        owners = [idx // per_rank for idx in every]
        sent = int((owners[rank] != rank).sum())
        received = sum(int((owners[p] == rank).sum()) for p in range(world) if p != rank)
        total += 2 * (sent + received) * hidden * 4
    return total


def _expert_bytes(net, opt, is_expert) -> Dict[str, int]:
    params = [p for p in net.parameters() if is_expert(p)]
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    inner = getattr(opt, "optimizer", opt)  # a prepared optimizer wraps the user's
    state = sum(local(v).numel() * local(v).element_size() for p in params for v in inner.state[p].values()
                if torch.is_tensor(v) and v.dim() > 0)
    return {"params": sum(local(p).numel() * 4 for p in params),
            "full": sum(p.numel() * 4 for p in params), "optimizer": state}


def prove(s, contenders, batches) -> Dict[str, Any]:
    proof: Dict[str, Any] = {"first loss": {}, "bytes": {}, "theory": {}, "expert bytes": {}}
    for name, (net, is_expert, step, opt) in contenders.items():
        with torch.no_grad():
            proof["first loss"][name] = float(net(batches[0]))
        _A2A.moved = 0
        stats = [b.experts.dispatch_stats for b in net.blocks if hasattr(b.experts, "dispatch_stats")]
        for st in stats:
            st.reset()
        step()
        moved = _A2A.moved if not stats else sum(st.bytes_sent for st in stats)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (moved, _theory_bytes(net, s["hidden"])))
        proof["bytes"][name], proof["theory"][name] = [m for m, _ in every], [t for _, t in every]
        proof["expert bytes"][name] = _expert_bytes(net, opt, is_expert)
        if stats:
            counts = torch.tensor(stats[0].tokens_per_expert)
            dist.all_reduce(counts)
            proof["tokens per expert (block 0, all ranks)"] = counts.tolist()
    return proof


def run_step(quick: bool) -> Dict[str, Any]:
    s = QUICK_SIZES if quick else SIZES
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1 + rank)
    batches = [torch.randint(0, s["vocab"], (s["tokens"] // 128, 128), generator=g) for _ in range(4)]
    contenders = {}
    for name, build in ((HAND, hand_written), (HAND + "'", hand_written), (OURS, with_anyaccel)):
        net, opt, step, is_expert = build(s)
        contenders[name] = (net, is_expert, _stepper(step, batches), opt)
    proof = prove(s, {HAND: contenders[HAND], OURS: contenders[OURS]}, batches)
    chunk = 2 if quick else 4

    def measure(step):
        return lambda: common.timed_collective(lambda: [step() for _ in range(chunk)], chunk)

    res = common.interleaved({n: measure(c[2]) for n, c in contenders.items()}, rounds=3 if quick else 12,
                             warmup=1, baseline=HAND)
    calls = {n: common.python_calls((c[2]() for _ in iter(int, 1)), 2, enabled=rank == 0)
             for n, c in contenders.items()}
    _MESH.pop("accelerator").end_training()
    return {"world": dist.get_world_size(), "sizes": s, "proof": proof, "calls": calls,
            "step": common.step_summary(res)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    result = run_step(args.quick)
    if dist.get_rank() == 0:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
