"""Expert parallelism (anyaccel.strategies.nd.expert) on real CPU processes, each job checked against one
process on the same global batch (every rank computes the one-process reference itself).

    anyaccel launch --num_processes 4 --cpu expert_checks.py OUT    # what the test runs
    anyaccel launch --num_processes 2 --cpu expert_checks.py OUT    # the same jobs on 2 processes

The ep groups are made by hand (``torch.distributed.new_group``) until the N-D mesh names them; the
gradient reduction FSDP will do is written out (``sync_gradients``). Jobs, in the same processes:

* ``qwen``: a tiny transformers Qwen3-MoE (8 experts, top-2, 2 MoE layers), experts split by its
  own ``base_model_ep_plan``, ep2 (on 4 processes: ep2 x 2 replicas, so the loss group is twice the
  ep group), the auxiliary loss over the global batch; 3 AdamW steps. Recorded: losses, aux losses,
  gradients after the first backward, weights after the steps, routing counts per layer and
  expert, and the aux loss reduced over the ep group only (must differ on 4 processes);
* ``checkpoint``: the trained ep model's full state dict (gathered) against the reference; a DCP
  checkpoint written under ep loaded by one plain process, and one written by a plain process
  loaded under ep;
* ``mixtral``: a tiny Mixtral (4 experts, top-2, eager experts) with ep over every process;
* ``own``: a model of ours — router + ``ExpertList`` of MLPs (ep over every process) and a
  ``FusedExperts`` layer (ep2) — and a DCP round trip of the list layout;
* ``dispatch``: a routing crafted so that every token goes to expert 0 (ranks other than 0 receive
  nothing, empty splits) through ``moe_forward``: output, input gradients, bytes moved vs theory.
* then the jobs of expert_nd_checks.py: the same kind of models through the ``nd`` strategy
  (``ParallelismConfig(ep_size=...)``: ep x FSDP, HSDP with ep, ep x tp, checkpoints, save_model).

Each rank writes OUT/<job>_rank<r>.json.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
import rank_results  # tests/scripts: on the job's PYTHONPATH (tests/conftest.py clean_env)

from anyaccel import Accelerator
from anyaccel.strategies.nd.expert import (ExpertGroup, ExpertList, FusedExperts, dense_moe, expert_group,
                                        expert_parameters, load_balancing_loss, moe_forward, shard_experts,
                                        with_global_aux_loss)

STEPS, BATCH, SEQ, VOCAB, LR = 3, 2, 8, 64, 3e-3


def groups(ep_size):
    """The ep groups (consecutive ranks) and the replica groups (same ep rank); every rank creates
    all of them, in the same order, as new_group requires."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ep = [dist.new_group(list(range(s, s + ep_size))) for s in range(0, world, ep_size)]
    replicas = [dist.new_group(list(range(r, world, ep_size))) for r in range(ep_size)]
    return ep[rank // ep_size], replicas[rank % ep_size]


def write(out, job, result):
    rank_results.write(out, job, dist.get_rank(), result)


def global_batch(seed, world):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (world * BATCH, SEQ), generator=g)


def mine(batch):
    rank = dist.get_rank()
    return batch[rank * BATCH:(rank + 1) * BATCH]


def sync_gradients(model, replica_groups):
    """What FSDP will do: non-expert gradients averaged over every process (the loss group); expert
    gradients (each already summing its ep group's tokens) summed over the replicas holding the
    same experts (``replica_groups``: experts module name -> group), divided by the loss group's size."""
    world = dist.get_world_size()
    if not isinstance(replica_groups, dict):
        replica_groups = {"": replica_groups}
    owner = {}
    for name, p in expert_parameters(model):
        owner[id(p)] = next(g for prefix, g in replica_groups.items() if name.startswith(prefix))
    for p in model.parameters():
        if p.grad is None:
            continue
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        dist.all_reduce(local, group=owner.get(id(p)))
        local.div_(world)


def local_block(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def compare(model, reference, grads=True):
    """Largest difference of each parameter (or its gradient) to the reference, on this rank's block."""
    ref = dict(reference.named_parameters())
    worst, worst_name, scale = 0.0, "", 0.0
    for name, p in model.named_parameters():
        mine_ = local_block(p.grad if grads else p.detach())
        full = ref[name].grad if grads else ref[name].detach()
        if mine_.shape != full.shape:  # an expert block: rows [rank * n, (rank + 1) * n) of the full tensor
            n = mine_.shape[0]
            held = next(m.held for m_name, m in model.named_modules() if name.startswith(m_name + ".")
                        and hasattr(m, "held"))
            full = full[held.start:held.start + n]
        diff = float((mine_ - full).abs().max())
        scale = max(scale, float(full.abs().max()))
        if diff >= worst:
            worst, worst_name = diff, name
    return {"max_diff": worst, "worst": worst_name, "scale": scale}


def routing_counts(model, reference_logits, top_k, num_experts):
    """(ours, one process's) pairs per expert per layer: ours summed over every process."""
    ours = [m.dispatch_stats.tokens_per_expert for _, m in sorted(
        ((n, m) for n, m in model.named_modules() if hasattr(m, "dispatch_stats")), key=lambda x: x[0])]
    summed = torch.tensor(ours)
    dist.all_reduce(summed)
    theirs = [torch.bincount(torch.topk(torch.softmax(l, -1), top_k, -1).indices.reshape(-1),
                             minlength=num_experts).tolist() for l in reference_logits]
    return summed.tolist(), theirs


def moe_job(out, job, model, ep_size, top_k, num_experts):
    """Train ``model`` split over ep groups of ``ep_size`` next to an unsplit copy on the global batch."""
    world = dist.get_world_size()
    reference = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
    ep_group, replica_group = groups(ep_size)
    eg = expert_group(ep_group)  # the loss group: every process
    names = shard_experts(model, eg)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1) for m in (model, reference))
    result = {"sharded": names, "losses": [], "ref_losses": [], "aux": [], "ref_aux": [], "counts": [],
              "ref_counts": [], "expert_params": sum(local_block(p).numel() for _, p in expert_parameters(model)),
              "expert_params_total": sum(p.numel() for n, p in reference.named_parameters() if ".experts." in n),
              "ep_size": ep_size}
    for step in range(STEPS):
        batch = global_batch(step, world)
        out_ = with_global_aux_loss(model(input_ids=mine(batch), labels=mine(batch), output_router_logits=True),
                                    model, eg)
        out_.loss.backward()
        ref_out = reference(input_ids=batch, labels=batch, output_router_logits=True)
        ref_out.loss.backward()
        loss = out_.loss.detach().clone()
        dist.all_reduce(loss)  # each rank: its tokens' cross entropy + the global aux term; the job's: the mean
        result["losses"].append(loss.item() / world)
        result["ref_losses"].append(ref_out.loss.item())
        result["aux"].append(out_.aux_loss.item())
        result["ref_aux"].append(ref_out.aux_loss.item())
        counts, ref_counts = routing_counts(model, ref_out.router_logits, top_k, num_experts)
        result["counts"].append(counts)
        result["ref_counts"].append(ref_counts)
        if step == 0:
            only_ep = ExpertGroup(group=eg.group, size=eg.size, rank=eg.rank, loss_group=ep_group, loss_size=ep_size)
            result["aux_over_ep_group_only"] = load_balancing_loss(
                out_.router_logits, num_experts, top_k, ep=only_ep).item()
        sync_gradients(model, replica_group)
        if step == 0:
            result["grads"] = compare(model, reference)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    result["weights"] = compare(model, reference, grads=False)
    result["moved"] = max(float((p.detach() - initial[n]).abs().max()) for n, p in reference.named_parameters())
    write(out, job, result)
    return model, reference, eg


def qwen(num_experts=8, num_layers=2):
    transformers.set_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=num_experts, num_experts_per_tok=2,
        norm_topk_prob=True, router_aux_loss_coef=0.02, max_position_embeddings=64)
    return transformers.Qwen3MoeForCausalLM(config)


def mixtral():
    transformers.set_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
        max_position_embeddings=64, experts_implementation="eager")
    return transformers.MixtralForCausalLM(config)


def checkpoint_job(out, model, reference, eg):
    """Full state dict gathered from the ep model; DCP ep -> one plain process; plain -> ep."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    ref = reference.state_dict()
    result = {"full_keys_equal": sorted(full) == sorted(ref),
              "full_max_diff": max(float((full[k] - ref[k]).abs().max()) for k in ref),
              "full_worst": max(ref, key=lambda k: float((full[k] - ref[k]).abs().max())),
              "full_shapes_equal": all(tuple(full[k].shape) == tuple(ref[k].shape) for k in ref)}
    ep_dir, plain_dir = os.path.join(out, "ckpt_ep"), os.path.join(out, "ckpt_plain")
    dcp.save(model.state_dict(), checkpoint_id=ep_dir)
    if dist.get_rank() == 0:  # a plain one-process model reads the ep checkpoint, and writes its own
        plain = qwen()
        state = plain.state_dict()
        dcp.load(state, checkpoint_id=ep_dir, no_dist=True)
        result["ep_to_plain_max_diff_to_gathered"] = max(float((state[k] - full[k]).abs().max()) for k in full)
        dcp.save(reference.state_dict(), checkpoint_id=plain_dir, no_dist=True)
    dist.barrier()
    fresh = qwen()
    shard_experts(fresh, eg)
    dcp.load(fresh.state_dict(), checkpoint_id=plain_dir)
    result["plain_to_ep"] = compare(fresh, reference, grads=False)
    write(out, "checkpoint", result)


# ---- a model of ours -------------------------------------------------------------------------------
class MLP(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class MoE(torch.nn.Module):
    """A router of ours (softmax, top-k, renormalised) in front of an experts module of the interface."""

    def __init__(self, dim, experts, top_k=2):
        super().__init__()
        self.router = torch.nn.Linear(dim, experts.num_experts, bias=False)
        self.experts, self.top_k = experts, top_k

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat)
        weights, index = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(flat, index, weights).view_as(x), logits


class Own(torch.nn.Module):
    def __init__(self, dim=16, experts=4):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.moe1 = MoE(dim, ExpertList(MLP(dim) for _ in range(experts)))
        self.moe2 = MoE(dim, FusedExperts(experts, dim, dim))
        self.head = torch.nn.Linear(dim, VOCAB)
        self.loss_group = None  # an ExpertGroup once split: whose statistics make the global batch

    def forward(self, ids):
        x = self.embed(ids)
        y, l1 = self.moe1(x)
        x = x + y
        y, l2 = self.moe2(x)
        logits = self.head(x + y)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        return loss + 0.05 * load_balancing_loss((l1, l2), 4, 2, ep=self.loss_group)


def own_job(out):
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = Own()
    reference = copy.deepcopy(model)
    world_group, _ = groups(world)
    pair_group, pair_replicas = groups(2)
    everyone = expert_group(world_group)
    names = shard_experts(model, everyone, modules="moe1.experts") + shard_experts(model, expert_group(pair_group),
                                                                                   modules="moe2.experts")
    model.loss_group = everyone
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=LR) for m in (model, reference))
    result = {"sharded": names, "losses": [], "ref_losses": [],
              "list_experts_held": sorted({n.split(".")[2] for n, _ in expert_parameters(model) if "moe1" in n})}
    for step in range(STEPS):
        batch = global_batch(10 + step, world)
        loss = model(mine(batch))
        loss.backward()
        ref_loss = reference(batch)
        ref_loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        result["losses"].append(total.item() / world)
        result["ref_losses"].append(ref_loss.item())
        sync_gradients(model, {"moe1": None if world == 1 else groups_single(), "moe2": pair_replicas})
        if step == 0:
            result["grads"] = compare(model, reference)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    result["weights"] = compare(model, reference, grads=False)
    ckpt = os.path.join(out, "ckpt_own")
    dcp.save(model.state_dict(), checkpoint_id=ckpt)
    if dist.get_rank() == 0:
        torch.manual_seed(1)
        plain = Own()
        state = plain.state_dict()
        dcp.load(state, checkpoint_id=ckpt, no_dist=True)
        ref = reference.state_dict()
        result["list_ckpt_keys_equal"] = sorted(state) == sorted(ref)
        result["list_ckpt_max_diff"] = max(float((state[k] - ref[k]).abs().max()) for k in ref)
    write(out, "own", result)


_SELF = {}


def groups_single():
    """A group of this process alone (the replicas of an ep group spanning every process)."""
    if not _SELF:
        for r in range(dist.get_world_size()):
            _SELF[r] = dist.new_group([r])
    return _SELF[dist.get_rank()]


# ---- the dispatcher alone ----------------------------------------------------------------------------
def dispatch_job(out):
    world, rank = dist.get_world_size(), dist.get_rank()
    eg = expert_group()
    dim, top_k, num = 6, 2, 2 * world
    torch.manual_seed(0)
    weights = torch.randn(num, dim, dim)
    result = {}
    for case in ("to expert 0 and 1", "random"):
        g = torch.Generator().manual_seed(100 + rank)
        tokens = 3 + rank  # a different number of tokens on every rank
        x = torch.randn(tokens, dim, generator=g, requires_grad=True)
        if case == "random":
            index = torch.stack([torch.randperm(num, generator=g)[:top_k] for _ in range(tokens)])
        else:  # every pair to rank 0: the others receive nothing
            index = torch.tensor([[0, 1]] * tokens)
        gate = torch.rand(tokens, top_k, generator=g)
        held = range(rank * 2, rank * 2 + 2)

        def run(rows, counts, ids):
            return torch.cat([c @ weights[held[l]].T for l, c in enumerate(rows.split(counts))])

        from anyaccel.strategies.nd.expert import DispatchStats

        stats = DispatchStats()
        y = moe_forward(x, index, gate, run, num, eg, stats)
        y.backward(torch.ones_like(y))
        x_ref = x.detach().clone().requires_grad_()
        y_ref = dense_moe(x_ref, index, gate, lambda e, rows: rows @ weights[e].T)
        y_ref.backward(torch.ones_like(y_ref))
        every = [None] * world
        dist.all_gather_object(every, index.tolist())
        sent = sum(1 for t in every[rank] for e in t if e // 2 != rank)
        received = sum(1 for r, idx in enumerate(every) if r != rank for t in idx for e in t if e // 2 == rank)
        result[case] = {"out_diff": float((y - y_ref).detach().abs().max()), "grad_diff": float((x.grad - x_ref.grad).abs().max()),
                        "bytes_sent": stats.bytes_sent, "theory": 2 * (sent + received) * dim * 4,
                        "rows_received": sum(stats.rows_per_local_expert)}
    write(out, "dispatch", result)


def main(out):
    accelerator = Accelerator(cpu=True)  # the process group, as a user's script has it
    world = dist.get_world_size()
    model, reference, eg = moe_job(out, "qwen", qwen(), 2, 2, 8)
    checkpoint_job(out, model, reference, eg)
    moe_job(out, "mixtral", mixtral(), world, 2, 4)
    own_job(out)
    dispatch_job(out)
    import expert_nd_checks  # phase 2: the same models through ParallelismConfig(ep_size=...), in these processes

    for nd in reversed(expert_nd_checks.main(out, qwen, mixtral)):
        nd.end_training()
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
