"""The strategy registry drives every choice of a strategy, and strategies own their options and
capabilities (issue 21, item 3).

A strategy from outside anyaccel (tests/tiny_strategy/step_average.py) is registered in-process
with ``register_strategy`` and, in fresh processes, through an ``anyaccel.strategies`` entry point
of a throwaway distribution on ``sys.path``; each way it must be accepted by
``Accelerator(strategy=...)``, the config file, ``anyaccel launch --strategy`` and the
``anyaccel config`` question. The capability methods are checked for single/ddp/fsdp/xla.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from anyaccel import backends, strategies
from anyaccel.environment import DistributedType, Environment
from anyaccel.strategies.options import DDPOptions, FSDPOptions

from conftest import ROOT, clean_env

REPO = ROOT
TESTS = ROOT / "tests"  # holds tiny_strategy/


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the registry (entry points not read) for one test."""
    monkeypatch.setattr(strategies, "_REGISTRY", dict(strategies._REGISTRY))
    monkeypatch.setattr(strategies, "_entry_points_read", True)
    return strategies


def _env(world: int, device_type: str = "cpu") -> Environment:
    return Environment(world_size=world, rank=0, local_world_size=world, source="test", backend="gloo",
                       device_type=device_type)


def _strategy(name: str, world: int = 1, device_type: str = "cpu", **kwargs):
    env = _env(world, device_type)
    return strategies.create_strategy(env, backends.backend_class("cpu")(_env(world)), name, **kwargs)


# ------------------------------------------------------------------------------------------
# A strategy registered in this process is selectable everywhere
# ------------------------------------------------------------------------------------------


def test_a_registered_strategy_is_selectable_everywhere(registry, tmp_path, monkeypatch):
    from tiny_strategy.step_average import SUMMARY, StepAverageStrategy

    from anyaccel import Accelerator
    from anyaccel.cli import build_parser
    from anyaccel.config import wizard
    from anyaccel.config.file import load_config
    from anyaccel.config.schema import Config, ConfigError, field_choices, field_help
    from anyaccel.launch.command import request_from_args
    from anyaccel.launch.plan import resolve_plan

    script = tmp_path / "train.py"
    script.write_text("")
    parser = build_parser()
    # before registration: refused by every entry
    with pytest.raises(ConfigError, match="key 'strategy' has the value 'stepavg'"):
        Config(strategy="stepavg")
    with pytest.raises(SystemExit):
        parser.parse_args(["launch", "--strategy", "stepavg", str(script)])
    assert "stepavg" not in dict(wizard.strategy_choices())

    registry.register_strategy("stepavg", StepAverageStrategy, summary=SUMMARY)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    acc = Accelerator(cpu=True, strategy="stepavg", preemption_signals="none")
    assert type(acc.strategy) is StepAverageStrategy and acc.strategy.options.average is True
    assert acc.distributed_type == DistributedType.NO

    path = tmp_path / "cfg.yaml"
    path.write_text("strategy: stepavg\nnum_processes: 2\ndevice: cpu\n")
    assert load_config(path).strategy == "stepavg"
    assert "stepavg" in field_choices("strategy") and "stepavg (a full copy per process" in field_help("strategy")

    args = parser.parse_args(["launch", "--strategy", "StepAvg", "--num_processes", "2", "--cpu", str(script)])
    plan = resolve_plan(request_from_args(args), None, {}, 0)
    assert plan.strategy == "stepavg" and plan.env_dict()["ANYACCEL_STRATEGY"] == "stepavg"
    assert ("stepavg", SUMMARY) in wizard.strategy_choices()
    assert [n for n, _ in wizard.strategy_choices()][:2] == ["ddp", "fsdp"]  # single and xla are not offered


def test_registration_rules(registry):
    with pytest.raises(ValueError, match="'auto' is reserved"):
        registry.register_strategy("auto", "x.y:Z")
    with pytest.raises(ValueError, match="must be 'package.module:Class'"):
        registry.register_strategy("mine", "x.y.Z")
    registry.register_strategy("broken", "no_such_module_here:Strategy")
    with pytest.raises(ValueError, match="strategy 'broken' .* points to 'no_such_module_here:Strategy', which cannot"):
        _strategy("broken")
    with pytest.raises(ValueError, match="strategy='zero3' is unknown; choose one of auto, single, ddp, fsdp, nd, deepspeed, broken$"):
        _strategy("zero3")
    assert type(_strategy("auto")).__name__ == "SingleStrategy"  # as the config file and --strategy accept it
    with pytest.raises(ValueError, match="'ddp' is a built-in strategy .*pass replace=True"):
        registry.register_strategy("ddp", "tiny_strategy.step_average:StepAverageStrategy")
    assert registry.strategy_entry("ddp").target == "anyaccel.strategies.ddp:DDPStrategy"
    registry.register_strategy("ddp", "tiny_strategy.step_average:StepAverageStrategy", replace=True)
    assert registry.strategy_entry("ddp").target == "tiny_strategy.step_average:StepAverageStrategy"


# ------------------------------------------------------------------------------------------
# ... and through an entry point, in processes that never import the user's code
# ------------------------------------------------------------------------------------------


def _distribution(root: pathlib.Path, name: str = "stepavg") -> pathlib.Path:
    """A throwaway installed distribution declaring ``name`` in the ``anyaccel.strategies`` group."""
    site = root / "site"
    info = site / "tiny_strategy_dist-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-strategy-dist\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[anyaccel.strategies]\n{name} = tiny_strategy.step_average:StepAverageStrategy\n")
    return site


def _path_env(site: pathlib.Path) -> dict:
    return clean_env(PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS), str(site)]))


_IN_A_FRESH_PROCESS = textwrap.dedent("""
    import json, sys, warnings
    from anyaccel import strategies
    from anyaccel.cli import build_parser
    from anyaccel.config import wizard
    from anyaccel.config.schema import Config
    loaded_early = "tiny_strategy" in sys.modules
    args = build_parser().parse_args(["launch", "--strategy", "stepavg", sys.argv[1]])
    result = {"names": list(strategies.strategy_names()), "config": Config(strategy="stepavg").strategy,
              "cli": args.strategy, "wizard": [n for n, _ in wizard.strategy_choices()],
              "origin": strategies.strategy_entry("stepavg").origin,
              "imported_before_use": loaded_early or "tiny_strategy" in sys.modules}
    from anyaccel import Accelerator
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = Accelerator(cpu=True, strategy="stepavg", preemption_signals="none")
    result["accelerator"] = type(acc.strategy).__name__
    print(json.dumps(result))
""")


def test_an_entry_point_strategy_is_selectable_everywhere(tmp_path):
    site = _distribution(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("")
    proc = subprocess.run([sys.executable, "-c", _IN_A_FRESH_PROCESS, str(script)], capture_output=True, text=True,
                          timeout=120, env=_path_env(site))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["names"] == ["single", "ddp", "xla", "fsdp", "nd", "deepspeed", "stepavg"]
    assert r["config"] == r["cli"] == "stepavg" and r["wizard"] == ["ddp", "fsdp", "nd", "deepspeed", "stepavg"]
    assert r["origin"] == "entry point of tiny-strategy-dist"
    assert r["imported_before_use"] is False  # listing and choosing it imported none of its code
    assert r["accelerator"] == "StepAverageStrategy"


def test_an_entry_point_cannot_take_a_builtin_name(tmp_path):
    site = _distribution(tmp_path, name="ddp")
    code = ("import warnings; warnings.simplefilter('error')\n"
            "from anyaccel import strategies\n"
            "try:\n    strategies.strategy_names()\nexcept UserWarning as w:\n    print(w)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=_path_env(site))
    assert "declares strategy 'ddp'" in proc.stdout and "the entry point is ignored" in proc.stdout, proc.stderr


# ------------------------------------------------------------------------------------------
# Capabilities: what the façade and state.py used to test by name
# ------------------------------------------------------------------------------------------


def test_distributed_type_is_the_strategys():
    assert _strategy("single").distributed_type == DistributedType.NO
    assert _strategy("ddp", world=2).distributed_type == DistributedType.MULTI_CPU
    assert _strategy("fsdp", world=2).distributed_type == DistributedType.FSDP
    assert _strategy("xla", world=2, device_type="xla").distributed_type == DistributedType.XLA


def test_only_ddp_joins_uneven_inputs_and_forces_a_sync_in_backward():
    from anyaccel.strategies.capabilities import BackwardSyncControl, UnevenInputs

    with pytest.raises(ValueError, match="requires at least one joinable"):  # torch's Join, given nothing to join
        _strategy("ddp", world=2).join_uneven_inputs([])
    assert _strategy("ddp", world=1).join_uneven_inputs([]) is None  # nothing to join
    model = torch.nn.Linear(1, 1)
    with _strategy("ddp", world=2).sync_in_backward(model):  # a model DDP does not wrap: a null context
        model(torch.ones(1, 1)).sum().backward()
    for name, world, device in (("single", 1, "cpu"), ("fsdp", 2, "cpu"), ("xla", 2, "xla"), ("nd", 2, "cpu")):
        strategy = _strategy(name, world, device)  # capabilities the façade asks for, which they have not
        assert not isinstance(strategy, (UnevenInputs, BackwardSyncControl)), name
    assert [_strategy(n, 2).collective_state_dict for n in ("single", "ddp", "fsdp")] == [False, False, True]


# ------------------------------------------------------------------------------------------
# Options: one frozen dataclass per strategy; Accelerate's formats only convert into them
# ------------------------------------------------------------------------------------------


def test_options_are_frozen_and_checked_when_built():
    options = FSDPOptions(transformer_cls_names_to_wrap=["Block"])
    assert options.transformer_cls_names_to_wrap == ("Block",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.cpu_offload = True  # type: ignore[misc]
    for bad, message in ((dict(min_num_params=0), "min_num_params=0 must be an integer >= 1"),
                         (dict(auto_wrap_policy="magic"), "auto_wrap_policy='magic'; choose one of"),
                         (dict(reshard_after_forward=1), "reshard_after_forward=1"),
                         (dict(checkpoint_format="FULL_STATE_DICT"), "choose sharded or full"),
                         (dict(mixed_precision_policy={"param": "bfloat16"}), "unknown field(s) ['param']"),
                         (dict(cpu_offload="yes"), "must be True or False")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            FSDPOptions(**bad)
    with pytest.raises(ValueError, match="bucket_cap_mb=0"):
        DDPOptions(bucket_cap_mb=0)
    assert DDPOptions(static_graph=True).ddp_kwargs() == {"static_graph": True}


def test_accelerate_formats_convert_into_the_options():
    from anyaccel.kwargs import DistributedDataParallelKwargs
    from anyaccel.plugins import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(sharding_strategy="SHARD_GRAD_OP", auto_wrap_policy="TRANSFORMER",
                                            transformer_cls_names_to_wrap="A, B", state_dict_type="FULL_STATE_DICT",
                                            activation_checkpointing="true")
    assert plugin.to_options() == FSDPOptions(reshard_after_forward=False, auto_wrap_policy="transformer_based_wrap",
                                              transformer_cls_names_to_wrap=("A", "B"), checkpoint_format="full",
                                              activation_checkpointing=True)
    assert DistributedDataParallelKwargs(find_unused_parameters=True).to_options() == \
        DDPOptions(find_unused_parameters=True)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DistributedDataParallelKwargs(bucket_cap_mb=-1)
    # what Accelerate and torch accept: bucket_cap_mb=None (torch's default), 0/1 for bools (YAML, argparse)
    relaxed = DistributedDataParallelKwargs(bucket_cap_mb=None, find_unused_parameters=1, static_graph=0).to_options()
    assert relaxed == DDPOptions(bucket_cap_mb=None, find_unused_parameters=True, static_graph=False)
    assert relaxed.find_unused_parameters is True and relaxed.ddp_kwargs() == dict(bucket_cap_mb=None,
                                                                                   find_unused_parameters=True)
    with pytest.raises(ValueError, match=r"static_graph=2\): must be True or False"):
        DistributedDataParallelKwargs(static_graph=2)
    # the Accelerator's handlers reach the strategy they configure, as typed options
    strategy = _strategy("fsdp", 2, handlers=[DistributedDataParallelKwargs(), plugin])
    assert strategy.options == plugin.to_options() and strategy.checkpoint_format == "full"
    assert _strategy("ddp", 2, handlers=[plugin, DistributedDataParallelKwargs(static_graph=True)]).options == \
        DDPOptions(static_graph=True)
    with pytest.raises(TypeError, match="the 'ddp' strategy takes DDPOptions; got FSDPOptions"):
        _strategy("ddp", 2, options=FSDPOptions())
    with pytest.raises(TypeError, match="the 'single' strategy takes no options"):
        _strategy("single", options=DDPOptions())


def test_mixed_precision_maps_onto_fsdp2s_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    assert _strategy("fsdp", 2, mixed_precision="bf16").mixed_precision_policy() == \
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert _strategy("fsdp", 2).mixed_precision_policy() == MixedPrecisionPolicy()
    given = FSDPOptions(mixed_precision_policy={"param_dtype": "float16", "cast_forward_inputs": False})
    assert _strategy("fsdp", 2, options=given, mixed_precision="bf16").mixed_precision_policy() == \
        MixedPrecisionPolicy(param_dtype=torch.float16, cast_forward_inputs=False)
    with pytest.raises(ValueError, match="param_dtype='bfloat17' is not a torch dtype"):
        _strategy("fsdp", 2, options=FSDPOptions(mixed_precision_policy={"param_dtype": "bfloat17"}))


def test_options_that_imply_a_strategy_are_one_rule():
    choose = strategies.choose_strategy
    assert choose("auto", "fsdp") == choose(None, "fsdp") == choose("fsdp", "fsdp") == "fsdp"
    assert choose("auto") is None and choose("ddp") == "ddp"
    assert choose(None, "ddp") is None  # DDP's options alone do not ask for DDP (one process stays single)
    with pytest.raises(ValueError, match="fsdp_plugin is set but strategy is ddp; fsdp_plugin configures strategy fsdp"):
        choose("ddp", "fsdp", options_source="fsdp_plugin")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose("single", "ddp") == "single"


# ------------------------------------------------------------------------------------------
# The rooms (issue 38): module paths of before the strategies became packages still import
# ------------------------------------------------------------------------------------------


def test_the_old_module_paths_are_the_new_modules():
    import importlib

    from anyaccel.strategies import MOVED_MODULES

    for old, new in MOVED_MODULES.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    from anyaccel.strategies.deepspeed import DeepSpeedStrategy  # the packages name what the modules held
    from anyaccel.strategies.fsdp import FSDPStrategy, ShardedStrategy
    from anyaccel.strategies.nd import NDStrategy, check_tp_divisibility, tp_styles
    from anyaccel.strategies.options import MESH_DIM_NAMES, PP_SCHEDULES, FSDPOptions, ParallelismConfig
    from anyaccel.strategies.pipeline import Pipeline, default_loss, split_batch, stage_ranks
    from anyaccel.strategies.sequence import SequenceGroup, SequenceParallelAttention, causal_lm_loss

    assert issubclass(NDStrategy, ShardedStrategy) and issubclass(FSDPStrategy, ShardedStrategy)
    assert FSDPOptions.__module__ == "anyaccel.strategies.fsdp.options"
    assert ParallelismConfig.__module__ == "anyaccel.strategies.nd.options" and "tp" in MESH_DIM_NAMES
    assert SequenceGroup.__module__ == "anyaccel.strategies.loss" and callable(causal_lm_loss)
    assert all(callable(f) for f in (DeepSpeedStrategy, check_tp_divisibility, tp_styles, Pipeline, default_loss,
                                     split_batch, stage_ranks, SequenceParallelAttention)) and PP_SCHEDULES
    with pytest.raises(ImportError, match="cannot import name 'FSDPOption'"):  # a typo is still an error
        from anyaccel.strategies.options import FSDPOption  # noqa: F401
    for name in ("fsdp", "nd", "deepspeed"):  # every built-in target resolves
        assert strategies.strategy_entry(name).load().name == name
