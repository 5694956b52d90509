"""N-D parallelism from the configuration file, ``anyaccel launch`` flags and the launcher's
variables (issue 22, item 1), with Accelerate 1.15's spellings:

* config file: ``parallelism_config: {parallelism_config_dp_replicate_size: .., _dp_shard_size,
  _tp_size, _cp_size}`` (what ``accelerate config`` writes);
* flags: ``--parallelism_config_dp_replicate_size`` ... and ``--use_parallelism_config``;
* worker variables: ``PARALLELISM_CONFIG_DP_REPLICATE_SIZE`` ... (what ``accelerate launch`` exports).

Each bad input is one clear error before any process or model exists. Unit tests: no processes,
except the wizard driven in a pseudo-terminal.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings

import pytest

from anyaccel import Accelerator, ParallelismConfig, envvars
from anyaccel.cli import build_parser
from anyaccel.config.file import from_accelerate, load_config, save_config
from anyaccel.config.schema import Config, ConfigError
from anyaccel.errors import CLIError
from anyaccel.launch.command import request_from_args
from anyaccel.launch.plan import PlanError, resolve_plan
from anyaccel.compat.arguments import resolve_options

from conftest import SCRIPTS, TESTS

SCRIPT = str(SCRIPTS / "nd_checks.py")
SIZES = ("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "PARALLELISM_CONFIG_DP_SHARD_SIZE", "PARALLELISM_CONFIG_TP_SIZE",
         "PARALLELISM_CONFIG_CP_SIZE")


@pytest.fixture(autouse=True)
def _no_launcher_sizes(monkeypatch):
    for name in SIZES + ("ANYACCEL_STRATEGY", "ANYACCEL_FSDP_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def launch_plan(*flags, config=None):
    args = build_parser().parse_args(["launch", "--cpu", *map(str, flags), SCRIPT])
    return resolve_plan(request_from_args(args), config, {}, 0)


# ---- the config file ---------------------------------------------------------------------------------


def test_config_key_takes_accelerates_spelling_and_selects_nd(tmp_path):
    cfg = Config(num_processes=4, parallelism_config={"parallelism_config_tp_size": 2, "dp_shard_size": 2})
    # stored as Accelerate writes it (the short names are accepted too)
    assert cfg.parallelism_config == {"parallelism_config_tp_size": 2, "parallelism_config_dp_shard_size": 2}
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg
    plan = launch_plan("--num_processes", 4, config=cfg)
    assert plan.strategy == "nd"
    assert {k: v for k, v in plan.worker_env if k.startswith("PARALLELISM")} == {
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
        "PARALLELISM_CONFIG_TP_SIZE": "2", "PARALLELISM_CONFIG_CP_SIZE": "1", "PARALLELISM_CONFIG_PP_SIZE": "1",
        "PARALLELISM_CONFIG_SP_SIZE": "1", "PARALLELISM_CONFIG_EP_SIZE": "1"}


@pytest.mark.parametrize("value, needle", [
    ({"parallelism_config_tp_size": 0}, "parallelism_config_tp_size' has the value 0; allowed: an integer >= 1"),
    ({"tp_size": "2"}, "tp_size' has the value '2' \\(a string\\); allowed: an integer >= 1"),
    ({"tp_size": True}, "tp_size' has the value True"),
    ({"parallelism_config_sp_seq_length": 128, "sp_size": 2}, "'parallelism_config_sp_seq_length' with "
                                                                "parallelism_config_sp_size 2, which anyaccel does not"),
    ({"sp_backend": "megatron"}, "parallelism_config_sp_backend' has the value 'megatron'; allowed: one of ulysses, "
                                 "deepspeed"),
    ({"tp_sise": 2}, "'tp_sise', which is not one of .*\\(did you mean 'parallelism_config_tp_size'\\?\\)"),
    ([2, 2], "has the value \\[2, 2\\] \\(a list\\); allowed: a mapping of parallelism_config_<dim>_size keys"),
])
def test_bad_config_values_name_the_key(value, needle):
    with pytest.raises(ConfigError, match=needle) as info:
        Config.from_dict({"num_processes": 4, "parallelism_config": value}, source="cfg.yaml")
    assert str(info.value).startswith("cfg.yaml: key 'parallelism_config")


def test_sizes_that_do_not_make_num_processes_are_refused_by_the_file():
    with pytest.raises(ConfigError, match=r"tp_size=3 = 3 processes, but this job has 4"):
        Config(num_processes=4, parallelism_config={"tp_size": 3})
    with pytest.raises(ConfigError, match=r"dp_shard_size=2 with the others as they are"):
        Config(num_processes=4, parallelism_config={"tp_size": 2})
    Config(num_processes=4, parallelism_config={})  # all 1: plain replicas (Accelerate's rule)
    Config(num_processes=None, parallelism_config={"tp_size": 3})  # processes decided at launch: checked there


def test_context_parallel_is_refused_by_the_file_and_the_launcher():
    with pytest.raises(ConfigError, match=r"cp_size=2\): context parallelism needs SDPA attention on CUDA .*device "
                                          r"type: cpu"):
        Config(num_processes=4, device="cpu", parallelism_config={"dp_shard_size": 2, "cp_size": 2})
    with pytest.raises(PlanError, match="context parallelism needs SDPA attention on CUDA"):
        launch_plan("--num_processes", 4, "--parallelism_config_cp_size", 2, "--parallelism_config_dp_shard_size", 2)


def test_strategy_contradictions_and_fsdp_options():
    with pytest.raises(ConfigError, match="key 'parallelism_config' is set but strategy is ddp"):
        Config(num_processes=2, strategy="ddp", parallelism_config={"tp_size": 2})
    # fsdp_config next to parallelism_config configures nd's sharding (Accelerate writes both)
    cfg = Config(num_processes=2, parallelism_config={"dp_shard_size": 2}, fsdp_config={"reshard_after_forward": False})
    assert launch_plan(config=cfg).strategy == "nd"
    with pytest.raises(ConfigError, match="key 'parallelism_config' is set but strategy is fsdp"):
        Config(num_processes=2, strategy="fsdp", parallelism_config={"dp_shard_size": 2})


def test_an_accelerate_config_with_parallelism_becomes_nd(tmp_path):
    path = tmp_path / "accelerate.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_processes: 4\nuse_cpu: true\n"
                    "fsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: false\n"
                    "parallelism_config:\n  parallelism_config_dp_replicate_size: 1\n"
                    "  parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 2\n"
                    "  parallelism_config_cp_size: 1\n")
    cfg = from_accelerate(path)
    assert (cfg.strategy, cfg.parallelism_config["parallelism_config_tp_size"]) == ("nd", 2)
    assert cfg.fsdp_config == {"reshard_after_forward": False}


# ---- anyaccel launch flags -----------------------------------------------------------------------------


def test_flags_override_the_file_size_by_size():
    cfg = Config(num_processes=4, parallelism_config={"tp_size": 2, "dp_shard_size": 2})
    plan = launch_plan("--parallelism_config_tp_size", 4, "--parallelism-config-dp-shard-size", 1, config=cfg)
    env = dict(plan.worker_env)
    assert (env["PARALLELISM_CONFIG_TP_SIZE"], env["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("4", "1")
    assert plan.source("parallelism_config") == "flag" and plan.strategy == "nd"
    # without any: no variable, no strategy
    assert not [k for k, _ in launch_plan("--num_processes", 2).worker_env if k.startswith("PARALLELISM")]


def test_use_parallelism_config_is_strategy_nd_also_with_accelerates_fsdp_flags():
    assert launch_plan("--num_processes", 2, "--use_parallelism_config").strategy == "nd"
    # Accelerate's own line: --use_parallelism_config needs --use_fsdp --fsdp_version 2 there; the
    # FSDP flags then configure how nd shards
    plan = launch_plan("--num_processes", 4, "--use_fsdp", "--fsdp_version", 2, "--fsdp_reshard_after_forward",
                       "false", "--use_parallelism_config", "--parallelism_config_dp_shard_size", 2,
                       "--parallelism_config_tp_size", 2)
    env = dict(plan.worker_env)
    assert (plan.strategy, env["ANYACCEL_STRATEGY"], env["PARALLELISM_CONFIG_TP_SIZE"]) == ("nd", "nd", "2")
    config = resolve_options(envvars.worker_settings(env)).strategy_options
    assert config.fsdp.reshard_after_forward is False and config.tp_size == 2
    # a size flag next to --use_fsdp means nd too; --use_parallelism_config next to another strategy is refused
    assert launch_plan("--num_processes", 2, "--use_fsdp", "--parallelism_config_tp_size", 2).strategy == "nd"
    with pytest.raises(CLIError, match="--use_parallelism_config asks for the nd strategy but --strategy is ddp"):
        launch_plan("--num_processes", 2, "--use_parallelism_config", "--strategy", "ddp")


def test_flag_sizes_that_do_not_make_num_processes_fail_before_anything_starts():
    with pytest.raises(PlanError, match=r"tp_size=2 = 2 processes, but this job has 4.*from --parallelism_config_\* "
                                        r"flags"):
        launch_plan("--num_processes", 4, "--parallelism_config_tp_size", 2)
    with pytest.raises(PlanError, match="strategy is ddp"):
        launch_plan("--num_processes", 2, "--strategy", "ddp", "--parallelism_config_dp_shard_size", 2)


def test_a_flag_size_below_one_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["launch", "--parallelism_config_tp_size", "0", SCRIPT])
    assert info.value.code == 2
    assert "invalid value 0; allowed: an integer >= 1" in capsys.readouterr().err


# ---- the worker: argument > launcher variable > default ---------------------------------------------


def test_the_launchers_sizes_become_a_parallelism_config_with_its_fsdp_options():
    env = {"PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_TP_SIZE": "2", "ANYACCEL_STRATEGY": "nd",
           "ANYACCEL_FSDP_CONFIG": '{"reshard_after_forward": false}'}
    options = resolve_options(envvars.worker_settings(env))
    config = options.strategy_options  # typed: the nd strategy's options, not a handler
    assert options.strategy == "nd" and isinstance(config, ParallelismConfig)
    assert (config.sizes(), config.fsdp.reshard_after_forward) == (
        {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "sp": 1, "tp": 2}, False)
    # the argument wins over the launcher
    mine = ParallelismConfig(dp_replicate_size=1, dp_shard_size=4, tp_size=1, cp_size=1)
    options = resolve_options(envvars.worker_settings(env), parallelism_config=mine)
    assert options.strategy_options is mine
    # nothing told, nothing given: no N-D
    assert resolve_options(envvars.worker_settings({})).strategy is None


def test_an_fsdp_plugin_next_to_a_parallelism_config_configures_its_sharding():
    from anyaccel import FullyShardedDataParallelPlugin
    from anyaccel.strategies.options import FSDPOptions

    # Accelerate's N-D scripts pass both; before, the plugin was silently ignored
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=False)
    options = resolve_options(envvars.worker_settings({}), parallelism_config=ParallelismConfig(tp_size=1),
                              fsdp_plugin=plugin)
    config = options.strategy_options
    assert options.strategy == "nd" and config.fsdp.reshard_after_forward is False
    with pytest.raises(ValueError, match="fsdp_plugin and parallelism_config.fsdp both configure"):
        resolve_options(envvars.worker_settings({}), fsdp_plugin=plugin, parallelism_config=ParallelismConfig(
            fsdp=FSDPOptions(activation_checkpointing=True)))


def test_a_strategy_argument_wins_over_the_launchers_sizes_and_says_so():
    env = {"PARALLELISM_CONFIG_TP_SIZE": "2", "ANYACCEL_STRATEGY": "nd"}
    with pytest.warns(UserWarning, match=r"sizes \{'tp_size': 2\} .* are not used: Accelerator\(strategy='ddp'\)"):
        options = resolve_options(envvars.worker_settings(env), strategy="ddp")
    assert options.strategy == "ddp" and options.strategy_options is None


def test_sizes_left_unset_read_the_launchers_variable(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    assert ParallelismConfig(dp_shard_size=3).sizes() == {"pp": 1, "dp_replicate": 1, "dp_shard": 3, "cp": 1, "sp": 1,
                                                           "tp": 2}
    assert ParallelismConfig(tp_size=1).tp_size == 1  # a size given wins
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "two")
    with pytest.raises(ValueError, match="PARALLELISM_CONFIG_TP_SIZE has the value 'two'; allowed: an integer >= 1"):
        ParallelismConfig()


def test_launcher_sizes_for_another_world_size_fail_in_the_accelerator_before_any_group(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    before = dist.is_initialized()  # (an earlier test in this worker may have left one: not ours to judge here)
    with pytest.raises(ValueError, match=r"= 4 processes, but this job has 1"):
        Accelerator(cpu=True)
    assert dist.is_initialized() == before  # the Accelerator made no group


def test_worker_env_round_trips_the_sizes():
    env = envvars.worker_env(dp_replicate_size=2, dp_shard_size=1, tp_size=2, cp_size=1)
    settings = envvars.worker_settings(env)
    assert settings.parallelism_sizes() == {"dp_replicate_size": 2, "dp_shard_size": 1, "tp_size": 2, "cp_size": 1}
    assert dataclasses.replace(settings, tp_size=None).parallelism_sizes().get("tp_size") is None


# ---- the wizard ------------------------------------------------------------------------------------


def test_wizard_asks_the_sizes_for_nd_and_refuses_one_that_does_not_divide(tmp_path):
    pytest.importorskip("pexpect")
    sys.path.insert(0, str(TESTS / "config"))  # the wizard tests' helpers
    from test_wizard import CLEAR_LINE, DOWN, ENTER, answer, finish, spawn

    target = tmp_path / "cfg.yaml"
    child = spawn(tmp_path, target)
    child.timeout = 60  # the first prompt waits for imports, on a loaded machine too
    answer(child, "Where will the training run", ENTER)
    answer(child, "Which device", ENTER)
    answer(child, "How many processes", CLEAR_LINE, "4", ENTER)
    answer(child, "Mixed precision", ENTER)
    answer(child, "How should each process hold the model", DOWN, DOWN, ENTER)  # ddp, fsdp, nd
    answer(child, "Tensor-parallel size", CLEAR_LINE, "3", ENTER)
    child.expect_exact("divides 4")  # refused inline, asked again
    child.send(CLEAR_LINE + "2" + ENTER)
    answer(child, "Pipeline stages", CLEAR_LINE, "2", ENTER)  # the pp and sp rows of the option table ask
    answer(child, "Sequence-parallel size", ENTER)
    answer(child, "Model replicas", ENTER)
    child.expect_exact("dp_shard_size = 1")
    answer(child, "Pipeline schedule", DOWN, ENTER)  # asked because pp_size > 1: 1F1B, GPipe, ...
    answer(child, "Pipeline micro-batches", "4", ENTER)
    answer(child, "Compile the model", ENTER)
    answer(child, "Save it", ENTER)
    assert finish(child) == 0
    with warnings.catch_warnings():
        cfg = load_config(target)
    assert cfg.strategy == "nd" and cfg.parallelism_config == {
        "parallelism_config_dp_replicate_size": 1, "parallelism_config_dp_shard_size": 1,
        "parallelism_config_tp_size": 2, "parallelism_config_pp_size": 2, "parallelism_config_sp_size": 1,
        "parallelism_config_pp_schedule": "GPipe", "parallelism_config_pp_microbatches": 4}


def test_an_accelerate_config_with_context_parallel_off_loads_with_a_warning():
    """Accelerate writes cp_comm_strategy (and cp_backend) with cp_size 1; such a file must load
    (the settings do nothing), while the same settings with a real size are refused."""
    from anyaccel.config.schema import check_value

    with pytest.warns(UserWarning, match="parallelism_config_cp_comm_strategy ignored"):
        sizes = check_value("parallelism_config", {"parallelism_config_cp_comm_strategy": "allgather",
                                                   "parallelism_config_cp_size": 1, "parallelism_config_tp_size": 2})
    assert sizes == {"parallelism_config_cp_size": 1, "parallelism_config_tp_size": 2}
    with pytest.raises(ConfigError, match="'cp_comm_strategy' with parallelism_config_cp_size 2, which anyaccel does not"):
        check_value("parallelism_config", {"cp_comm_strategy": "alltoall", "cp_size": 2})


def test_a_plan_whose_tensor_parallel_groups_span_machines_says_so():
    """TP sits innermost, within a machine: tp_size 4 over 2 machines of 2 processes would send
    every layer's activations over the network; the plan says so (it may be meant)."""
    plan = launch_plan("--num_machines", 2, "--machine_rank", 0, "--main_process_ip", "192.0.2.10",
                       "--main_process_port", 29500, "--num_processes", 4, "--parallelism_config_tp_size", 4)
    assert any("tensor-parallel groups will span machines" in n for n in plan.notes), plan.notes
    plan = launch_plan("--num_machines", 2, "--machine_rank", 0, "--main_process_ip", "192.0.2.10",
                       "--main_process_port", 29500, "--num_processes", 4, "--parallelism_config_tp_size", 2,
                       "--parallelism_config_dp_replicate_size", 2)
    assert not any("span machines" in n for n in plan.notes), plan.notes


def test_ep_size_from_the_argument_the_flag_the_variable_and_the_file(monkeypatch, tmp_path):
    """Issue 39 item 1: ``ep_size`` is one row of the option table (Accelerate's proposal's name):
    ``ParallelismConfig(ep_size=...)``, ``--parallelism_config_ep_size``,
    ``PARALLELISM_CONFIG_EP_SIZE`` and the file's ``parallelism_config_ep_size``; it borrows the
    dp_shard x sp processes, which it must divide (one error, naming the values and the fix)."""
    assert ParallelismConfig(dp_shard_size=4, ep_size=2).for_world_size(4).ep_size == 2
    alone = ParallelismConfig(ep_size=2).for_world_size(4)  # every size 1: the processes go to dp_shard
    assert (alone.dp_shard_size, alone.dp_replicate_size, alone.ep_enabled) == (4, 1, True)
    with pytest.raises(ValueError, match=r"ep_size=2\).*dp_shard_size=3\).*does not divide 3.*among \[1, 3\]"):
        ParallelismConfig(dp_shard_size=3, tp_size=2, ep_size=2)
    assert ParallelismConfig(dp_shard_size=2, sp_size=2, ep_size=4).for_world_size(4).ep_size == 4  # across sp too
    with pytest.raises(ValueError, match=r"ep_size=3\).*dp_shard_size=2 x sp_size=2 = 4\).*among \[1, 2, 4\]"):
        ParallelismConfig(dp_shard_size=2, sp_size=2, ep_size=3)
    args = build_parser().parse_args(["launch", "--cpu", "--num_processes", "4", "--parallelism_config_ep_size", "2",
                                      SCRIPT])
    env = resolve_plan(request_from_args(args), None, {}, 0).env_dict()
    assert env["PARALLELISM_CONFIG_EP_SIZE"] == "2"
    config = resolve_options(envvars.worker_settings(env)).strategy_options
    assert (config.ep_size, config.for_world_size(4).dp_shard_size) == (2, 4)
    monkeypatch.setenv("PARALLELISM_CONFIG_EP_SIZE", "2")
    assert ParallelismConfig(dp_shard_size=2).ep_size == 2
    with pytest.raises(ConfigError, match=r"PARALLELISM_CONFIG_EP_SIZE has the value 0; allowed: an integer >= 1"):
        envvars.worker_settings({"PARALLELISM_CONFIG_EP_SIZE": "0"})
    monkeypatch.delenv("PARALLELISM_CONFIG_EP_SIZE")
    path = tmp_path / "ep.yaml"
    save_config(Config(num_processes=4, parallelism_config={"parallelism_config_dp_shard_size": 4,
                                                            "parallelism_config_ep_size": 2}), path)
    assert load_config(path).parallelism_config["parallelism_config_ep_size"] == 2
