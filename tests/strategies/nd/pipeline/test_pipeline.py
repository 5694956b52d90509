"""Pipeline parallelism, the parts that need no processes: the ``pp_*`` options, how a model is cut
into stages that keep its parameter names, where stages go, the refusals, and
``accelerator.pipeline_step`` without stages (one process). The multi-process runs are in
tests/strategies/nd/pipeline/test_pipeline_multiprocess.py."""

import copy
import dataclasses

import pytest
import torch

from anyaccel import Accelerator, ParallelismConfig
from anyaccel.strategies import create_strategy
from anyaccel.strategies.nd.pipeline import split
from anyaccel.strategies.options import FSDPOptions
from anyaccel.strategies.nd.pipeline.schedule import stage_ranks


# ---- options ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, canonical, per_rank", [
    ("gpipe", "GPipe", 1), ("1f1b", "1F1B", 1), ("INTERLEAVED1F1B", "Interleaved1F1B", 2),
    ("loopedbfs", "LoopedBFS", 2), ("InterleavedZeroBubble", "InterleavedZeroBubble", 2),
    ("zbvzerobubble", "ZBVZeroBubble", 2), ("dualpipev", "DualPipeV", 2),
])
def test_schedules_by_torchs_names_in_any_case(name, canonical, per_rank):
    config = ParallelismConfig(pp_schedule=name)
    assert (config.pp_schedule, config.pp_stages_per_rank) == (canonical, per_rank)
    assert ParallelismConfig().pp_schedule == "1F1B" and ParallelismConfig().pp_microbatches is None


@pytest.mark.parametrize("kwargs, needle", [
    ({"pp_schedule": "pipedream"}, r"^ParallelismConfig.pp_schedule has the value 'pipedream' \(torch.distributed."
                                   r"pipelining's schedule names, any case\); allowed: one of 1F1B, GPipe, Interleaved1F1B"),
    ({"pp_schedule": "1F1B", "pp_stages_per_rank": 2}, "runs 1 stage per rank"),
    ({"pp_schedule": "ZBVZeroBubble", "pp_stages_per_rank": 3}, "runs 2 stages per rank"),
    ({"pp_microbatches": 0}, r"^ParallelismConfig.pp_microbatches has the value 0; allowed: an integer >= 1$"),
    ({"pp_split_points": 2}, r"pp_split_points has the value 2 \(an integer\); allowed: module names without spaces"),
    ({"pp_split_points": ("a", "b c")}, r"has the value \('a', 'b c'\); allowed: module names without spaces"),
    ({"pp_size": 2, "pp_split_points": ("a", "b")}, r"2 name\(s\) for pp_size=2 x pp_stages_per_rank=1 = 2 stages; "
                                                    "give 1"),
])
def test_bad_pipeline_options_are_one_clear_error(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ParallelismConfig(**kwargs)


def test_looped_schedules_put_stage_i_on_rank_i_mod_pp_and_v_schedules_fold():
    assert stage_ranks(ParallelismConfig(pp_size=2)) == [0, 1]
    assert stage_ranks(ParallelismConfig(pp_size=2, pp_schedule="Interleaved1F1B", pp_stages_per_rank=3)) == \
        [0, 1, 0, 1, 0, 1]
    assert stage_ranks(ParallelismConfig(pp_size=3, pp_schedule="ZBVZeroBubble")) == [0, 1, 2, 2, 1, 0]


@pytest.mark.parametrize("kwargs, mixed, needle", [
    ({}, "fp16", "mixed_precision='fp16'.*use mixed_precision='bf16'"),
    ({"fsdp": FSDPOptions(checkpoint_format="full")}, "no", "checkpoint_format='full'.*leave it 'sharded'"),
])
def test_what_pipelines_do_not_combine_with_is_refused_at_construction(kwargs, mixed, needle):
    from anyaccel.backends import backend_class
    from anyaccel.environment import resolve_environment

    env = dataclasses.replace(resolve_environment(cpu=True), world_size=2)
    with pytest.raises(ValueError, match=needle):
        create_strategy(env, backend_class("cpu")(env), "nd", options=ParallelismConfig(pp_size=2, **kwargs),
                        mixed_precision=mixed)


# ---- cutting models ---------------------------------------------------------------------------------
def _llama(layers=4, tie=True, **extra):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=layers, vocab_size=64,
                                      tie_word_embeddings=tie, **extra)
    return transformers.LlamaForCausalLM(config)


def _chain(model, plan, x):
    for stage in range(len(plan.stages)):
        x = split.stage_module(model, plan, stage)(x)
    return x


def test_a_sequential_is_cut_at_its_repeated_children_and_its_stages_chain_to_its_forward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8),
                                torch.nn.Linear(8, 3))
    plan = split.plan_stages(model, 2)  # blocks: the Linears; the embedding first, activations and norm after one
    assert plan.kind == "sequential"
    assert plan.stages == (("0", "1", "2", "3", "4"), ("5", "6", "7"))
    x = torch.randint(0, 10, (5, 4))
    assert torch.equal(_chain(model, plan, x), model(x))
    stage = split.stage_module(model, plan, 1)
    assert [n for n, _ in stage.named_parameters()] == [f"{u}.{p}" for u in ("5", "6", "7") for p in ("weight", "bias")]
    assert len(list(model.parameters())) == 11  # the model itself is untouched by views
    assert split.plan_stages(model, 4).stages[-1] == ("7",)


def test_a_transformers_llama_is_cut_at_decoder_layers_keeping_names_and_its_forward():
    model = _llama()
    plan = split.plan_stages(model, 2)
    assert plan.kind == "transformers"
    assert plan.stages == (("model.embed_tokens", "model.layers.0", "model.layers.1"),
                           ("model.layers.2", "model.layers.3", "model.norm", "lm_head"))
    split.check_transformers_split(model, plan)  # the chained stages reproduce the logits
    last = split.stage_module(model, plan, 1)
    names = [n for n, _ in last.named_parameters()]
    assert names[0] == "model.layers.2.self_attn.q_proj.weight" and names[-2:] == ["model.norm.weight", "lm_head.weight"]
    assert split.plan_stages(model, 3, ["model.layers.1", "model.layers.3"]).stages[1] == \
        ("model.layers.1", "model.layers.2")


def test_user_split_points_and_stage_counts_are_checked_against_the_blocks():
    model = _llama()
    with pytest.raises(ValueError, match=r"\['layers.2'\] do not name a block where a stage can begin; choose from "
                                         r"\['model.layers.1', 'model.layers.2', 'model.layers.3'\]"):
        split.plan_stages(model, 2, ["layers.2"])
    with pytest.raises(ValueError, match="must name distinct blocks in model order"):
        split.plan_stages(model, 3, ["model.layers.3", "model.layers.1"])
    with pytest.raises(ValueError, match=r"8 pipeline stages, but LlamaForCausalLM has only 4 block\(s\)"):
        split.plan_stages(model, 8)


def test_a_transformers_forward_that_does_more_than_its_layers_is_refused_not_trained_wrongly():
    model = _llama()
    base = model.model
    forward = base.forward

    def scaled(input_ids=None, inputs_embeds=None, **kwargs):  # like an embedding scaled inside the forward
        if inputs_embeds is None:
            inputs_embeds = base.embed_tokens(input_ids)
        return forward(inputs_embeds=inputs_embeds * 2.0, **kwargs)

    base.forward = scaled
    with pytest.raises(ValueError, match="does not reproduce the whole model's forward"):
        split.check_transformers_split(model, split.plan_stages(model, 2))


class _Blocks(torch.nn.Module):
    """torchtitan's convention: the forward runs with the units of other stages set to None."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x):
        h = self.inp(x) if self.inp is not None else x
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.out(h) if self.out is not None else h


def test_a_model_with_a_block_list_keeps_its_forward_with_other_stages_units_as_none():
    model = _Blocks()
    plan = split.plan_stages(model, 2)
    assert (plan.kind, plan.stages) == ("blocks", (("inp", "layers.0", "layers.1"), ("layers.2", "layers.3", "out")))
    x = torch.randn(3, 4)
    assert torch.equal(_chain(model, plan, x), model(x))
    split.prune(model, plan, [1])
    assert model.inp is None and list(model.layers._modules) == ["2", "3"]
    assert [n for n, _ in model.named_parameters()] == ["layers.2.weight", "layers.2.bias", "layers.3.weight",
                                                        "layers.3.bias", "out.weight", "out.bias"]


def test_pruning_a_transformers_model_leaves_identities_where_its_forward_calls_the_head():
    model = _llama()
    plan = split.plan_stages(model, 2)
    split.prune(model, plan, [0])
    assert isinstance(model.lm_head, torch.nn.Identity) and isinstance(model.model.norm, torch.nn.Identity)
    assert list(model.model.layers._modules) == ["0", "1"]
    model = _llama()
    split.prune(model, plan, [1])
    assert model.model.embed_tokens is None and list(model.model.layers._modules) == ["2", "3"]


def test_parameters_outside_every_block_are_named():
    class Stray(_Blocks):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(1))

    with pytest.raises(ValueError, match=r"parameter\(s\) \['scale'\] of Stray belong to no block"):
        split.plan_stages(Stray(), 2)
    with pytest.raises(ValueError, match="cannot find the repeated blocks of Linear"):
        split.plan_stages(torch.nn.Linear(2, 2), 2)


class _Plain(_Blocks):
    def forward(self, x):  # not torchtitan's convention: calls self.inp whatever the stage
        h = self.inp(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.out(h)


def test_a_block_list_forward_that_cannot_run_without_the_other_stages_says_what_convention_it_needs():
    model = _Plain()
    stage = split.stage_module(model, split.plan_stages(model, 2), 1)
    with pytest.raises(TypeError, match=r"pipeline stage 1 of _Plain: its forward failed with the modules of the "
                                        r"other stages missing .*self.embed\(x\) if self.embed is not None"):
        stage(torch.randn(3, 8))


def test_a_transformers_model_without_a_pipeline_plan_is_refused_by_name():
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match="GPT2LMHeadModel is a transformers model without a pipeline plan"):
        split.plan_stages(model, 2)


# ---- checkpoints keyed by name: a tied weight's optimizer state under one name -----------------------------
def test_tied_copies_store_their_optimizer_state_under_the_untied_name():
    from anyaccel.strategies import dcp

    flat = {"state.lm_head.weight.exp_avg": torch.ones(2), "state.lm_head.weight.step": 3,
            "param_groups.lm_head.weight.lr": 0.1, "state.model.norm.weight.step": 3}
    aliases = {"lm_head.weight": "model.embed_tokens.weight"}
    stored = dcp._aliased(flat, aliases)
    assert sorted(stored) == ["param_groups.model.embed_tokens.weight.lr", "state.model.embed_tokens.weight.exp_avg",
                              "state.model.embed_tokens.weight.step", "state.model.norm.weight.step"]
    back = dcp._unaliased(stored, flat, aliases)
    assert sorted(back) == sorted(flat) and back["state.lm_head.weight.exp_avg"] is stored[
        "state.model.embed_tokens.weight.exp_avg"]
    both = {**flat, "state.model.embed_tokens.weight.exp_avg": torch.ones(2)}  # two copies on one rank (V)
    again = dcp._unaliased(dcp._aliased(both, aliases), both, aliases)
    assert again["state.lm_head.weight.exp_avg"] is not again["state.model.embed_tokens.weight.exp_avg"]


# ---- pipeline_step without stages -------------------------------------------------------------------------
def test_pipeline_step_without_stages_is_forward_loss_backward(recwarn):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        reference = copy.deepcopy(model)
        model = accelerator.prepare(model)
        x, y = torch.randn(6, 4), torch.randn(6, 1)
        mse = torch.nn.functional.mse_loss
        with accelerator.accumulate(model):
            loss = accelerator.pipeline_step(model, x, y, mse)
        (mse(reference(x), y) / 2).backward()  # divided over the accumulation group, as backward does
        assert float(loss) == pytest.approx(float(mse(reference(x), y)))
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p.grad, q.grad)
        with torch.no_grad():
            loss, out = accelerator.pipeline_step(model, (x,), y, mse, return_outputs=True)
        assert out.shape == (6, 1)
        with pytest.raises(ValueError, match="pipeline_step needs loss_fn"):
            accelerator.pipeline_step(model, x, y)
    finally:
        accelerator.end_training()


def test_a_pipeline_step_runs_inside_backward_divided_and_watched_by_the_doctor():
    """Under pp, pipeline_step hands the schedule's step to Accelerator.backward: the one place
    that divides over an accumulation group and marks the hang doctor's tracker (issue 38). A
    stand-in pipeline records what the schedule would be given."""
    from anyaccel import doctor
    from anyaccel.strategies.nd.pipeline.schedule import WAITS_IN, PipelineStep

    seen = []

    class Schedule:
        def step(self, args, target, loss_fn, scale, sync, return_outputs):
            seen.append((doctor.TRACKER.op, scale, sync, return_outputs))
            return torch.tensor(1.5), "outputs"

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    try:
        before = doctor.TRACKER.op
        step = PipelineStep(Schedule(), (torch.ones(2, 1),), torch.ones(2, 1), lambda o, t: o, sync=False,
                            return_outputs=True)
        accelerator.backward(step)
        assert seen == [(WAITS_IN, 0.25, False, True)] and doctor.TRACKER.op == before
        assert (float(step.loss), step.outputs) == (1.5, "outputs")
        with pytest.raises(TypeError, match="takes no \\['retain_graph'\\]"):
            accelerator.backward(PipelineStep(Schedule(), (), None, None, True, False), retain_graph=True)
    finally:
        accelerator.end_training()


def test_pipeline_step_takes_a_transformers_batch_and_its_own_loss():
    model = _llama(layers=2)
    reference = copy.deepcopy(model)
    accelerator = Accelerator(cpu=True)
    try:
        model = accelerator.prepare(model)
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        loss = accelerator.pipeline_step(model, {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)})
        assert float(loss) == pytest.approx(float(reference(input_ids=ids, labels=ids).loss))
        with pytest.raises(ValueError, match="attention_mask masks some tokens"):
            accelerator.pipeline_step(model, {"input_ids": ids, "labels": ids, "attention_mask": torch.zeros_like(ids)})
        with pytest.raises(ValueError, match=r"must hold input_ids .*got keys \['pixel_values'\]"):
            accelerator.pipeline_step(model, {"pixel_values": ids})
    finally:
        accelerator.end_training()


# ---- anyaccel estimate-memory --pp ---------------------------------------------------------------------------
def test_estimate_memory_counts_the_largest_pipeline_stage():
    from anyaccel.big_modeling.estimate import estimate_memory, stage_shapes

    f32 = torch.float32
    shapes = {"embed.weight": ((100, 8), f32), **{f"layers.{i}.weight": ((8, 8), f32) for i in range(5)},
              "norm.weight": ((8,), f32), "head.weight": ((100, 8), f32)}
    parts = stage_shapes(shapes, 2)  # blocks 0-2 | 3-4, the embedding first, norm and head last
    assert sorted(parts[0]) == ["embed.weight", "layers.0.weight", "layers.1.weight", "layers.2.weight"]
    assert sorted(parts[1]) == ["head.weight", "layers.3.weight", "layers.4.weight", "norm.weight"]
    row = estimate_memory(shapes, 4, "fsdp", True, pp=2, batch_size=4, seq_len=16)
    first = (100 * 8 + 3 * 64) * 4  # bytes of the larger stage (the first), split over its 2 processes
    assert (row["layout"], row["params"], row["optimizer"]) == ("fsdp (pp 2)", first // 2, 2 * first // 2)
    assert row["stages"][0] == row["total"] > row["stages"][1]
    # activations under 1F1B with 2 micro-batches of 2: stage 0 holds both (its 3 blocks), stage 1 one (2 blocks)
    assert row["activations"] == 34 * 16 * 4 * 8 * 3
    from anyaccel.errors import CLIError

    with pytest.raises(CLIError, match="--pp 8: the model has 5 numbered block"):
        estimate_memory(shapes, 8, "ddp", False, pp=8)
    with pytest.raises(CLIError, match=r"do not divide into --replicate 1 x --tp 1 x --sp 1 x --pp 3"):
        estimate_memory(shapes, 4, "ddp", False, pp=3)
    with pytest.raises(CLIError, match=r"--sp 2 with --pp 2: pipeline stages with sequence parallelism are not "
                                       r"supported together yet \(prepare refuses them"):
        estimate_memory(shapes, 4, "nd", True, sp=2, pp=2, batch_size=1, seq_len=16)


def test_a_model_compiled_before_prepare_is_refused_with_what_compiles_stages():
    from anyaccel.backends import backend_class
    from anyaccel.environment import resolve_environment

    env = dataclasses.replace(resolve_environment(cpu=True), world_size=2)
    strategy = create_strategy(env, backend_class("cpu")(env), "nd", options=ParallelismConfig(pp_size=2))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model.compile()
    with pytest.raises(ValueError, match=r"was compiled before prepare .*Accelerator\(dynamo_backend=...\), which "
                                         "compiles each pipeline stage"):
        strategy.prepare_model(model, device_placement=True, evaluation_mode=False)


def test_the_flat_optimizer_state_of_a_sharded_checkpoint_reads_nested_for_another_engine():
    """Sharded checkpoints store optimizer states flat per parameter name (so pipeline stages
    write their own); DeepSpeed's converter reads torch's nested layout: without nesting it found
    no "state" and loaded no moments, silently."""
    from anyaccel.strategies.dcp import nested_optimizer_state

    flat = {"state.model.layers.0.weight.exp_avg": 1, "state.model.layers.0.weight.step": 2,
            "param_groups.model.layers.0.weight.lr": 0.1, "param_groups.model.layers.0.weight.params": ["x"],
            "state.head.weight.exp_avg": 3, "param_groups.head.weight.lr": 0.1,
            "state.norm.weight.exp_avg": 4, "param_groups.norm.weight.lr": 0.0}
    assert nested_optimizer_state(flat) == {
        "state": {"model.layers.0.weight": {"exp_avg": 1, "step": 2}, "head.weight": {"exp_avg": 3},
                  "norm.weight": {"exp_avg": 4}},
        "param_groups": [{"lr": 0.1, "params": ["model.layers.0.weight", "head.weight"]},
                         {"lr": 0.0, "params": ["norm.weight"]}]}
    nested = {"state": {0: {"exp_avg": 1}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    assert nested_optimizer_state(nested) is nested
