"""Accelerator options are resolved once (anyaccel.options): argument > launcher variable > default,
each default written once (on its row of the option table, anyaccel.optionspec), the result frozen;
docs/concepts/options.md shows the same table. A strategy's options travel typed."""

from __future__ import annotations

import dataclasses

import warnings

import pytest

from anyaccel import envvars, optionspec
from anyaccel.errors import ConfigError
from anyaccel.compat.arguments import resolve_options
from anyaccel.options import PRECEDENCE, AcceleratorOptions, precedence_table

from conftest import ROOT

NOBODY = envvars.WorkerSettings()


@pytest.mark.parametrize("option, argument, told, expect", [
    ("hang_timeout", 5.0, 7.0, (5.0, 7.0, 300.0)),
    ("mixed_precision", "bf16", "fp16", ("bf16", "fp16", "no")),
    ("gradient_accumulation_steps", 3, 2, (3, 2, 1)),
    ("strategy", "single", "ddp", ("single", "ddp", None)),
    ("cpu", False, True, (False, True, False)),
    ("preemption_signals", "SIGUSR2", "SIGINT", (("SIGUSR2",), ("SIGINT",), ("SIGTERM", "SIGUSR1"))),
])
def test_argument_beats_launcher_beats_default(option, argument, told, expect):
    assert [row.name for row in PRECEDENCE[option]] == [option]  # the argument fills the option of its name
    launcher = envvars.WorkerSettings(**{option: told})
    got = [getattr(resolve_options(launcher, **{option: argument}), option),
           getattr(resolve_options(launcher), option),
           getattr(resolve_options(NOBODY), option)]
    assert tuple(got) == expect


def test_dynamo_backend_from_the_argument_or_the_launcher_with_its_mode():
    launcher = envvars.WorkerSettings(dynamo_backend="eager", dynamo_mode="max-autotune")
    assert resolve_options(launcher, dynamo_backend="inductor").dynamo_plugin.backend == "inductor"
    told = resolve_options(launcher).dynamo_plugin
    assert (told.backend, told.mode) == ("eager", "max-autotune")
    assert resolve_options(NOBODY).dynamo_plugin is None


def test_fsdp_options_imply_fsdp_and_contradictions_are_named():
    from anyaccel.plugins import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()
    assert resolve_options(envvars.WorkerSettings(strategy="ddp"), fsdp_plugin=plugin).strategy == "fsdp"
    with pytest.raises(ValueError, match=r"fsdp_plugin is set but strategy is ddp; fsdp_plugin configures strategy fsdp"):
        resolve_options(NOBODY, fsdp_plugin=plugin, strategy="ddp")
    with pytest.raises(TypeError, match="fsdp_plugin must be a FullyShardedDataParallelPlugin; got dict"):
        resolve_options(NOBODY, fsdp_plugin={})
    told = resolve_options(envvars.WorkerSettings(strategy="fsdp", fsdp_config={"reshard_after_forward": False}))
    assert told.strategy == "fsdp" and told.fsdp_plugin.reshard_after_forward is False


def test_bad_values_say_what_and_where_they_came_from():
    with pytest.raises(ValueError, match=r"^hang_timeout has the value -1; allowed: a number of seconds >= 0"):
        resolve_options(NOBODY, hang_timeout=-1)
    with pytest.raises(ValueError, match=r"^ANYACCEL_HANG_TIMEOUT has the value inf; allowed: a number of seconds >= 0"):
        resolve_options(envvars.WorkerSettings(hang_timeout=float("inf")))
    with pytest.raises(ConfigError, match=r"^preemption_signals: 'SIGFOO'"):
        resolve_options(NOBODY, preemption_signals="SIGFOO")
    with pytest.raises(ConfigError, match=r"^ANYACCEL_PREEMPTION_SIGNALS: 'SIGFOO'"):
        resolve_options(envvars.WorkerSettings(preemption_signals="SIGFOO"))
    with pytest.raises(ValueError, match=r"^mixed_precision has the value 'int4'; allowed: one of no, fp16, bf16, fp8$"):
        resolve_options(NOBODY, mixed_precision="int4")
    with pytest.raises(ValueError, match=r"^mixed_precision has the value 'bf61'; allowed: one of no, fp16, bf16, fp8 \(did you mean 'bf16'\?\)"):
        resolve_options(NOBODY, mixed_precision="bf61")
    with pytest.raises(ValueError, match=r"^strategy has the value 'fdsp'; allowed: one of auto, .*\(did you mean 'fsdp'\?\)"):
        resolve_options(NOBODY, strategy="fdsp")
    with pytest.raises(ValueError, match=r"^gradient_accumulation_steps has the value 0; allowed: an integer >= 1$"):
        resolve_options(NOBODY, gradient_accumulation_steps=0)
    with pytest.raises(TypeError, match="kwargs_handlers accepts"):
        resolve_options(NOBODY, kwargs_handlers=[object()])
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2 and gradient_accumulation_plugin.num_steps=4"):
        from anyaccel.kwargs import GradientAccumulationPlugin

        resolve_options(NOBODY, gradient_accumulation_steps=2,
                        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4))


def test_the_options_are_frozen_and_validated():
    options = resolve_options(NOBODY, hang_timeout=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.hang_timeout = 1  # type: ignore[misc]
    import pickle

    assert pickle.loads(pickle.dumps(options)) == options  # an Accelerator pickles (Accelerate's tests)
    with pytest.raises(ValueError, match="hang_timeout has the value -2"):
        AcceleratorOptions(hang_timeout=-2)


def test_each_default_is_written_once():
    """The config schema, the worker's variables, the options and preemption take their defaults
    from the option table."""
    from anyaccel.config.schema import Config
    from anyaccel.preemption import DEFAULT_SIGNALS, parse_signals

    schema = {f.name: f.default for f in dataclasses.fields(Config)}
    for key in ("hang_timeout", "preemption_signals", "mixed_precision", "gradient_accumulation_steps", "strategy"):
        (row,) = PRECEDENCE[key]
        assert schema[key] == envvars.WORKER_VARS[key].default == row.default == optionspec.option(key).default
    assert AcceleratorOptions().hang_timeout == optionspec.option("hang_timeout").default
    assert DEFAULT_SIGNALS == parse_signals(optionspec.option("preemption_signals").default) \
        == AcceleratorOptions().preemption_signals


def test_the_docs_show_the_table_of_the_code():
    text = (ROOT / "docs" / "concepts" / "options.md").read_text()
    assert precedence_table() in text, "regenerate the table: python -c 'from anyaccel.options import precedence_table; print(precedence_table())'"


def test_two_accelerators_keep_their_own_options(tmp_path):
    from anyaccel import Accelerator

    a = Accelerator(cpu=True, hang_timeout=5, preemption_signals="none", project_dir=str(tmp_path))
    b = Accelerator(cpu=True, hang_timeout=50, preemption_signals="none", project_dir=str(tmp_path))
    assert (a.options.hang_timeout, b.options.hang_timeout) == (5.0, 50.0)


# ---- typed strategy options ------------------------------------------------------------------------


def test_a_strategy_options_object_selects_its_strategy_and_travels_typed():
    from anyaccel.kwargs import DistributedDataParallelKwargs
    from anyaccel.plugins import FullyShardedDataParallelPlugin
    from anyaccel.strategies.options import DDPOptions, FSDPOptions, ParallelismConfig

    fsdp = FSDPOptions(reshard_after_forward=False)
    options = resolve_options(envvars.WorkerSettings(strategy="ddp"), strategy=fsdp)  # the argument wins
    assert (options.strategy, options.strategy_options, options.handlers) == ("fsdp", fsdp, ())
    nd = ParallelismConfig(tp_size=1)
    assert resolve_options(NOBODY, strategy=nd).strategy_options is nd
    assert resolve_options(NOBODY, strategy=DDPOptions(static_graph=True)).strategy == "ddp"
    # Accelerate's spellings become the same typed object; handlers keep only kwargs handlers
    plugin = FullyShardedDataParallelPlugin(reshard_after_forward=False)
    options = resolve_options(NOBODY, fsdp_plugin=plugin, kwargs_handlers=[DistributedDataParallelKwargs()])
    assert options.strategy_options == fsdp and [type(h) for h in options.handlers] == [DistributedDataParallelKwargs]
    with pytest.raises(ValueError, match=r"strategy=FSDPOptions\(...\) and fsdp_plugin both configure"):
        resolve_options(NOBODY, strategy=fsdp, fsdp_plugin=plugin)
    with pytest.raises(TypeError, match="FSDPOptions configures strategy 'fsdp': pass it as Accelerator\\(strategy="):
        resolve_options(NOBODY, kwargs_handlers=[fsdp])


def test_the_extending_guides_strategy_receives_its_options(tmp_path):
    """docs/extending/strategies.md's worked example: a strategy registered outside anyaccel gets
    its own options object through Accelerator(strategy=...), typed, not its defaults."""
    from tiny_strategy.step_average import StepAverageOptions, StepAverageStrategy

    from anyaccel import Accelerator
    from anyaccel.strategies import _REGISTRY, register_strategy

    register_strategy("stepavg", StepAverageStrategy)
    try:
        acc = Accelerator(cpu=True, strategy=StepAverageOptions(average=False), preemption_signals="none",
                          project_dir=str(tmp_path))
        assert type(acc.strategy) is StepAverageStrategy and acc.strategy.options == StepAverageOptions(average=False)
        assert acc.options.strategy == "stepavg"
        acc.end_training()
    finally:
        _REGISTRY.pop("stepavg", None)
    with pytest.raises(ValueError, match=r"StepAverageOptions\(...\) configures strategy 'stepavg', which is not "
                                         r"registered"):
        resolve_options(NOBODY, strategy=StepAverageOptions())


def test_the_launchers_pipeline_and_sequence_sizes_reach_the_parallelism_config():
    """pp_size and sp_size came through their option rows only (variable, flag, key, question)."""
    settings = envvars.worker_settings({"PARALLELISM_CONFIG_PP_SIZE": "2", "PARALLELISM_CONFIG_SP_SIZE": "3"})
    options = resolve_options(settings)
    assert options.strategy == "nd"
    assert (options.strategy_options.pp_size, options.strategy_options.sp_size) == (2, 3)
    with pytest.raises(ConfigError, match=r"^PARALLELISM_CONFIG_PP_SIZE has the value 'two'; allowed: an integer >= 1$"):
        envvars.worker_settings({"PARALLELISM_CONFIG_PP_SIZE": "two"})


def test_the_launchers_deepspeed_settings_make_a_plain_accelerators_plugin(tmp_path):
    """`anyaccel launch --use_deepspeed --zero_stage 3 ...` exports Accelerate's variables; a plain
    Accelerator() builds its DeepSpeedPlugin from them (Accelerate's defaults for the rest), as
    Accelerate's Accelerator() does under `accelerate launch --use_deepspeed`."""
    settings = envvars.worker_settings({
        "ANYACCEL_STRATEGY": "deepspeed", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu", "ACCELERATE_GRADIENT_CLIPPING": "0.5",
        "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true", "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES": "Moe"})
    options = resolve_options(settings)
    plugin, typed = options.deepspeed_plugin, options.strategy_options
    assert options.strategy == "deepspeed" and typed.zero_stage == 3 and plugin.zero_stage == 3
    assert typed.config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert typed.config["gradient_clipping"] == 0.5 and plugin.zero3_save_16bit_model is True
    assert typed.zero3_init_flag is True and typed.transformer_moe_cls_names == ("Moe",)  # stage 3's default
    plain = resolve_options(envvars.worker_settings({"ANYACCEL_STRATEGY": "deepspeed"}))  # --use_deepspeed alone
    assert plain.deepspeed_plugin.zero_stage == 2 and plain.strategy_options.config["gradient_clipping"] == "auto"
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 1}, "gradient_clipping": "auto"}')
    from_file = resolve_options(envvars.worker_settings({
        "ANYACCEL_STRATEGY": "deepspeed", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ds),
        "ACCELERATE_GRADIENT_CLIPPING": "2"}))
    assert from_file.strategy_options.zero_stage == 1 and from_file.strategy_options.config["gradient_clipping"] == 2.0
    with pytest.raises(ConfigError, match=r"^ACCELERATE_DEEPSPEED_ZERO_STAGE has the value 5; allowed: an integer "
                                          r"from 0 to 3$"):
        envvars.worker_settings({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "5"})


def test_an_argument_over_the_launchers_deepspeed_settings_says_they_are_not_used():
    from anyaccel.utils import DeepSpeedPlugin

    settings = envvars.worker_settings({"ANYACCEL_STRATEGY": "deepspeed", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"})
    with pytest.warns(UserWarning, match=r"ACCELERATE_DEEPSPEED_ZERO_STAGE\) are not used: "
                                         r"Accelerator\(deepspeed_plugin=...\) was given"):
        options = resolve_options(settings, deepspeed_plugin=DeepSpeedPlugin(zero_stage=1))
    assert options.strategy_options.zero_stage == 1
    with warnings.catch_warnings():  # the fields a script leaves None come from the launcher (Accelerate's rule)
        warnings.simplefilter("error")
        filled = resolve_options(settings, deepspeed_plugin=DeepSpeedPlugin(gradient_clipping=0.5))
    assert filled.strategy_options.zero_stage == 3 and filled.deepspeed_plugin.zero_stage == 3
    assert filled.strategy_options.config["gradient_clipping"] == 0.5
    with pytest.warns(UserWarning, match=r"Accelerator\(strategy='ddp'\) was given"):
        assert resolve_options(settings, strategy="ddp").strategy == "ddp"
