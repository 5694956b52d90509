"""The Accelerate-compatible API (issue 14, part 1): state views, anyaccel.utils, plugins, helpers."""

import json

import pytest
import torch
from torch.utils.data import DataLoader



@pytest.fixture
def acc(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    from anyaccel import Accelerator

    return Accelerator(cpu=True)


def test_distributed_type_has_accelerates_members():
    from anyaccel import DistributedType

    for name in ("NO", "MULTI_CPU", "MULTI_GPU", "XLA", "FSDP", "DEEPSPEED", "MEGATRON_LM", "MULTI_NPU", "MULTI_XPU",
                 "MULTI_HPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_NEURON"):
        assert DistributedType[name].value == name


def test_state_views_are_read_only_and_agree(acc):
    from anyaccel import AcceleratorState, PartialState

    partial, state = PartialState(), acc.state
    assert isinstance(state, AcceleratorState) and acc.state is state
    for name in ("num_processes", "process_index", "local_process_index", "is_main_process", "is_last_process",
                 "distributed_type", "device"):
        assert getattr(partial, name) == getattr(state, name) == getattr(acc, name)
    assert state.mixed_precision == "no" and state.deepspeed_plugin is None
    with pytest.raises(AttributeError, match="read-only view"):
        state.num_processes = 4
    with pytest.raises(AttributeError, match="read-only view"):
        PartialState().distributed_type = "FSDP"
    with pytest.warns(UserWarning, match="only what this Accelerator reports|changes what this Accelerator reports"):
        state.distributed_type = "FSDP"  # Accelerate's scripts do this; it changes what is reported only
    assert acc.distributed_type == "FSDP" and acc.strategy.name == "single"
    with pytest.warns(UserWarning, match="always checks"):
        state.debug = False
    state.debug = True  # accepted: anyaccel's collectives are always checked
    assert "Num processes: 1" in repr(state) and "Mixed precision type: no" in repr(state)
    AcceleratorState._reset_state(True)  # nothing to reset; must not fail
    assert AcceleratorState().num_processes == 1


def test_fsdp_strategy_reports_fsdp(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    from anyaccel import Accelerator, DistributedType

    acc = Accelerator(cpu=True, strategy="fsdp")
    try:
        assert acc.distributed_type == acc.state.distributed_type == DistributedType.FSDP
        assert acc.is_fsdp2 and acc.is_composable_parallelism_enabled
    finally:  # FSDP made a group of one (end_training does not leave it): later tests expect none
        torch.distributed.destroy_process_group()


def test_utils_defaults_match_accelerate_utils():
    import inspect

    from anyaccel import utils

    assert inspect.signature(utils.reduce).parameters["reduction"].default == "mean"
    from anyaccel import Accelerator

    assert inspect.signature(Accelerator.reduce).parameters["reduction"].default == "sum"
    for name in ("gather", "gather_object", "broadcast", "broadcast_object_list", "reduce", "pad_across_processes",
                 "send_to_device", "set_seed", "synchronize_rng_states", "wait_for_everyone",
                 "extract_model_from_parallel", "save", "tqdm", "LoggerType", "DistributedType",
                 "ProjectConfiguration", "GradientAccumulationPlugin", "AutocastKwargs", "ProfileKwargs",
                 "DistributedDataParallelKwargs", "InitProcessGroupKwargs", "GradScalerKwargs",
                 "FullyShardedDataParallelPlugin", "TorchDynamoPlugin", "DistributedOperationException"):
        assert name in utils.__all__ and hasattr(utils, name), name


@pytest.mark.parametrize("name", ["MegatronLMPlugin", "MSAMPRecipeKwargs"])
def test_what_anyaccel_does_not_do_is_refused_with_the_way(name):
    import anyaccel
    from anyaccel import utils

    with pytest.raises(NotImplementedError, match=name) as info:
        getattr(utils, name)()
    way = 'strategy="fsdp"' if "Megatron" in name else 'mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs'
    assert way in str(info.value)
    if hasattr(anyaccel, name):  # Accelerate's top-level names are importable too
        assert getattr(anyaccel, name) is getattr(utils, name)


@pytest.mark.parametrize("name", ["init_empty_weights", "init_on_device", "load_checkpoint_and_dispatch",
                                  "dispatch_model", "cpu_offload", "disk_offload", "infer_auto_device_map",
                                  "load_checkpoint_in_model"])
def test_big_model_names_are_the_real_ones_under_every_path(name):
    """Accelerate's big-model names resolve to one object (anyaccel.big_modeling's) from the top
    level, anyaccel.utils and anyaccel.utils.modeling — not a refusal stub."""
    import anyaccel
    from anyaccel import big_modeling, utils
    from anyaccel.utils import modeling

    real = getattr(big_modeling, name)
    assert getattr(utils, name) is real and getattr(modeling, name) is real
    assert not hasattr(real, "anyaccel_refused")
    if name in anyaccel.__all__:
        assert getattr(anyaccel, name) is real


def test_send_to_device_skip_keys_and_extract_model():
    from anyaccel import utils

    batch = {"x": torch.ones(2), "keep": torch.zeros(1)}
    out = utils.send_to_device(batch, "meta", skip_keys="keep")
    assert out["x"].device.type == "meta" and out["keep"].device.type == "cpu"
    model = torch.nn.Linear(2, 2)
    assert utils.extract_model_from_parallel(model) is model


def test_utils_save_and_tqdm(tmp_path):
    from anyaccel import utils

    utils.save({"a": torch.ones(2)}, tmp_path / "a.pt")
    assert torch.equal(torch.load(tmp_path / "a.pt")["a"], torch.ones(2))
    assert list(utils.tqdm(range(3), main_process_only=True)) == [0, 1, 2]


def test_accelerates_module_paths_are_the_compat_layers_modules():
    """``anyaccel.state``/``kwargs``/``plugins``/``utils.<sub>`` (the paths scripts import) re-export
    ``anyaccel.compat``: the same objects, so a patch or an ``isinstance`` through either path holds
    for both (issue 30 item 4)."""
    import sys
    from unittest import mock

    import anyaccel.compat.utils.operations
    import anyaccel.kwargs
    import anyaccel.plugins
    import anyaccel.state
    import anyaccel.utils.dataclasses
    from anyaccel import compat
    from anyaccel.utils.dataclasses import DistributedType
    from anyaccel.utils.operations import reduce

    assert anyaccel.state.PartialState is compat.state.PartialState
    assert anyaccel.state.AcceleratorState is compat.state.AcceleratorState
    assert anyaccel.state.DistributedType is DistributedType  # accelerate.state's too (an old Accelerate path)
    assert anyaccel.kwargs.GradientAccumulationPlugin is compat.kwargs.GradientAccumulationPlugin
    assert anyaccel.plugins.FullyShardedDataParallelPlugin is compat.plugins.FullyShardedDataParallelPlugin
    for name in ("operations", "dataclasses", "deepspeed", "tqdm", "_refuse"):
        assert sys.modules[f"anyaccel.utils.{name}"] is sys.modules[f"anyaccel.compat.utils.{name}"], name
    assert anyaccel.utils.dataclasses is compat.utils.dataclasses and anyaccel.utils.tqdm is compat.utils.tqdm
    assert DistributedType is anyaccel.DistributedType and reduce is compat.utils.operations.reduce
    with mock.patch("anyaccel.utils.operations.reduce", "patched"):
        assert compat.utils.operations.reduce == "patched"
    assert sorted(anyaccel.utils.__all__) == sorted(compat.utils.__all__)


def test_accelerates_objects_convert_into_the_cores_options():
    """What the core reads is its own typed options: the Accelerate objects given stay as given
    for the façade (``accelerator.state.dynamo_plugin``, ``gradient_accumulation_plugin``)."""
    import datetime

    from anyaccel import Accelerator, GradientAccumulationPlugin, InitProcessGroupKwargs, TorchDynamoPlugin
    from anyaccel.accumulation import AccumulationOptions
    from anyaccel.process_group import ProcessGroupOptions
    from anyaccel.strategies.compile import CompileOptions

    plugin = TorchDynamoPlugin(backend="eager", mode="reduce-overhead")
    accumulation = GradientAccumulationPlugin(num_steps=2, sync_each_batch=True, divide_by_group_size=False)
    group = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=90))
    a = Accelerator(cpu=True, dynamo_plugin=plugin, gradient_accumulation_plugin=accumulation, kwargs_handlers=[group])
    assert a.options.compile_options == CompileOptions(backend="eager", mode="reduce-overhead")
    assert a.strategy.dynamo == a.options.compile_options and a.state.dynamo_plugin is plugin
    assert a.options.accumulation == AccumulationOptions(sync_each_batch=True, divide_by_group_size=False)
    assert a.gradient_accumulation_plugin is accumulation and a.gradient_state.sync_each_batch
    assert a.options.process_group == ProcessGroupOptions(timeout_s=90.0)
    assert plugin.compile_kwargs() == a.options.compile_options.compile_kwargs() == {"backend": "eager",
                                                                                     "mode": "reduce-overhead"}
    assert TorchDynamoPlugin(backend="no").enabled is False and plugin.enabled
    with pytest.raises(TypeError, match="dynamo_plugin must be a TorchDynamoPlugin"):
        Accelerator(cpu=True, dynamo_plugin={"backend": "eager"})


def test_gradient_accumulation_plugin(acc):
    from anyaccel import Accelerator, GradientAccumulationPlugin

    a = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3))
    assert a.gradient_accumulation_steps == 3
    with pytest.raises(ValueError, match="disagree"):
        Accelerator(cpu=True, gradient_accumulation_steps=2,
                    gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3))
    with pytest.raises(ValueError, match="num_steps=0"):
        GradientAccumulationPlugin(num_steps=0)


@pytest.mark.parametrize("sync_with_dataloader", [True, False])
def test_sync_with_dataloader(sync_with_dataloader):
    """5 batches, 2 per step: the loader's last batch closes its group only with sync_with_dataloader."""
    from anyaccel import Accelerator, GradientAccumulationPlugin

    plugin = GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=sync_with_dataloader)
    a = Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    model = a.prepare(torch.nn.Linear(1, 1))
    loader = a.prepare(DataLoader(torch.arange(5.0).unsqueeze(1), batch_size=1))
    syncs = []
    for batch in loader:
        with a.accumulate(model):
            syncs.append(a.sync_gradients)
    assert syncs == [False, True, False, True, sync_with_dataloader]


def test_autocast_handler_turns_mixed_precision_off_for_a_block():
    from anyaccel import Accelerator
    from anyaccel.kwargs import AutocastKwargs

    a = Accelerator(cpu=True, mixed_precision="bf16")
    x = torch.ones(4, 4)
    with a.autocast():
        assert (x @ x).dtype == torch.bfloat16
        with a.autocast(autocast_handler=AutocastKwargs(enabled=False)):
            assert (x @ x).dtype == torch.float32
    b = Accelerator(cpu=True, mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(enabled=False)])
    with b.autocast():
        assert (x @ x).dtype == torch.float32


def test_profile_writes_a_chrome_trace(acc, tmp_path):
    from anyaccel.kwargs import ProfileKwargs

    with acc.profile(ProfileKwargs(output_trace_dir=str(tmp_path), record_shapes=True)) as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    assert any("mm" in e.key for e in prof.key_averages())
    assert json.loads((tmp_path / "profile_0.json").read_text())["traceEvents"]
    with pytest.raises(ValueError, match="activities"):
        ProfileKwargs(activities=["gpu"])


def test_project_dirs_and_save_iteration(tmp_path):
    from anyaccel import Accelerator, ProjectConfiguration

    a = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path),
                                                                  automatic_checkpoint_naming=True))
    assert a.project_dir == a.logging_dir == str(tmp_path) and a.project_configuration is a.project_config
    assert a.save_iteration == 0
    a.save_state()
    assert a.save_iteration == 1


def test_process_helpers_single_process(acc):
    assert acc.on_last_process(lambda: "last")() == "last"
    assert acc.on_local_process(lambda: "local", local_process_index=0)() == "local"
    assert acc.on_local_process(lambda: "other", local_process_index=1)() is None
    with acc.split_between_processes([1, 2, 3]) as part:
        assert part == [1, 2, 3]
    with acc.join_uneven_inputs([]):  # one process: nothing to join
        pass
    model = torch.nn.Linear(1, 1)
    with acc.trigger_sync_in_backward(model):  # not DDP: a no-op
        model(torch.ones(1, 1)).sum().backward()


def test_gradient_state_speaks_accelerates_names(acc):
    from anyaccel import GradientState

    loader = acc.prepare(DataLoader(range(4), batch_size=2))
    assert acc.gradient_state.active_dataloader is None
    for _ in loader:
        assert acc.gradient_state.active_dataloader is loader and acc.gradient_state.in_dataloader
    GradientState._reset_state()


def test_logger_type_is_accepted_by_log_with(tmp_path):
    from anyaccel import Accelerator, LoggerType

    a = Accelerator(cpu=True, log_with=LoggerType.CSV, project_dir=str(tmp_path))
    a.init_trackers("run")
    a.log({"loss": 1.0}, step=0)
    a.end_training()
    assert LoggerType("tensorboard") is LoggerType.TENSORBOARD


def test_every_member_of_accelerates_accelerator_exists(acc):
    """A script written for Accelerate finds every public member of its Accelerator (methods and
    properties; `device` is set on the instance)."""
    accelerate = pytest.importorskip("accelerate")
    wanted = {n for n in dir(accelerate.Accelerator) if not n.startswith("_")}
    assert sorted(n for n in wanted if not hasattr(acc, n)) == []


def test_accelerate_only_members_answer_as_accelerate_does(acc):
    from anyaccel.compat.accelerator_members import AccelerateMembers

    assert isinstance(acc, AccelerateMembers)  # they live in the compatibility layer
    assert (acc.is_fsdp2, acc.is_composable_parallelism_enabled, acc.multi_device) == (False, False, False)
    assert acc.should_save_model and acc.use_stateful_dataloader is False and acc.fp8_backend == "NO"
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert acc.verify_device_map(plain) is False
    plain[1].hf_device_map = {"0": "cpu", "1": "disk"}  # what dispatch over two devices leaves on a transformers model
    assert acc.verify_device_map(plain) is True
    with pytest.raises(NotImplementedError, match="sp_size"):
        acc.deepspeed_ulysses_dl_adapter(DataLoader(list(range(4))))


def test_maybe_context_parallel_runs_the_block_unchanged_and_says_so(acc):
    ids, labels = torch.arange(8).reshape(2, 4), torch.arange(8).reshape(2, 4)
    ran = []
    with pytest.warns(UserWarning, match="context parallelism is not enabled"):
        with acc.maybe_context_parallel(buffers=[ids, labels], buffer_seq_dims=[1, 1], no_restore_buffers={ids}):
            ran.append(ids.shape)
    assert ran == [(2, 4)] and torch.equal(ids, torch.arange(8).reshape(2, 4))  # nothing sharded
    with pytest.raises(ValueError, match="one sequence dimension per buffer"):
        with acc.maybe_context_parallel(buffers=[ids, labels], buffer_seq_dims=[1]):
            pass
    with pytest.raises(ValueError, match="subset of buffers"):
        with acc.maybe_context_parallel(buffers=[ids], buffer_seq_dims=[1], no_restore_buffers={labels}):
            pass


def test_lomo_backward_calls_the_fused_backward_of_a_prepared_lomo_optimizer(acc):
    class FusedSGD(torch.optim.SGD):  # the shape of lomo_optim.Lomo: the update happens inside the backward
        def fused_backward(self, loss, lr):
            loss.backward()
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        p -= lr * p.grad
            self.calls = getattr(self, "calls", 0) + 1

    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="no prepared optimizer is a LOMO optimizer"):
        acc.lomo_backward(model(torch.ones(4, 2)).sum(), 0.5)
    before = model.weight.detach().clone()
    model, opt = acc.prepare(model, FusedSGD(model.parameters(), lr=0.1))
    loss = model(torch.ones(4, 2)).sum()
    with pytest.raises(ValueError, match="learning rate"):
        acc.lomo_backward(loss, None)
    acc.lomo_backward(loss, 0.5)
    assert opt.optimizer.calls == 1 and torch.allclose(model.weight, before - 0.5 * 4)  # d(sum)/dw = 4 per weight


def test_a_dynamo_plugin_changed_before_prepare_is_what_prepare_compiles(acc, monkeypatch):
    """Accelerate reads state.dynamo_plugin in prepare_model; scripts that set its fields after
    Accelerator(...) compile with them (found in review: a snapshot taken at construction ignored them)."""
    from anyaccel import Accelerator
    from anyaccel.plugins import TorchDynamoPlugin

    accelerator = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="no"))
    accelerator.state.dynamo_plugin.backend = "eager"
    accelerator.prepare(torch.nn.Linear(2, 2))
    assert accelerator.strategy.dynamo.backend == "eager" and accelerator.strategy.dynamo.enabled


@pytest.mark.torch_versions  # reads torch's version and Dynamo's wrapper class: make test-wheel runs it on torch 2.9
def test_accelerates_version_helpers_read_this_torch():
    import unittest

    from anyaccel.test_utils import require_torch_min_version
    from anyaccel.utils import compare_versions, is_compiled_module, is_torch_version

    running = torch.__version__.split("+")[0]
    assert is_torch_version("==", running) and is_torch_version(">=", "2.9") and not is_torch_version("<", "2.9")
    assert compare_versions("torch", ">=", "2.9") and not compare_versions("1.0", ">", "2.0")
    model = torch.nn.Linear(2, 2)
    assert is_compiled_module(torch.compile(model)) and not is_compiled_module(model)  # (compiles at the first call only)

    class Case(unittest.TestCase):
        @require_torch_min_version(version="2.9")
        def test_runs(self):
            pass

        @require_torch_min_version(version="99.0")
        def test_skipped(self):
            pass

    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromTestCase(Case).run(result)
    assert result.testsRun == 2 and len(result.skipped) == 1 and "test_skipped" in str(result.skipped[0][0])
