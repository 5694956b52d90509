"""DeepSpeedPlugin, DeepSpeedOptions and the "auto" rules, without processes or engines (DeepSpeed
itself is not imported by these: the plugin and the options are plain Python)."""

import json

import pytest

from anyaccel.compat.arguments import resolve_options
from anyaccel.envvars import WorkerSettings
from anyaccel.strategies.deepspeed.config import DeepSpeedOptions, PreparedObjects, filled_config
from anyaccel.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler, HfDeepSpeedConfig


def test_plugin_defaults_are_accelerates():
    plugin = DeepSpeedPlugin()
    config = plugin.deepspeed_config
    assert plugin.zero_stage == 2 and plugin.gradient_accumulation_steps == "auto"
    assert plugin.gradient_clipping == "auto" and plugin.offload_optimizer_device == "none"
    assert plugin.zero3_init_flag is False and plugin.zero3_save_16bit_model is False
    assert config["zero_optimization"]["stage"] == 2 and config["train_micro_batch_size_per_gpu"] == "auto"
    assert DeepSpeedPlugin(zero_stage=3).zero3_init_flag is True  # Accelerate: on by default for stage 3


def test_a_config_file_is_the_config_and_fields_fill_only_its_auto_values(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "auto"}},
                                "gradient_clipping": 0.7}))
    plugin = DeepSpeedPlugin(hf_ds_config=str(path), offload_param_device="cpu", gradient_clipping=2.0)
    assert plugin.zero_stage == 3 and plugin.gradient_clipping == 0.7  # read back from the config
    assert plugin.deepspeed_config["zero_optimization"]["offload_param"]["device"] == "cpu"  # "auto" filled
    assert DeepSpeedPlugin(hf_ds_config=json.dumps({"zero_optimization": {"stage": 1}})).zero_stage == 1
    assert HfDeepSpeedConfig({"zero_optimization": {"stage": 3}}).is_zero3()


@pytest.mark.parametrize("kwargs, message", [
    ({"zero_stage": 4}, "zero_optimization.stage=4"),
    ({"offload_optimizer_device": "gpu"}, "offload_optimizer_device='gpu'"),
    ({"zero_stage": 2, "offload_param_device": "cpu"}, "needs ZeRO stage 3"),
    ({"hf_ds_config": {"fp16": {"enabled": True}}}, "no zero_optimization section"),
    ({"hf_ds_config": "/nonexistent/ds.json"}, "neither an existing file nor JSON"),
    ({"enable_msamp": True}, "no MS-AMP"),
])
def test_bad_values_are_errors_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DeepSpeedPlugin(**kwargs)


def test_auto_values_are_filled_from_what_is_prepared():
    options = DeepSpeedPlugin(hf_ds_config={
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}).to_options()
    prepared = PreparedObjects(num_processes=4, gradient_accumulation_steps=2, batch_sizes=[8, 16], hidden_size=64,
                               optimizer_lr=3e-4, optimizer_weight_decay=0.01, scheduler_warmup_steps=10,
                               scheduler_total_steps=100, scheduler_max_lr=3e-4)
    config = filled_config(options, prepared, "bf16")
    assert config["train_micro_batch_size_per_gpu"] == 8  # the smallest loader (is_train_batch_min)
    assert config["train_batch_size"] == 8 * 2 * 4 and config["gradient_accumulation_steps"] == 2
    assert config["gradient_clipping"] == 0.0  # anyaccel: clip where clip_grad_norm_ is called
    assert config["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    assert config["optimizer"]["params"] == {"lr": 3e-4, "weight_decay": 0.01}
    assert config["scheduler"]["params"]["total_num_steps"] == 25  # per process, as Accelerate
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}


def test_an_auto_value_nothing_fills_is_an_error_naming_it():
    options = DeepSpeedOptions(config={"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}})
    with pytest.raises(ValueError, match="zero_optimization.reduce_bucket_size is \"auto\".*hidden_size"):
        filled_config(options, PreparedObjects(num_processes=2, gradient_accumulation_steps=1), "no")
    with pytest.raises(ValueError, match="enables bf16"):
        filled_config(DeepSpeedOptions(config={"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}),
                      PreparedObjects(num_processes=2, gradient_accumulation_steps=1), "fp16")


def test_the_plugin_selects_the_deepspeed_strategy_and_its_accumulation_steps():
    settings = WorkerSettings()
    options = resolve_options(settings, deepspeed_plugin=DeepSpeedPlugin(zero_stage=1))
    assert options.strategy == "deepspeed" and options.gradient_accumulation_steps == 1
    assert options.deepspeed_plugin.zero_stage == 1 and options.strategy_options.zero_stage == 1
    config = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}
    assert resolve_options(settings, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config)).gradient_accumulation_steps == 4
    with pytest.raises(ValueError, match="disagree"):
        resolve_options(settings, gradient_accumulation_steps=2, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    with pytest.raises(ValueError, match="deepspeed_plugin is set but strategy is ddp"):
        resolve_options(settings, strategy="ddp", deepspeed_plugin=DeepSpeedPlugin())
    from anyaccel.plugins import FullyShardedDataParallelPlugin

    with pytest.raises(ValueError, match="deepspeed_plugin and fsdp_plugin"):
        resolve_options(settings, deepspeed_plugin=DeepSpeedPlugin(), fsdp_plugin=FullyShardedDataParallelPlugin())
    with pytest.raises(TypeError, match="deepspeed_plugin must be a DeepSpeedPlugin"):
        resolve_options(settings, deepspeed_plugin={"zero_stage": 2})


def test_dummy_objects_say_what_they_stand_for_when_stepped_without_deepspeed():
    import torch

    params = [torch.nn.Parameter(torch.zeros(2))]
    opt = DummyOptim(params, lr=0.1)
    assert isinstance(opt, torch.optim.Optimizer) and opt.defaults["lr"] == 0.1
    with pytest.raises(RuntimeError, match="DeepSpeed config"):
        opt.step()
    sched = DummyScheduler(opt, total_num_steps=10)
    assert isinstance(sched, torch.optim.lr_scheduler.LRScheduler)
    with pytest.raises(RuntimeError, match="cannot step by itself"):
        sched.step()


def test_without_deepspeed_installed_the_error_says_how_to_install_it(monkeypatch):
    import sys

    from anyaccel import Accelerator

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # what an environment without it gives
    with pytest.raises(ImportError, match=r"pip install anyaccel\[deepspeed\]"):
        Accelerator(strategy="deepspeed", cpu=True)
    with pytest.raises(ImportError, match=r"pip install anyaccel\[deepspeed\]"):
        Accelerator(deepspeed_plugin=DeepSpeedPlugin(), cpu=True)


def test_the_launchers_settings_become_the_plugin_and_a_file_that_says_otherwise_is_refused(tmp_path):
    """deepspeed_plugin_from_settings: what anyaccel launch checks before starting and every
    worker's Accelerator() builds; a setting fills the file's "auto" or missing value only."""
    from anyaccel.utils.deepspeed import deepspeed_plugin_from_settings

    plugin = deepspeed_plugin_from_settings({"zero_stage": 3, "offload_optimizer_device": "cpu", "zero3_init_flag": False,
                                             "deepspeed_multinode_launcher": "standard"})
    assert (plugin.zero_stage, plugin.offload_optimizer_device, plugin.zero3_init_flag) == (3, "cpu", False)
    assert plugin.to_options().config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": "auto"}, "gradient_clipping": 1.0}))
    plugin = deepspeed_plugin_from_settings({"deepspeed_config_file": str(ds), "zero_stage": 1,
                                             "offload_optimizer_device": "cpu"})
    assert plugin.to_options().zero_stage == 1 and plugin.deepspeed_config["gradient_clipping"] == 1.0
    assert plugin.deepspeed_config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"  # missing: filled
    with pytest.raises(ValueError, match=r"^launcher: gradient_clipping is 2.0 but the DeepSpeed config file .* sets "
                                         r"gradient_clipping to 1.0"):
        deepspeed_plugin_from_settings({"deepspeed_config_file": str(ds), "gradient_clipping": 2.0}, source="launcher")
