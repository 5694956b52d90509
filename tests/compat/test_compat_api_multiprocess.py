"""The multi-process tests (real launches, marked slow); the single-process ones are in tests/compat/test_compat_api.py.

The Accelerate-compatible API (issue 14, part 1): state views, anyaccel.utils, plugins, helpers."""


import pytest

from conftest import launch_checks


@pytest.mark.slow
def test_two_real_processes(tmp_path):
    """PartialState before an Accelerator, reduce defaults, join on gloo, sync_each_batch,
    trigger_sync_in_backward, RNG sync, who runs decorators, who writes files."""
    r = launch_checks("compat_api_checks.py", tmp_path)
    assert [x["partial"] for x in r] == [[2, 0, "cpu", "MULTI_CPU"], [2, 1, "cpu", "MULTI_CPU"]]
    assert r[0]["gather_before_accelerator"] == [0, 1]
    assert r[0]["gather_parameter"] == [[[0.0, 0.0], [1.0, 1.0]], [0.0, 1.0]]
    for x in r:
        assert x["reduce"] == {"utils_default": 2.0, "method_default": 4.0, "max": 3.0, "min": 1.0}
        grads, sync = x["sync_each_batch"]
        assert grads[0] == grads[1] and sync is False  # all-reduced, but the optimizer step waits
        grads, _ = x["no_sync_each_batch"]
        assert grads[0] != grads[1]  # without it the micro-step stays local
        assert x["trigger_sync"][0] == x["trigger_sync"][1]
        assert x["copied"] == [0, 1, 2] and x["traces"] == ["profile_0.json"] and x["saved"] == 0
    assert [x["join_steps"] for x in r] == [3, 1]
    assert r[0]["rng_after_sync"] == r[1]["rng_after_sync"]
    assert r[0]["rng_after_default_sync"] == r[1]["rng_after_default_sync"]
    assert r[0]["rng_after_enum_sync"] == r[1]["rng_after_enum_sync"]
    assert [x["on_last"] for x in r] == [None, 1] and [x["on_local"] for x in r] == [None, 1]
