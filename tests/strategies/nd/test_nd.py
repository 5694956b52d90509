"""N-D parallelism (the ``nd`` strategy, ``ParallelismConfig``).

Unit tests (no processes): sizes and plans are checked before anything is built. Slow tests: 4
real CPU processes on gloo through ``anyaccel launch`` (tests/strategies/nd/nd_checks.py), TP2 x DP2
and HSDP 2 x 2, and a transformers tiny Llama with its own TP plan on 2 processes, each compared
with the same training in one process (rank 0 runs it).

Tolerance: the 4-process run adds the same fp32 numbers in another order (matmuls cut along TP,
gradients reduce-scattered and averaged over the data-parallel ranks, norms summed per layout);
the observed difference after 6 SGD-momentum steps with clipping is 3e-8 in weights and ~2e-7
relative in losses and norms. Asserted: weights 1e-5, losses/norms rel 1e-5 — 30x above rounding,
while one wrong shard, a TP rank fed another batch, or a norm counted twice changes them at 1e-2
(lr 0.05 x gradients of order 1).
"""

import dataclasses

import pytest
import torch


from anyaccel import Accelerator, ParallelismConfig
from anyaccel.strategies import create_strategy, strategy_names
from anyaccel.strategies.nd import check_tp_divisibility


def test_parallelism_config_has_accelerates_names_and_homes():
    import anyaccel.parallelism_config
    import anyaccel.utils
    import anyaccel.utils.dataclasses

    c = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2)
    assert (c.cp_size, c.total_size, c.data_parallel_size, c.non_data_parallel_size) == (1, 8, 4, 2)
    assert c.dp_replicate_enabled and c.tp_enabled and not c.cp_enabled
    assert (anyaccel.utils.ParallelismConfig is anyaccel.utils.dataclasses.ParallelismConfig
            is anyaccel.parallelism_config.ParallelismConfig is ParallelismConfig)
    assert "nd" in strategy_names()


@pytest.mark.parametrize("kwargs, needle", [
    ({"tp_size": 0}, "tp_size=0"),
    ({"dp_shard_size": 1.5}, "dp_shard_size=1.5"),
    ({"tp_plan": {"fc": "diagonal"}}, "diagonal"),
    ({"tp_plan": {}, "parallelize_fn": lambda m, mesh: m}, "not both"),
])
def test_bad_config_values_are_one_clear_error(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ParallelismConfig(**kwargs)


def test_sizes_that_do_not_make_the_world_size_fail_before_anything_is_built():
    # one process; the sizes ask for 4: the error comes from the constructor, before any group exists
    import torch.distributed as dist

    before = dist.is_initialized()  # (an earlier test in this worker may have left one: not ours to judge here)
    with pytest.raises(ValueError, match=r"dp_shard_size=2 x .*tp_size=2 = 4 processes, but this job has 1"):
        Accelerator(cpu=True, parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    assert dist.is_initialized() == before  # the Accelerator made no group
    with pytest.raises(TypeError, match="anyaccel's ParallelismConfig"):
        Accelerator(cpu=True, parallelism_config={"tp_size": 2})


def test_context_parallel_says_it_needs_cuda_sdpa():
    from anyaccel.backends import backend_class
    from anyaccel.environment import resolve_environment

    env = dataclasses.replace(resolve_environment(cpu=True), world_size=4)
    with pytest.raises(NotImplementedError, match="context parallelism needs SDPA attention on CUDA"):
        create_strategy(env, backend_class("cpu")(env), "nd", options=ParallelismConfig(dp_shard_size=2, cp_size=2))


def test_tp_size_that_does_not_divide_names_module_and_dims():
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 8))
    check_tp_divisibility(model, {"0": "colwise", "2": "rowwise"}, 2)  # 6 splits in two
    with pytest.raises(ValueError, match=r"tp_size=4 does not divide: 0 \(Linear \(6, 8\), colwise: dim 0 of size 6\); "
                                         r"2 \(Linear \(8, 6\), rowwise: dim 1 of size 6\)"):
        check_tp_divisibility(model, {"0": "colwise", "2": "rowwise"}, 4)
    with pytest.raises(ValueError, match=r"pattern\(s\) \['fc\*'\] match no module"):
        check_tp_divisibility(model, {"fc*": "colwise"}, 2)


def test_tp_size_that_does_not_divide_transformers_heads():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=48, intermediate_size=64, num_attention_heads=6,
                                      num_key_value_heads=3, num_hidden_layers=1, vocab_size=32)
    model = transformers.LlamaForCausalLM(config).model
    with pytest.raises(ValueError, match="config.num_attention_heads=6; config.num_key_value_heads=3"):
        check_tp_divisibility(model, config.base_model_tp_plan, 4, all_must_match=False)


def test_one_process_runs_the_same_code_paths_quietly(recwarn):
    # every size 1 in one process: a mesh of one, the model trained as it is, no warning
    accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig())
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        reference.load_state_dict(model.state_dict())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        x = torch.randn(3, 4)
        accelerator.backward(model(x).sum())
        reference(x).sum().backward()
        assert float(accelerator.clip_grad_norm_(model.parameters(), 1.0)) == pytest.approx(
            float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)))
        assert accelerator.torch_device_mesh.mesh_dim_names == ("dp_shard",)
        ranks = (accelerator.tensor_parallel_rank, accelerator.data_parallel_rank)
        assert (accelerator.strategy.name, ranks) == ("nd", (0, 0))
        assert sorted(accelerator.get_state_dict(model)) == sorted(reference.state_dict())
    finally:
        accelerator.end_training()
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


def test_a_meta_model_with_a_layout_that_cannot_be_filled_is_refused_at_prepare():
    """A meta model (init_empty_weights) under a layout whose shards anyaccel cannot fill yet is
    refused by prepare, naming the sizes, instead of failing at the first forward."""
    from anyaccel import init_empty_weights

    accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig())
    try:
        with init_empty_weights():
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        with pytest.raises(ValueError, match=r"meta device .*dp_shard_size=1, tp_size=1"):
            accelerator.prepare(model)
    finally:
        accelerator.end_training()
