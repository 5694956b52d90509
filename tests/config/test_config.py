"""The configuration schema, file and ``anyaccel config`` command (fast; no GPU needed)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import stat
import subprocess
import sys
import warnings

import pytest
import yaml

from anyaccel.config import file as cfgfile
from anyaccel.config.file import (
    default_config_path,
    find_config_file,
    from_accelerate,
    load_config,
    save_config,
)
from anyaccel.config.schema import (
    Config,
    ConfigError,
    ConfigWarning,
    check_value,
    field_allowed,
    field_choices,
    field_help,
    mixed_precision_choices,
)

from conftest import CONSOLE_SCRIPT, ROOT  # noqa: E402

REPO = ROOT



def clean_env(home: pathlib.Path) -> dict:
    """A child environment whose default config paths all lie under ``home``, with no GPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANYACCEL_", "XDG_", "HF_"))}
    env.update(HOME=str(home), PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="")
    return env


def anyaccel(tmp_path, *args, stdin=subprocess.DEVNULL, entry=("-c", CONSOLE_SCRIPT)):
    return subprocess.run(
        [sys.executable, *entry, *map(str, args)],
        cwd=tmp_path,
        env=clean_env(tmp_path),
        stdin=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


# --------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------


def test_every_field_has_help_and_a_valid_default():
    cfg = Config()
    for f in dataclasses.fields(Config):
        assert field_help(f.name).endswith(".")
        assert check_value(f.name, getattr(cfg, f.name)) == getattr(cfg, f.name)
        assert field_allowed(f.name)
    assert field_choices("mixed_precision") == ("no", "fp16", "bf16", "fp8")
    assert field_choices("num_processes") is None
    assert cfg.validate() is cfg


def test_config_is_frozen_and_always_valid():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().device = "cpu"  # type: ignore[misc]
    with pytest.raises(ConfigError, match="machine_rank"):
        dataclasses.replace(Config(), machine_rank=1)
    with pytest.raises(ConfigError, match="num_processes"):
        Config(device="mps", num_processes=2)


def test_from_dict_normalises_only_safe_values():
    cfg = Config.from_dict({"mixed_precision": False, "device": "CPU", "gpu_ids": [0, 2], "monitor_interval": 1})
    assert (cfg.mixed_precision, cfg.device, cfg.gpu_ids, cfg.monitor_interval) == ("no", "cpu", "0,2", 1.0)
    assert Config.from_dict({"gpu_ids": 1}).gpu_ids == "1"
    for key, value in [("num_processes", "2"), ("num_processes", 2.0), ("num_processes", True), ("device", 1)]:
        with pytest.raises(ConfigError, match=key):
            Config.from_dict({key: value})


@pytest.mark.parametrize(
    "values, key, allowed",
    [
        ({"main_process_port": 0}, "main_process_port", "1 to 65535"),
        ({"gpu_ids": "0,x"}, "gpu_ids", "such as 0,1"),
        ({"gpu_ids": "1,1"}, "gpu_ids", "twice"),
        ({"monitor_interval": 0}, "monitor_interval", "> 0"),
        ({"max_restarts": -1}, "max_restarts", ">= 0"),
        ({"rdzv_backend": "etcd"}, "rdzv_backend", "static, c10d"),
        ({"num_machines": 2}, "compute_environment", "several_machines"),
        ({"compute_environment": "several_machines"}, "num_machines", ">= 2"),
        ({"compute_environment": "several_machines", "num_machines": 2, "main_process_ip": "h", "num_processes": 3},
         "num_processes", "multiple of 2"),
        ({"device": "tpu", "mixed_precision": "fp16"}, "mixed_precision", "no, bf16"),
    ],
)  # fmt: skip
def test_rules_name_key_and_allowed_values(values, key, allowed):
    with pytest.raises(ConfigError) as info:
        Config.from_dict(values, source="my.yaml")
    message = str(info.value)
    assert message.startswith("my.yaml: ") and key in message and allowed in message
    assert info.value.key == key


def test_mixed_precision_per_device_and_process_count():
    assert mixed_precision_choices("cpu") == ("no", "bf16", "fp16", "fp8")  # fp8: emulated on the CPU
    assert "fp16" not in mixed_precision_choices("tpu")
    assert Config().resolve_num_processes(gpu_count=0) == 1
    assert Config().resolve_num_processes(gpu_count=4) == 4
    assert Config(gpu_ids="0,1").resolve_num_processes(gpu_count=4) == 2
    assert Config(device="cpu").resolve_num_processes(gpu_count=4) == 1
    assert Config(num_processes=3).resolve_num_processes(gpu_count=8) == 3


# --------------------------------------------------------------------------------------------
# Bad files: through load_config and through the real CLI
# --------------------------------------------------------------------------------------------

SEVERAL = "compute_environment: several_machines\nnum_machines: 2\n"
BAD_FILES = {
    "not_yaml": ("num_processes: [1, 2\n", "not valid YAML", "num_processes"),
    "list": ("- num_processes\n- 2\n", "found a list", "mixed_precision"),
    "wrong_type": ("num_processes: many\n", "'many'", "integer >= 1"),
    "bad_choice": ("mixed_precision: fp7\n", "'fp7'", "no, fp16, bf16"),
    "rank_too_big": (SEVERAL + "machine_rank: 2\nmain_process_ip: 10.0.0.1\n", "machine_rank", "0 to 1"),
    "no_ip": (SEVERAL, "main_process_ip", "IP address"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_load_config(tmp_path, case):
    text, key, allowed = BAD_FILES[case]
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message and key in message and allowed in message


# Every case through the console script; `python -m anyaccel.cli` reaches the same main() and error
# path, so one case shows it reports alike (each case is a fresh interpreter importing torch: ~3 CPU-s;
# every case's message is also checked in-process by test_bad_file_load_config).
@pytest.mark.parametrize("case, entry", [(case, ("-c", CONSOLE_SCRIPT)) for case in sorted(BAD_FILES)]
                         + [("wrong_type", ("-m", "anyaccel.cli"))],
                         ids=[f"{case}-anyaccel" for case in sorted(BAD_FILES)] + ["wrong_type-python-m"])
def test_bad_file_cli(tmp_path, case, entry):
    text, key, allowed = BAD_FILES[case]
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    result = anyaccel(tmp_path, "config", "show", "--config_file", path, entry=entry)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("anyaccel config: error: ")
    for part in (str(path), key, allowed):
        assert part in result.stderr


def test_a_typod_key_is_an_error_naming_the_key_it_meant(tmp_path):
    """issue 29: `mixd_precision: bf16` must stop, not train in fp32 after a warning."""
    path = tmp_path / "cfg.yaml"
    path.write_text("device: cpu\nmixd_precision: bf16\nnum_procesess: 2\n")
    with pytest.raises(ConfigError, match=r"unknown keys 'mixd_precision' \(did you mean 'mixed_precision'\?\), "
                                          r"'num_procesess' \(did you mean 'num_processes'\?\)"):
        load_config(path)
    result = anyaccel(tmp_path, "config", "show", "--config_file", path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and "did you mean 'mixed_precision'?" in result.stderr
    # anyaccel launch stops before anything starts: nothing runs with a setting nobody asked for
    script = tmp_path / "train.py"
    script.write_text("open('ran', 'w').close()\n")
    result = anyaccel(tmp_path, "launch", "--config_file", path, script)
    assert result.returncode == 2 and "did you mean 'mixed_precision'?" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "ran").exists()


def test_keys_of_a_newer_anyaccel_are_ignored_with_a_warning(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("config_version: 2\ndevice: cpu\nfuture_knob: 3\n")
    with pytest.warns(ConfigWarning, match="config_version 2 is newer.*without the key\\(s\\) future_knob"):
        assert load_config(path).device == "cpu"


def test_empty_file_gives_defaults(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("# nothing yet\n")
    assert load_config(path) == Config()


def test_unreadable_path_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path)  # a directory


# --------------------------------------------------------------------------------------------
# Saving and paths
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        Config(),
        Config(device="cpu", num_processes=2, mixed_precision="bf16", gradient_accumulation_steps=4),
        Config(compute_environment="several_machines", device="gpu", num_machines=2, machine_rank=1,
               main_process_ip="10.1.2.3", main_process_port=29555, num_processes=8, gpu_ids="0,1,2,3",
               rdzv_backend="c10d", max_restarts=3, monitor_interval=0.5),
    ],
)  # fmt: skip
def test_save_load_round_trip(tmp_path, cfg):
    path = save_config(cfg, tmp_path / "deep" / "er" / "cfg.yaml")
    assert load_config(path) == cfg
    text = path.read_text()
    assert text.startswith("# anyaccel configuration")
    assert "mixed_precision: 'no'" in text or "mixed_precision: bf16" in text
    assert yaml.safe_load(text) == cfg.to_dict()


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "cfg.yaml"
    save_config(Config(device="cpu"), path)
    os.chmod(path, 0o600)
    save_config(Config(device="gpu"), path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cfgfile.os, "replace", broken_replace)
    with pytest.raises(OSError):
        save_config(Config(device="tpu"), path)
    assert load_config(path).device == "gpu"  # old file untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml"]  # temp file removed


def test_default_config_path_order(tmp_path):
    env = {
        "HOME": "/home/u",
        "XDG_CONFIG_HOME": "/xdg",
        "ANYACCEL_HOME": "/aa",
        "ANYACCEL_CONFIG_FILE": "/etc/aa.yaml",
    }
    assert default_config_path(env) == pathlib.Path("/etc/aa.yaml")
    env["ANYACCEL_CONFIG_FILE"] = ""  # empty counts as unset
    assert default_config_path(env) == pathlib.Path("/aa/default_config.yaml")
    del env["ANYACCEL_HOME"]
    assert default_config_path(env) == pathlib.Path("/xdg/anyaccel/default_config.yaml")
    del env["XDG_CONFIG_HOME"]
    assert default_config_path(env) == pathlib.Path("/home/u/.config/anyaccel/default_config.yaml")
    assert default_config_path({"HOME": "/h", "ANYACCEL_HOME": "~/aa"}) == pathlib.Path("/h/aa/default_config.yaml")


def test_find_config_file(tmp_path):
    env = {"HOME": str(tmp_path)}
    assert find_config_file(None, env) is None
    default = save_config(Config(), default_config_path(env))
    assert find_config_file(None, env) == default
    other = save_config(Config(), tmp_path / "other.yaml")
    assert find_config_file(str(other), env) == other
    with pytest.raises(ConfigError, match="missing.yaml does not exist"):
        find_config_file(str(tmp_path / "missing.yaml"), env)


# --------------------------------------------------------------------------------------------
# Accelerate
# --------------------------------------------------------------------------------------------

ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_GPU
downcast_bf16: 'no'
enable_cpu_affinity: false
gpu_ids: 0,1
machine_rank: 1
main_process_ip: 192.168.1.10
main_process_port: 29501
main_training_function: main
mixed_precision: bf16
num_machines: 2
num_processes: 4
rdzv_backend: c10d
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def test_from_accelerate_multi_gpu(tmp_path):
    path = tmp_path / "acc.yaml"
    path.write_text(ACCELERATE_YAML)
    assert from_accelerate(path) == Config(
        compute_environment="several_machines", device="gpu", num_machines=2, machine_rank=1,
        main_process_ip="192.168.1.10", main_process_port=29501, num_processes=4, gpu_ids="0,1",
        mixed_precision="bf16", rdzv_backend="c10d",
    )  # fmt: skip


@pytest.mark.parametrize(
    "text, expected",
    [
        ("distributed_type: 'NO'\nmixed_precision: 'no'\nnum_processes: 1\nuse_cpu: true\n",
         Config(device="cpu", num_processes=1)),
        ("distributed_type: NO\nnum_processes: 1\nmain_process_ip: null\ngpu_ids: all\n", Config(num_processes=1)),
        ("distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: no\n", Config(device="cpu", num_processes=2)),
        ("distributed_type: XLA\nmixed_precision: bf16\n", Config(device="tpu", mixed_precision="bf16")),
    ],
)  # fmt: skip
def test_from_accelerate_single_machine(tmp_path, text, expected):
    path = tmp_path / "acc.yaml"
    path.write_text(text)
    assert from_accelerate(path) == expected


def test_from_accelerate_fsdp_and_dynamo(tmp_path):
    path = tmp_path / "acc.yaml"
    path.write_text(
        "distributed_type: FSDP\nnum_processes: 8\nmixed_precision: bf16\nfsdp_config:\n"
        "  fsdp_version: 1\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
        "  fsdp_transformer_layer_cls_to_wrap: BertLayer,BertEmbeddings\n  fsdp_backward_prefetch: BACKWARD_PRE\n"
        "  fsdp_cpu_ram_efficient_loading: true\n  fsdp_offload_params: true\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n"
        "  fsdp_state_dict_type: FULL_STATE_DICT\n  fsdp_use_orig_params: true\n"
        "dynamo_config:\n  dynamo_backend: INDUCTOR\n  dynamo_mode: max-autotune\n"
    )
    with warnings.catch_warnings():  # FSDP1's settings are read into their FSDP2 meaning, without a warning
        warnings.simplefilter("error")
        cfg = from_accelerate(path)
    assert (cfg.device, cfg.strategy, cfg.num_processes, cfg.mixed_precision) == ("gpu", "fsdp", 8, "bf16")
    assert cfg.fsdp_config == {"reshard_after_forward": False, "auto_wrap_policy": "transformer_based_wrap",
                               "transformer_cls_names_to_wrap": ["BertLayer", "BertEmbeddings"], "cpu_offload": True,
                               "state_dict_type": "FULL_STATE_DICT"}
    assert (cfg.dynamo_backend, cfg.dynamo_mode) == ("inductor", "max-autotune")


@pytest.mark.parametrize(
    "text, message",
    [
        # what `accelerate config` writes for several machines with DeepSpeed's pdsh launcher
        ("distributed_type: DEEPSPEED\nnum_machines: 2\nmain_process_ip: 10.0.0.1\nnum_processes: 4\n"
         "deepspeed_config:\n  zero_stage: 2\n  deepspeed_multinode_launcher: pdsh\n  deepspeed_hostfile: /job/hosts\n",
         "deepspeed_config.deepspeed_multinode_launcher has the value 'pdsh'; allowed: standard (torch's elastic "
         "agent, which anyaccel launch runs on every machine; pdsh, openmpi, mvapich, mpich, nossh and slurm are "
         "DeepSpeed's own launchers, which anyaccel does not use); deepspeed_config: has the key "
         "'deepspeed_hostfile', which DeepSpeed's own multi-machine launchers (pdsh, MPI, ...) read"),
        ("distributed_type: MULTI_GPU\ndeepspeed_config:\n  zero_stage: 2\n",
         "deepspeed_config (distributed_type is MULTI_GPU, so Accelerate does not use it either"),
        ("distributed_type: MEGATRON_LM\n", "no Megatron-LM"),
        ("compute_environment: AMAZON_SAGEMAKER\n", "compute_environment: AMAZON_SAGEMAKER"),
        ("distributed_type: MULTI_GPU\nenable_cpu_affinity: true\n", "enable_cpu_affinity: True"),
    ],
)  # fmt: skip
def test_accelerate_settings_anyaccel_cannot_honour(tmp_path, text, message):
    """anyaccel launch stops with one line naming each of them and the converting command;
    `anyaccel config --from-accelerate` converts the rest and says what it left out."""
    path = tmp_path / "acc.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    line = str(info.value)
    assert "\n" not in line and str(path) in line and message in line
    assert f"run `anyaccel config --from-accelerate {path}`" in line
    with pytest.warns(ConfigWarning, match="left out, anyaccel cannot honour them"):
        from_accelerate(path)


@pytest.mark.parametrize(
    "text, message",
    [
        ("distributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: MAGIC\n", "auto_wrap_policy='MAGIC'"),
        ("distributed_type: MULTI_GPU\nmixed_precision: fp4\n", "no, fp16, bf16, fp8"),
        ("distributed_type: MULTI_GPU\nnum_processess: 2\n", "'num_processess' (did you mean 'num_processes'?)"),
        ("- not a mapping\n", "mapping"),
    ],
)
def test_from_accelerate_bad_values(tmp_path, text, message):
    path = tmp_path / "acc.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        from_accelerate(path)
    assert str(path) in str(info.value) and message in str(info.value)


def test_from_accelerate_default_path(tmp_path):
    env = {"HOME": str(tmp_path)}
    default = tmp_path / ".cache" / "huggingface" / "accelerate" / "default_config.yaml"
    assert cfgfile.accelerate_config_path(env) == default
    assert cfgfile.accelerate_config_path({"HF_HOME": "/hf"}) == pathlib.Path("/hf/accelerate/default_config.yaml")
    with pytest.raises(ConfigError, match="no Accelerate config file"):
        from_accelerate(None, env)
    default.parent.mkdir(parents=True)
    default.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\n")
    assert from_accelerate(None, env) == Config(device="cpu", num_processes=2)


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def test_cli_default_then_show(tmp_path):
    default = tmp_path / ".config" / "anyaccel" / "default_config.yaml"
    result = anyaccel(tmp_path, "config", "show")
    assert result.returncode == 0 and str(default) in result.stdout and "does not exist" in result.stdout
    assert Config.from_dict(yaml.safe_load(result.stdout)) == Config()

    result = anyaccel(tmp_path, "config", "--default")
    assert result.returncode == 0, result.stderr
    assert str(default) in result.stdout
    assert load_config(default) == Config(device="cpu", num_processes=1)  # CUDA_VISIBLE_DEVICES=""

    result = anyaccel(tmp_path, "config", "show")
    assert result.returncode == 0 and result.stdout.startswith(f"# {default}\n")
    assert yaml.safe_load(result.stdout)["device"] == "cpu"


def test_cli_from_accelerate(tmp_path):
    source, target = tmp_path / "acc.yaml", tmp_path / "out" / "anyaccel.yaml"
    source.write_text(ACCELERATE_YAML)
    result = anyaccel(tmp_path, "config", "--from-accelerate", source, "--config_file", target)
    assert result.returncode == 0, result.stderr
    assert str(target) in result.stdout and load_config(target) == from_accelerate(source)
    source.write_text("distributed_type: MEGATRON_LM\nnum_processes: 2\n")
    result = anyaccel(tmp_path, "config", "--from-accelerate", source, "--config_file", target)
    assert result.returncode == 0 and "warning: " in result.stderr and "MEGATRON_LM" in result.stderr
    assert load_config(target).num_processes == 2 and "Traceback" not in result.stderr


def test_cli_without_terminal_suggests_default(tmp_path):
    result = anyaccel(tmp_path, "config", "--config_file", tmp_path / "c.yaml")
    assert result.returncode == 2
    assert "interactive terminal" in result.stderr and "--default" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "c.yaml").exists()


def test_cli_usage_errors(tmp_path):
    result = anyaccel(tmp_path, "config", "show", "--default")
    assert result.returncode == 2 and "takes only --config_file" in result.stderr
    result = anyaccel(tmp_path, "config", "--default", "--from-accelerate")
    assert result.returncode == 2 and "not both" in result.stderr
    result = anyaccel(tmp_path, "config", "show", "--config_file", tmp_path / "nope.yaml")
    assert result.returncode == 2 and "nope.yaml does not exist" in result.stderr


def test_suggested_config_follows_detection():
    from anyaccel.config.wizard import suggested_config

    # detect()'s answer: {config device name: devices visible}, every registered device named
    assert suggested_config({"cpu": 1, "gpu": 0, "tpu": 0, "mps": 0}) == Config(device="cpu", num_processes=1)
    assert suggested_config({"cpu": 1, "gpu": 8, "tpu": 0, "mps": 1}) == Config(device="gpu", num_processes=8)
    assert suggested_config({"cpu": 1, "gpu": 0, "tpu": 1, "mps": 0}) == Config(device="tpu")
    assert suggested_config({"cpu": 1, "gpu": 0, "tpu": 0, "mps": 1}) == Config(device="mps", num_processes=1)


def test_detect_does_not_initialise_cuda():
    code = (
        "import torch; from anyaccel.config.wizard import detect; d = detect(); "
        "assert set(d) == {'cpu', 'gpu', 'tpu', 'mps'} and all(isinstance(n, int) for n in d.values()); "
        "assert not torch.cuda.is_initialized(); print(d)"
    )
    result = subprocess.run([sys.executable, "-c", code], env=clean_env(REPO), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------------------------
# Files written by `accelerate config` itself (accelerate_files/make_files.py says how)
# --------------------------------------------------------------------------------------------

ACCELERATE_FILES = pathlib.Path(__file__).parent / "accelerate_files"


def test_an_accelerate_gpu_file_on_a_machine_without_gpus_says_to_pass_cpu():
    from anyaccel.launch.plan import LaunchRequest, PlanError, resolve_plan

    values = cfgfile.read_config(ACCELERATE_FILES / "gpu_bf16.yaml")
    with pytest.raises(PlanError, match="device is gpu .* but no CUDA GPU is visible .*Pass --cpu"):
        resolve_plan(LaunchRequest.of("train.py"), values, {}, 0)


def test_an_accelerate_deepspeed_file_converts_to_the_deepspeed_strategy(tmp_path):
    """`anyaccel config --from-accelerate` writes the file's DeepSpeed section as anyaccel's, its
    gradient_accumulation_steps as the top-level key; no warning: nothing is left out."""
    path, target = ACCELERATE_FILES / "deepspeed.yaml", tmp_path / "anyaccel.yaml"
    result = anyaccel(tmp_path, "config", "--from-accelerate", path, "--config_file", target)
    assert result.returncode == 0 and "warning" not in result.stderr, result.stderr
    cfg = load_config(target)
    assert (cfg.strategy, cfg.mixed_precision, cfg.num_processes, cfg.gradient_accumulation_steps) == \
        ("deepspeed", "bf16", 2, 1)
    assert cfg.deepspeed_config == {"zero_stage": 2, "offload_optimizer_device": "none",
                                    "offload_param_device": "none", "zero3_init_flag": False}
