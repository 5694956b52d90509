"""Big models over 2 real processes (`anyaccel launch`): a model built on meta prepared under
FSDP2 (each rank allocates and fills only its shards), pretrained weights loaded into the shards
from three layouts, and a transformers Llama from a tiny config taken end to end — empty init,
FSDP2, loaded, trained, save_model, load_checkpoint_and_dispatch with a cpu+disk map."""

import pytest

from conftest import launch_checks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def torch_nn(tmp_path_factory):
    return launch_checks("bigmodel_fsdp.py", tmp_path_factory.mktemp("bigmodel_fsdp"), timeout=400)


def test_meta_model_under_fsdp2_equals_the_eager_model_bitwise_and_trains(torch_nn):
    r0, r1 = torch_nn
    assert r0["built_on_meta"] and r0["bitwise_equal_to_eager"] is True
    for r in (r0, r1):
        assert 0.4 * r["full_bytes"] <= r["local_bytes"] <= 0.6 * r["full_bytes"]  # each rank holds about half
        assert r["trained"]


def test_meta_model_under_the_nd_strategy_sharded_only_equals_the_eager_model(torch_nn):
    r0, r1 = torch_nn
    assert r0["nd_bitwise_equal_to_eager"] is True
    assert r0["nd_forward_finite"] and r1["nd_forward_finite"]


@pytest.mark.parametrize("layout", ["file", "hf", "anyaccel_state"])
def test_pretrained_weights_load_into_the_shards(torch_nn, layout):
    r0, _ = torch_nn
    assert r0["hf_index"] and r0[f"loaded_{layout}"] is True


def test_wrong_shapes_are_refused_on_every_rank_before_loading(torch_nn):
    for r in torch_nn:
        assert "head.weight: checkpoint [6, 48], model [5, 48]" in r["bad_shape_error"]
        assert r["untouched_after_error"]


def test_transformers_llama_empty_init_fsdp_train_save_dispatch(tmp_path):
    pytest.importorskip("transformers")
    r0, r1 = launch_checks("bigmodel_hf.py", tmp_path, timeout=600)
    assert r0["hf_index"] and r0["meta"] and r0["loaded_equals_pretrained"] is True
    for r in (r0, r1):
        assert 0.4 * r["full_param_bytes"] <= r["local_param_bytes"] <= 0.6 * r["full_param_bytes"]
        assert all(loss == loss and loss < 10 for loss in r["losses"])
    assert r0["trained_changed"]
    assert r0["dispatch_max_diff"] == 0.0 and r0["disk_params_meta"]
    assert r0["auto_max_diff"] == 0.0 and r0["auto_map_devices"] == ["cpu", "disk"]
