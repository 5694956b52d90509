"""Big-model inference and loading in one process, with torch.nn models: empty init, device-map
inference, dispatch/offload hooks (outputs equal to the in-memory model with a budget smaller than
the model), checkpoint layouts, and the errors for bad input."""

import json
import os

import pytest
import torch

from anyaccel.big_modeling import (AlignDevicesHook, ModelHook, OffloadedWeightsLoader, add_hook_to_module,
                                   compute_module_sizes, cpu_offload, disk_offload, dispatch_model,
                                   infer_auto_device_map, init_empty_weights, init_on_device,
                                   load_checkpoint_and_dispatch, load_checkpoint_in_model, remove_hook_from_module)
from anyaccel.checkpoint import save_model
from anyaccel.errors import CheckpointError


class Block(torch.nn.Module):
    def __init__(self, w=32):
        super().__init__()
        self.norm = torch.nn.LayerNorm(w)
        self.fc = torch.nn.Linear(w, w)
        self.register_buffer("scale", torch.full((w,), 0.5))

    def forward(self, x):
        return x + self.scale * self.fc(self.norm(x))


class Net(torch.nn.Module):
    def __init__(self, blocks=6):
        super().__init__()
        self.inp = torch.nn.Linear(8, 32)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(blocks))
        self.head = torch.nn.Linear(32, 3)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


@pytest.fixture
def reference():
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(5, 8)
    with torch.no_grad():
        return model, x, model(x)


def test_init_empty_weights_puts_parameters_on_meta_and_keeps_buffers():
    with init_empty_weights():
        m = Net()
    assert all(p.is_meta for p in m.parameters())
    assert all(not b.is_meta for b in m.buffers()) and torch.equal(m.blocks[0].scale, torch.full((32,), 0.5))
    with init_empty_weights(include_buffers=True):
        m = Net()
    assert all(t.is_meta for t in list(m.parameters()) + list(m.buffers()))
    with init_on_device("cpu"):
        m = Net()
    assert all(p.device.type == "cpu" for p in m.parameters())
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"  # the patch is gone afterwards


def test_module_sizes_and_auto_map_fill_cpu_then_disk_without_splitting_blocks(reference):
    model, _, _ = reference
    sizes = compute_module_sizes(model)
    assert sizes[""] == sum(t.numel() * 4 for t in model.state_dict().values())
    assert sizes["blocks.0"] == sizes["blocks.0.norm"] + sizes["blocks.0.fc"] + 32 * 4
    with init_empty_weights():
        empty = Net()
    device_map = infer_auto_device_map(empty, max_memory={"cpu": sizes[""] // 2}, no_split_module_classes=["Block"])
    assert set(device_map.values()) == {"cpu", "disk"}
    assert not any(k.startswith("blocks.") and k.count(".") > 1 for k in device_map)  # blocks kept whole
    on_cpu = sum(sizes[k] for k, v in device_map.items() if v == "cpu")
    # the CPU keeps room for the largest block, through which the disk layers run
    assert on_cpu + sizes["blocks.0"] <= sizes[""] // 2
    everything = infer_auto_device_map(empty, max_memory={"cpu": 10 * sizes[""]})
    assert dict(everything) == {"": "cpu"}


def test_max_memory_smaller_than_the_largest_undividable_block_is_refused(reference):
    with init_empty_weights():
        empty = Net()
    with pytest.raises(ValueError, match=r"largest block that cannot be split.*blocks\.0"):
        infer_auto_device_map(empty, max_memory={"cpu": 1000}, no_split_module_classes=["Block"])
    with pytest.raises(ValueError, match="max_memory\\['cpu'\\]"):
        infer_auto_device_map(empty, max_memory={"cpu": "lots"})


def test_checkpoint_and_dispatch_cpu_and_disk_equals_in_memory_model(reference, tmp_path):
    model, x, want = reference
    save_model(model.state_dict(), tmp_path / "ckpt", max_shard_size="20KB")  # the HF sharded layout
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").exists()
    budget = compute_module_sizes(model)[""] // 2
    with init_empty_weights():
        empty = Net()
    dispatched = load_checkpoint_and_dispatch(empty, tmp_path / "ckpt", device_map="auto", max_memory={"cpu": budget},
                                              no_split_module_classes=["Block"], offload_folder=tmp_path / "off")
    assert "disk" in dispatched.hf_device_map.values()
    with torch.no_grad():
        assert torch.equal(dispatched(x), want)
    # disk layers hold no weights between forwards; their weights are read in place from the
    # checkpoint's safetensors files (the index points there, nothing copied)
    resident = sum(p.numel() * 4 for p in dispatched.parameters() if not p.is_meta)
    assert resident < budget
    index = json.loads((tmp_path / "off" / "index.json").read_text())
    assert index and all("safetensors_file" in v for v in index.values())
    assert sorted(os.listdir(tmp_path / "off")) == ["index.json"]


def test_explicit_map_with_dat_offload_from_a_torch_checkpoint(reference, tmp_path):
    model, x, want = reference
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    device_map = {"inp": "cpu", "blocks.0": "cpu", "blocks.1": "cpu", "blocks.2": "disk", "blocks.3": "disk",
                  "blocks.4": "disk", "blocks.5": "disk", "head": "cpu"}
    with init_empty_weights():
        empty = Net()
    out = load_checkpoint_and_dispatch(empty, tmp_path / "pytorch_model.bin", device_map=device_map,
                                       offload_folder=tmp_path / "off")
    with torch.no_grad():
        assert torch.equal(out(x), want)
        assert torch.equal(out(x), want)  # twice: weights dropped after the first forward come back
    assert (tmp_path / "off" / "blocks.2.fc.weight.dat").exists()


def test_cpu_offload_and_disk_offload_give_the_same_outputs(reference, tmp_path):
    model, x, want = reference
    for offload in (lambda m: cpu_offload(m), lambda m: disk_offload(m, tmp_path / "disk")):
        m = Net().eval()
        m.load_state_dict(model.state_dict())
        offload(m)
        assert all(p.is_meta for p in m.parameters())
        with torch.no_grad():
            assert torch.equal(m(x), want)


def test_offload_folder_written_by_accelerate_loads_here(reference, tmp_path):
    accel_offload = pytest.importorskip("accelerate.utils.offload")
    model, _, _ = reference
    state = {k: v.to(torch.bfloat16) if "fc" in k else v for k, v in model.state_dict().items()}
    accel_offload.offload_state_dict(str(tmp_path), state)
    loader = OffloadedWeightsLoader(save_folder=str(tmp_path))
    assert sorted(loader) == sorted(state)
    assert all(torch.equal(loader[k], v) and loader[k].dtype == v.dtype for k, v in state.items())


def test_missing_keys_and_wrong_shapes_are_named_before_anything_is_loaded(reference, tmp_path):
    model, _, _ = reference
    state = dict(model.state_dict())
    del state["head.bias"]
    state["blocks.1.fc.weight"] = torch.zeros(4, 32)
    save_model(state, tmp_path / "bad")
    target = Net()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"blocks\.1\.fc\.weight: checkpoint \[4, 32\], model \[32, 32\]"):
        load_checkpoint_in_model(target, tmp_path / "bad")
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())  # nothing half-loaded
    del state["blocks.1.fc.weight"]
    save_model(state, tmp_path / "missing")
    with init_empty_weights():
        empty = Net()
    with pytest.raises(CheckpointError, match=r"head\.bias.*built on meta"):  # no value to fall back on
        load_checkpoint_in_model(empty, tmp_path / "missing")
    assert all(p.is_meta for p in empty.parameters())
    with pytest.warns(UserWarning, match="head.bias"):  # a real model keeps its value: a warning
        load_checkpoint_in_model(Net(), tmp_path / "missing")
    with pytest.raises(CheckpointError, match="head.bias"):
        load_checkpoint_in_model(Net(), tmp_path / "missing", strict=True)


def test_offload_folder_that_is_not_writable_is_refused(reference, tmp_path):
    model, _, _ = reference
    save_model(model.state_dict(), tmp_path / "ckpt")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with init_empty_weights():
        empty = Net()
    with pytest.raises(PermissionError, match="offload folder .*a_file/off is not writable"):
        load_checkpoint_and_dispatch(empty, tmp_path / "ckpt", device_map={"inp": "cpu", "blocks": "disk", "head": "cpu"},
                                     offload_folder=blocker / "off")
    with pytest.raises(ValueError, match="offload_folder"):
        load_checkpoint_and_dispatch(empty, tmp_path / "ckpt", device_map={"inp": "cpu", "blocks": "disk", "head": "cpu"})


def test_hooks_wrap_forward_and_are_removed():
    calls = []

    class Record(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append("pre")
            return (args[0] * 2,), kwargs

        def post_forward(self, module, output):
            calls.append("post")
            return output + 1

    lin = torch.nn.Linear(2, 2)
    x = torch.ones(1, 2)
    plain = lin(x)
    add_hook_to_module(lin, Record())
    assert torch.allclose(lin(x), lin._old_forward(x * 2) + 1) and calls == ["pre", "post"]
    add_hook_to_module(lin, AlignDevicesHook(io_same_device=True), append=True)
    assert hasattr(lin, "_hf_hook") and len(lin._hf_hook.hooks) == 2
    remove_hook_from_module(lin)
    assert torch.equal(lin(x), plain) and not hasattr(lin, "_hf_hook")


def test_dispatch_refuses_a_map_that_misses_parameters(reference):
    model, _, _ = reference
    with pytest.raises(ValueError, match=r"does not place .*head\.weight"):
        dispatch_model(model, {"inp": "cpu", "blocks": "cpu"})


def test_accelerate_arguments_without_effect_say_so_once(tmp_path, monkeypatch):
    """offload_state_dict, preload_module_classes and fallback_allocation are accepted for
    Accelerate's scripts; a non-default value warns (once) that it takes no effect and why."""
    import warnings

    from anyaccel.big_modeling import cpu_offload, infer_auto_device_map, load_checkpoint_in_model, notices

    monkeypatch.setattr(notices, "_WARNED", set())
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    save_model(model.state_dict(), tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults say nothing
        infer_auto_device_map(model, max_memory={"cpu": "1GB"})
        load_checkpoint_in_model(model, str(tmp_path / "ckpt"))
    with pytest.warns(UserWarning, match=r"infer_auto_device_map\(fallback_allocation=...\) has no effect"):
        assert infer_auto_device_map(model, max_memory={"cpu": "1GB"}, fallback_allocation=True) == {"": "cpu"}
    with pytest.warns(UserWarning, match=r"load_checkpoint_in_model\(offload_state_dict=...\) has no effect"):
        load_checkpoint_in_model(model, str(tmp_path / "ckpt"), offload_state_dict=True)
    with pytest.warns(UserWarning, match=r"cpu_offload\(preload_module_classes=...\) has no effect"):
        cpu_offload(torch.nn.Sequential(torch.nn.Linear(4, 4)), preload_module_classes=["Linear"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        infer_auto_device_map(model, max_memory={"cpu": "1GB"}, fallback_allocation=True)


@pytest.mark.parametrize("call", ["load_full_state_dict_false", "map_offload_buffers"])
def test_accelerate_arguments_without_effect_warn_instead_of_being_ignored(tmp_path, call):
    """House rule: an argument that takes no effect says so (once), never silently."""
    from anyaccel.big_modeling import infer_auto_device_map, load_checkpoint_in_model
    from anyaccel.big_modeling import notices
    from anyaccel.checkpoint import save_model

    notices._WARNED.clear()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.warns(UserWarning, match="has no effect in anyaccel"):
        if call == "load_full_state_dict_false":
            save_model(model.state_dict(), str(tmp_path / "m"))
            load_checkpoint_in_model(model, str(tmp_path / "m"), full_state_dict=False)
        else:
            infer_auto_device_map(model, max_memory={"cpu": 10**9}, offload_buffers=True)
