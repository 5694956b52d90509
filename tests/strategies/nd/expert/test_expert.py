"""Expert parallelism without processes (anyaccel.strategies.nd.expert): the dispatcher's maths, the
experts classes against a plain per-token reference, shard_experts' cuts and refusals, the
load-balancing loss against transformers'. The multi-process half: tests/strategies/nd/expert/test_expert_multiprocess.py."""

import pytest
import torch

from anyaccel.strategies.nd.expert import (ExpertGroup, ExpertList, FusedExperts, RemoteExpert, check_divisible,
                                        dense_moe, expert_major_order, expert_parameters, find_experts,
                                        load_balancing_loss, local_experts, moe_forward, shard_experts)


# ---- the maths -----------------------------------------------------------------------------------
@pytest.mark.parametrize("counts, expected", [
    ([[2, 3], [1, 4]], [0, 1, 5, 2, 3, 4, 6, 7, 8, 9]),  # torchtitan's test_basic_2ranks_2experts
    ([[0, 3], [2, 0]], [3, 4, 0, 1, 2]),  # experts without tokens
    ([[4, 2, 5]], list(range(11))),  # one rank: nothing to reorder
    ([[3], [5], [2]], list(range(10))),  # one expert per rank: nothing to reorder
    ([[2, 2], [2, 2], [2, 2]], [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]),
])
def test_expert_major_order(counts, expected):
    assert expert_major_order(torch.tensor(counts)).tolist() == expected


def test_expert_major_order_of_nothing():
    assert expert_major_order(torch.zeros(2, 2, dtype=torch.long)).numel() == 0


def simulated_moe(xs, indices, gates, weights, ranks):
    """What the dispatcher does, with the all-to-alls done by hand between virtual ranks in one
    process (the routing, expert-major order and combine of moe_forward, exchange by exchange)."""
    num = weights.shape[0]
    per_rank = num // ranks
    sends, orders = [], []
    for x, index in zip(xs, indices):
        order = torch.argsort(index.reshape(-1), stable=True)
        counts = torch.bincount(index.reshape(-1), minlength=num).view(ranks, per_rank)
        sends.append((x[order // index.shape[1]].split(counts.sum(1).tolist()), counts))
        orders.append(order)
    back = [[None] * ranks for _ in range(ranks)]  # back[q][p]: rows rank q returns to rank p
    for q in range(ranks):
        recv_counts = torch.stack([sends[p][1][q] for p in range(ranks)])
        received = torch.cat([sends[p][0][q] for p in range(ranks)])
        perm = expert_major_order(recv_counts)
        rows = received[perm]
        out = torch.cat([chunk @ weights[q * per_rank + e].T
                         for e, chunk in enumerate(rows.split(recv_counts.sum(0).tolist()))])
        rank_major = torch.empty_like(out)
        rank_major[perm] = out
        for p, part in enumerate(rank_major.split(recv_counts.sum(1).tolist())):
            back[q][p] = part
    results = []
    for p, (index, gate) in enumerate(zip(indices, gates)):
        returned = torch.cat([back[q][p] for q in range(ranks)])
        pairs = torch.empty_like(returned)
        pairs[orders[p]] = returned
        results.append((pairs.view(*index.shape, -1) * gate.unsqueeze(-1)).sum(1))
    return results


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_the_dispatch_maths_gives_every_token_its_experts(ranks):
    torch.manual_seed(0)
    num, dim, top_k = 8, 5, 3
    weights = torch.randn(num, dim, dim)
    xs = [torch.randn(t, dim) for t in range(2, 2 + ranks)]  # a different number of tokens per rank
    indices = [torch.stack([torch.randperm(num)[:top_k] for _ in range(x.shape[0])]) for x in xs]
    indices[0][:] = torch.tensor([0, 1, 2])  # rank 0 sends only to the first rank(s): empty splits
    gates = [torch.rand(x.shape[0], top_k) for x in xs]
    got = simulated_moe(xs, indices, gates, weights, ranks)
    for x, index, gate, y in zip(xs, indices, gates, got):
        torch.testing.assert_close(y, dense_moe(x, index, gate, lambda e, rows: rows @ weights[e].T))


def test_one_process_moe_forward_is_the_dense_computation_with_gradients():
    torch.manual_seed(0)
    weights = torch.randn(4, 6, 6, requires_grad=True)
    x = torch.randn(7, 6, requires_grad=True)
    index, gate = torch.stack([torch.randperm(4)[:2] for _ in range(7)]), torch.rand(7, 2, requires_grad=True)

    def run(rows, counts, ids):
        assert ids.tolist() == sorted(ids.tolist()) and sum(counts) == rows.shape[0]  # expert-major, grouped
        return torch.cat([c @ weights[e].T for e, c in enumerate(rows.split(counts))])

    y = moe_forward(x, index, gate, run, 4, ExpertGroup())
    grads = torch.autograd.grad(y.square().sum(), (x, gate, weights))
    ref = dense_moe(x, index, gate, lambda e, rows: rows @ weights[e].T)
    ref_grads = torch.autograd.grad(ref.square().sum(), (x, gate, weights))
    torch.testing.assert_close(y, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_a_router_choice_outside_the_experts_is_an_error():
    with pytest.raises(ValueError, match="the router chose expert 9, but the layer has 4 experts"):
        moe_forward(torch.randn(2, 3), torch.tensor([[0, 9], [1, 2]]), torch.rand(2, 2),
                    lambda r, c, i: r, 4, ExpertGroup())


# ---- the experts classes -------------------------------------------------------------------------------
def _swiglu(experts, e, rows):
    gate, up = torch.nn.functional.linear(rows, experts.gate_up_proj[e]).chunk(2, dim=-1)
    return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, experts.down_proj[e])


def test_fused_experts_compute_what_each_expert_computes():
    torch.manual_seed(0)
    experts = FusedExperts(4, 8, 16)
    x, index, gate = torch.randn(9, 8), torch.stack([torch.randperm(4)[:2] for _ in range(9)]), torch.rand(9, 2)
    torch.testing.assert_close(experts(x, index, gate), dense_moe(x, index, gate, lambda e, r: _swiglu(experts, e, r)))
    assert experts.gate_up_proj.shape == (4, 32, 8) and experts.down_proj.shape == (4, 8, 16)  # transformers' layout


def test_expert_list_runs_every_expert_so_each_has_a_gradient():
    torch.manual_seed(0)
    experts = ExpertList(torch.nn.Linear(4, 4) for _ in range(4))
    x, index, gate = torch.randn(5, 4), torch.tensor([[0, 1]] * 5), torch.rand(5, 2)
    torch.testing.assert_close(experts(x, index, gate), dense_moe(x, index, gate, lambda e, r: experts[e](r)))
    experts(x, index, gate).sum().backward()
    assert all(p.grad is not None for p in experts.parameters())  # experts 2 and 3 got no token: zero gradients
    assert float(experts[3].weight.grad.abs().sum()) == 0.0
    assert list(experts.state_dict()) == list(torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4)).state_dict())


# ---- splitting ---------------------------------------------------------------------------------------------
def test_check_divisible_names_both_numbers_and_the_choices():
    assert check_divisible(8, 4) == 2 and local_experts(8, ExpertGroup(size=4, rank=3)) == range(6, 8)
    with pytest.raises(ValueError, match=r"layers.0.mlp.experts hold 8 experts, which ep_size=3 does not divide.*"
                                         r"\[1, 2, 4, 8\]"):
        check_divisible(8, 3, "layers.0.mlp.experts")


def test_expert_group_refuses_impossible_values():
    with pytest.raises(ValueError, match="rank 2 of size 2"):
        ExpertGroup(size=2, rank=2)
    with pytest.raises(ValueError, match="loss group .2 processes. must contain the ep group .4"):
        ExpertGroup(size=4, rank=0, loss_group=object(), loss_size=2)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(4, 4)
        self.fused = FusedExperts(4, 4, 2)
        self.listed = ExpertList(torch.nn.Linear(4, 4) for _ in range(4))


def test_shard_experts_keeps_this_ranks_block_under_the_same_names():
    torch.manual_seed(0)
    block = Block()
    full = {k: v.clone() for k, v in block.state_dict().items()}
    names = shard_experts(block, ExpertGroup(size=2, rank=1))  # local: each process cuts its own copy
    assert names == ["fused", "listed"]
    assert torch.equal(block.fused.gate_up_proj, full["fused.gate_up_proj"][2:4])  # experts 2, 3
    assert type(block.fused).__name__ == "ExpertParallelFusedExperts" and isinstance(block.fused, FusedExperts)
    assert block.fused.held == range(2, 4) and block.fused.num_experts == 2 and block.fused.num_global_experts == 4
    assert isinstance(block.listed[0], RemoteExpert) and block.listed[3] is not None
    state = block.state_dict()
    assert set(state) == set(full) - {"listed.0.weight", "listed.0.bias", "listed.1.weight", "listed.1.bias"}
    assert torch.equal(state["listed.3.weight"], full["listed.3.weight"])  # the unsharded model's key
    assert {n for n, _ in expert_parameters(block)} == {"fused.gate_up_proj", "fused.down_proj", "listed.2.weight",
                                                         "listed.2.bias", "listed.3.weight", "listed.3.bias"}
    assert "rank 1 of 2 holds experts 2..3 of 4" in repr(block.fused)
    with pytest.raises(RuntimeError, match="expert 0 is held by ep rank 0"):
        block.listed[0](torch.randn(1, 4))
    with pytest.raises(ValueError, match="already split"):
        shard_experts(block, ExpertGroup(size=2, rank=1), modules="fused")


def test_shard_experts_refuses_before_changing_anything():
    block = Block()
    with pytest.raises(ValueError, match="fused hold 4 experts, which ep_size=3 does not divide"):
        shard_experts(block, ExpertGroup(size=3, rank=0))
    assert block.fused.gate_up_proj.shape[0] == 4 and type(block.fused) is FusedExperts
    with pytest.raises(ValueError, match=r"pattern\(s\) \['experts'\] match no module"):
        shard_experts(block, ExpertGroup(size=2, rank=0), modules="experts")
    with pytest.raises(ValueError, match="has no experts module"):
        shard_experts(torch.nn.Linear(2, 2), ExpertGroup(size=2, rank=0))
    block.fused.register_parameter("shared", torch.nn.Parameter(torch.zeros(3, 4)))
    with pytest.raises(ValueError, match=r"fused.shared has shape \(3, 4\), but its dimension 0 must be the 4 experts"):
        shard_experts(block, ExpertGroup(size=2, rank=0), modules="fused")


# ---- transformers ------------------------------------------------------------------------------------------
def _qwen3_moe():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=8, num_experts=8, num_experts_per_tok=2)
    return transformers.Qwen3MoeForCausalLM(config)


def test_transformers_experts_are_found_through_the_models_ep_plan():
    model = _qwen3_moe()
    assert [n for n, _ in find_experts(model)] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    shard_experts(model, ExpertGroup(size=4, rank=2))
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.shape == (2, 16, 16) and experts.num_experts == 2 and experts.held == range(4, 6)
    assert type(experts).__name__ == "ExpertParallelQwen3MoeExperts"


def test_load_balancing_loss_is_transformers_in_one_process():
    pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    torch.manual_seed(0)
    logits = tuple(torch.randn(12, 8, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    for m in (None, mask):
        ours, theirs = load_balancing_loss(logits, 8, 2, m), load_balancing_loss_func(logits, 8, 2, m)
        torch.testing.assert_close(ours, theirs)
        for a, b in zip(torch.autograd.grad(ours, logits), torch.autograd.grad(theirs, logits)):
            torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="output_router_logits=True"):
        load_balancing_loss(None, 8, 2)


# ---- review fixes (wip/epreview) -------------------------------------------------------------------
class _Mesh:
    def __init__(self, *sizes):
        self.sizes = sizes

    def size(self, dim=None):
        import math

        return math.prod(self.sizes) if dim is None else self.sizes[dim]


class _Grad:
    def __init__(self, mesh, placements):
        import types

        self._spec = types.SimpleNamespace(mesh=mesh, placements=placements)


def test_clip_norm_counts_an_expert_list_expert_once_per_ep_group():
    """dp_shard 4 x ep 2 (efsdp 2), tp 2: 8 processes per stage. A fused expert weight lives on
    (efsdp, ep) — held once per tp rank; an ExpertList expert is FSDP-sharded over efsdp only, and
    the other ep rank holds *another* expert: still 2 copies (tp), not 4 (ep x tp); the norm
    divided by 4 undercounted those experts by ep."""
    from torch.distributed.tensor import Replicate, Shard

    from anyaccel.strategies.nd.strategy import _copies

    assert _copies(_Grad(_Mesh(2, 2), (Shard(0), Shard(0))), 8) == 2  # fused: (efsdp, ep)
    assert _copies(_Grad(_Mesh(2), (Shard(0),)), 8) == 4  # a dense weight on a 2-rank mesh: as before
    assert _copies(_Grad(_Mesh(2), (Shard(0),)), 8, ep=2) == 2  # an ExpertList expert on efsdp
    assert _copies(_Grad(_Mesh(2, 1), (Replicate(), Shard(0))), 8, ep=2) == 8 // 2 // 2 * 2  # HSDP replicas count


def test_a_split_expert_list_refuses_a_full_state_dict_with_the_fix():
    """save_model / get_state_dict under ep gathered only rank 0's ExpertList experts (the others
    are placeholders there) and wrote an incomplete file set without a word; now refused, naming
    the module and the fix. Fused experts (DTensors) are gathered whole: no refusal."""
    from anyaccel.strategies.nd.expert.parallelize import full_state_problem

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), ExpertList(torch.nn.Linear(4, 4) for _ in range(4)))
    assert full_state_problem(model, "save_model") is None  # not split: a plain ModuleList's state
    shard_experts(model, ExpertGroup(size=2, rank=1))
    problem = full_state_problem(model, "save_model")
    assert problem and "['1']" in problem and "save_state" in problem and "FusedExperts" in problem
    fused = torch.nn.Sequential(FusedExperts(4, 8, 16))
    shard_experts(fused, ExpertGroup(size=2, rank=0))
    assert full_state_problem(fused, "save_model") is None


def test_the_global_aux_loss_hook_reads_a_positional_attention_mask():
    """model(input_ids, attention_mask): the hook took the mask from keywords only, so the global
    auxiliary loss counted padding that the model's own (one process's) leaves out."""
    from anyaccel.strategies.nd.expert.parallelize import _attention_mask

    class Model(torch.nn.Module):
        def forward(self, input_ids=None, attention_mask=None, labels=None):
            return input_ids

    mask = torch.tensor([[1, 1, 0]])
    ids = torch.zeros(1, 3, dtype=torch.long)
    assert _attention_mask(Model(), (ids, mask), {}) is mask
    assert _attention_mask(Model(), (ids,), {"attention_mask": mask}) is mask
    assert _attention_mask(Model(), (ids,), {}) is None


def test_prepare_refuses_a_model_whose_experts_are_already_split():
    """shard_experts by hand, then prepare() under DDP/FSDP: the experts of different ep ranks would
    be averaged together (or overwritten by rank 0's under nd) without a word; refused with the fix."""
    from anyaccel.strategies.base import refuse_split_experts

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), ExpertList(torch.nn.Linear(4, 4) for _ in range(4)))
    refuse_split_experts(model)  # unsplit: fine
    shard_experts(model, ExpertGroup(size=1, rank=0))
    refuse_split_experts(model)  # "split" over one rank holds every expert: fine
    split = torch.nn.Sequential(FusedExperts(4, 8, 16))
    shard_experts(split, ExpertGroup(size=2, rank=1))
    with pytest.raises(ValueError, match=r"\['0'\] of Sequential is already split over 2 ep ranks.*ep_size=2"):
        refuse_split_experts(split)


# ---- review leftovers (wip/epleft) ---------------------------------------------------------------
def _nd(monkeypatch, world_size, rank=0, **sizes):
    """The nd strategy of a job of ``world_size`` processes, built in this one (nothing collective
    is called: the ep group is this rank's, without a process group)."""
    import dataclasses

    from anyaccel import ParallelismConfig
    from anyaccel.backends import backend_class
    from anyaccel.environment import resolve_environment
    from anyaccel.strategies import create_strategy
    from anyaccel.strategies.nd.expert import parallelize

    env = dataclasses.replace(resolve_environment(cpu=True), world_size=world_size)
    strategy = create_strategy(env, backend_class("cpu")(env), "nd", options=ParallelismConfig(**sizes))
    ep = sizes["ep_size"]
    monkeypatch.setattr(parallelize, "expert_group_of", lambda mesh: ExpertGroup(size=ep, rank=rank))
    return strategy


def test_a_pipeline_stage_of_dense_layers_only_is_left_as_it_is(monkeypatch):
    """Qwen3-MoE with mlp_only_layers=[0] (DeepSeek-style dense first layer) cut into 2 stages: the
    first stage has no experts module; split_experts raised 'has no experts module' on it. Now the
    whole model is checked before the cut, and a dense stage is skipped."""
    from anyaccel.strategies.nd.expert.parallelize import check_has_experts, split_experts
    from anyaccel.strategies.nd.pipeline import split

    transformers = pytest.importorskip("transformers")
    config = dict(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(mlp_only_layers=[0], **config))
    strategy = _nd(monkeypatch, 4, pp_size=2, dp_shard_size=2, ep_size=2)
    strategy._check_whole_plan(model)  # one MoE layer in the whole model: fine
    plan = split.plan_stages(model, 2)
    stages = [split.stage_module(model, plan, s) for s in (0, 1)]
    assert split_experts(stages[0], ExpertGroup(size=2, rank=0), stage=True) == []  # layer 0: dense
    with pytest.raises(ValueError, match=r"ep_size=2\): expert parallelism: .* has no experts module"):
        split_experts(stages[0], ExpertGroup(size=2, rank=0))  # a whole model (not a stage) still must have one
    strategy._expert_parallel(stages[0])  # what wrap() does on each stage of this rank: no error
    strategy._expert_parallel(stages[1])
    assert model.model.layers[1].mlp.experts.held == range(0, 2)
    dense = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(mlp_only_layers=[0, 1], **config))
    with pytest.raises(ValueError, match=r"ParallelismConfig\(ep_size=2\): expert parallelism: Qwen3MoeForCausalLM has "
                                         "no experts module"):
        strategy._check_whole_plan(dense)  # before the cut: the same refusal as without pp
    with pytest.raises(ValueError, match="has no experts module"):
        check_has_experts(dense, 2)


def test_deepspeed_refuses_a_model_whose_experts_are_already_split():
    """The deepspeed strategy built its engine around a model split by hand (shard_experts): ZeRO
    averaged the gradients of different experts without a word. Refused like every strategy."""
    pytest.importorskip("deepspeed")
    from anyaccel.backends import backend_class
    from anyaccel.environment import resolve_environment
    from anyaccel.strategies import create_strategy

    env = resolve_environment(cpu=True)
    strategy = create_strategy(env, backend_class("cpu")(env), "deepspeed")
    split = torch.nn.Sequential(torch.nn.Linear(4, 4), FusedExperts(4, 8, 16))
    shard_experts(split, ExpertGroup(size=2, rank=0))
    with pytest.raises(ValueError, match=r"\['1'\] of Sequential is already split over 2 ep ranks.*ep_size=2"):
        strategy.prepare_model(split, device_placement=False, evaluation_mode=False)
    assert strategy.engine is None


def test_the_full_optimizer_state_of_a_split_expert_list_is_refused_before_any_collective(monkeypatch):
    """optimizer_state_dict gathered only rank 0's ExpertList experts' state: now refused on every
    rank (a local check, before the gather), naming the module and the way out; loading one too."""
    strategy = _nd(monkeypatch, 2, dp_shard_size=2, ep_size=2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), ExpertList(torch.nn.Linear(4, 4) for _ in range(4)))
    shard_experts(model, ExpertGroup(size=2, rank=0))
    strategy._track(model, model, {})
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"ep_size=2\): the full optimizer state dict \(optimizer_state_dict\): "
                                         r"\['1'\] is an ExpertList split .*save_state/load_state.*FusedExperts"):
        strategy.optimizer_state_dict(optimizer)
    with pytest.raises(ValueError, match="loading a full optimizer state dict: .*save_state/load_state"):
        strategy.load_optimizer_state_dict(optimizer, {})
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # not this model's: not refused
    assert strategy.optimizer_state_dict(other)["param_groups"][0]["lr"] == 0.1


def test_a_model_prepared_for_evaluation_under_ep_has_its_experts_split(monkeypatch):
    """prepare(model) without an optimizer under ep_size=2 left the experts whole on every process
    without a word; now split like a trained model's (same dispatcher). A model without experts
    (a dense reward model) is left as it is."""
    strategy = _nd(monkeypatch, 2, rank=1, dp_shard_size=2, ep_size=2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), FusedExperts(4, 4, 8))
    full = model[1].gate_up_proj.detach().clone()
    prepared = strategy.prepare_model(model, device_placement=False, evaluation_mode=True)
    assert prepared[1].held == range(2, 4) and torch.equal(prepared[1].gate_up_proj, full[2:4])
    frozen = torch.nn.Sequential(ExpertList(torch.nn.Linear(4, 4) for _ in range(2))).requires_grad_(False)
    strategy.prepare_model(frozen, device_placement=False, evaluation_mode=False)  # nothing to train: evaluation too
    assert isinstance(frozen[0][0], RemoteExpert) and frozen[0].held == range(1, 2)
    dense = torch.nn.Linear(4, 4)
    assert strategy.prepare_model(dense, device_placement=False, evaluation_mode=True) is dense
    again = strategy.prepare_model(model, device_placement=False, evaluation_mode=True)  # split already: as it is
    assert again[1].held == range(2, 4)


def test_expert_parallel_rank_is_the_mesh_coordinate_and_0_without_ep():
    """``accelerator.expert_parallel_rank`` reads the ep coordinate of the strategy's process mesh,
    like the other ``*_rank`` properties (here the 8 ranks of dp_replicate 2 x dp_shard 4 x ep 2,
    answered without processes); 0 without a parallelism_config or with ep_size=1."""
    from anyaccel import Accelerator, ParallelismConfig
    from anyaccel.strategies.mesh import ProcessMesh

    plain = Accelerator(cpu=True)
    try:
        assert plain.expert_parallel_rank == 0
    finally:
        plain.end_training()
    accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig())
    strategy = accelerator.strategy
    one = strategy.process_mesh
    try:
        assert accelerator.expert_parallel_rank == 0
        seen = []
        for rank in range(8):
            strategy.process_mesh = ProcessMesh({"dp_replicate": 2, "dp_shard": 4}, rank, ep=2)
            seen.append((accelerator.expert_parallel_rank, accelerator.data_parallel_shard_rank,
                         accelerator.data_parallel_rank))
        assert seen == [(0, 0, 0), (1, 1, 0), (0, 2, 0), (1, 3, 0), (0, 0, 1), (1, 1, 1), (0, 2, 1), (1, 3, 1)]
    finally:
        strategy.process_mesh = one
        accelerator.end_training()


def test_the_auxiliary_loss_under_pp_with_ep_is_refused_and_a_refusal_hook_refuses_per_call():
    """pp x ep: the auxiliary loss is not computed across pipeline stages; refused (at prepare, before
    the experts are split) naming the sizes and the fix; with ``hook``, a call asking for router
    logits is refused too."""
    transformers = pytest.importorskip("transformers")
    from anyaccel.strategies.nd.expert.parallelize import refuse_aux_loss

    def qwen(**kw):
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            vocab_size=16, hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2, **kw))

    with pytest.raises(ValueError, match=r"ParallelismConfig\(pp_size=2, ep_size=2\): the auxiliary .* across pipeline "
                                         r"stages .*output_router_logits=False.* pp_size=1 with ep"):
        refuse_aux_loss(qwen(output_router_logits=True), "pp_size=2, ep_size=2", "pp", hook=False)
    model = qwen()
    handle = refuse_aux_loss(model, "pp_size=2, ep_size=2", "pp")
    ids = torch.randint(0, 16, (1, 4))
    assert model(input_ids=ids, labels=ids).loss is not None  # without router logits: as it is
    with pytest.raises(ValueError, match="output_router_logits=False"):
        model(input_ids=ids, labels=ids, output_router_logits=True)
    handle.remove()
    assert refuse_aux_loss(torch.nn.Linear(2, 2), "pp_size=2, ep_size=2", "pp") is None  # no auxiliary loss
