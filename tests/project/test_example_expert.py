"""examples/expert_parallel.py read in one process: its model has experts where the ep plan says
(the dense first layer left out) and they split over 2 ep ranks; the 2-process run is in
tests/examples/test_examples_multiprocess.py."""

import importlib.util

import pytest

from conftest import ROOT

EXAMPLE = ROOT / "examples" / "expert_parallel.py"


def test_the_examples_moe_layers_split_and_its_dense_layer_stays():
    pytest.importorskip("transformers")
    from anyaccel.strategies.nd.expert import ExpertGroup, find_experts, shard_experts

    spec = importlib.util.spec_from_file_location("expert_parallel", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.tiny_qwen3_moe()
    assert [n for n, _ in find_experts(model)] == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    shard_experts(model, ExpertGroup(size=2, rank=1))
    assert model.model.layers[2].mlp.experts.held == range(4, 8)
    batch = example.counting_sequences(2, 64, 8, seed=1)[1]["input_ids"]
    assert ((batch[2:] - 2 * batch[1:-1] + batch[:-2]) % 64 == 0).all()  # the next token follows from two before
