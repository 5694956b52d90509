"""Every file `accelerate config` (Accelerate 1.15) writes for the setups a user can have launches
under `anyaccel launch --config_file F` with the same meaning, checked on the resolved launch plan
(no processes; one real launch of the CPU file is tests/config/test_accelerate_config_files_multiprocess.py).

The files in accelerate_files/ were written by Accelerate's own questionnaire and ClusterConfig
(accelerate_files/make_files.py); the first test checks they still are what the installed
Accelerate writes. Sections that describe features that are off are accepted without a word; a
feature that is on and cannot be honoured stops the launch with one line naming it and pointing
at `anyaccel config --from-accelerate`, which converts the rest.
"""

from __future__ import annotations

import importlib.util
import pathlib
import warnings

import pytest
import yaml

from anyaccel.config.file import from_accelerate, load_config, read_config
from anyaccel.config.schema import ConfigError, ConfigWarning

FILES = pathlib.Path(__file__).parent / "accelerate_files"


def _maker():
    spec = importlib.util.spec_from_file_location("make_files", FILES / "make_files.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_files_are_what_accelerate_writes(monkeypatch):
    pytest.importorskip("accelerate")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    maker = _maker()
    names = sorted(["default.yaml", *maker.FILES])
    assert sorted(p.name for p in FILES.glob("*.yaml")) == names
    for name in names:
        assert maker.make(name) == (FILES / name).read_text(), f"{name}: run accelerate_files/make_files.py again"


def _plan(name, gpus, **flags):
    from anyaccel.launch.command import load_config_for
    from anyaccel.launch.plan import LaunchRequest, resolve_plan

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # accepted without a word
        values, where, notes = load_config_for(str(FILES / name))
        plan = resolve_plan(LaunchRequest.of("train.py", **flags), values, {}, gpus, where, notes=notes)
    assert any("is an Accelerate config file, read with the same meaning" in n for n in notes)
    return plan, notes


FSDP_BLOCK = '{"auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": ["Block"]}'
ND = {"PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
      "PARALLELISM_CONFIG_TP_SIZE": "2"}

#: file, GPUs visible, flags -> what the plan holds (env: a subset of the workers' variables;
#: note: text in one of the launch summary's notes)
LAUNCHED = [
    ("default.yaml", 0, {}, dict(device="cpu", num_processes=1, env={"ANYACCEL_USE_CPU": "1"})),
    ("no_distribution.yaml", 1, {}, dict(device="gpu", num_processes=1, strategy="auto")),
    ("no_distribution_cpu.yaml", 2, {}, dict(device="cpu", num_processes=1,
                                             env={"ANYACCEL_USE_CPU": "1", "ANYACCEL_MIXED_PRECISION": "bf16"})),
    ("cpu2.yaml", 0, {}, dict(device="cpu", num_processes=2, strategy="auto",
                              env={"ANYACCEL_USE_CPU": "1", "OMP_NUM_THREADS": "1"})),
    ("cpu2_bf16.yaml", 0, {}, dict(device="cpu", num_processes=2, env={"ANYACCEL_MIXED_PRECISION": "bf16"})),
    ("cpu_dynamo.yaml", 0, {}, dict(device="cpu", num_processes=2, env={
        "ANYACCEL_DYNAMO_BACKEND": "inductor", "ANYACCEL_DYNAMO_MODE": "max-autotune",
        "ANYACCEL_DYNAMO_USE_FULLGRAPH": "0", "ANYACCEL_DYNAMO_USE_DYNAMIC": "0"})),
    ("cpu_machines.yaml", 0, {}, dict(device="cpu", num_processes=8, num_machines=2, machine_rank=1,
                                      main_process_ip="10.0.0.1", main_process_port=29500)),
    ("gpu_bf16.yaml", 2, {}, dict(device="gpu", num_processes=2, mixed_precision="bf16",
                                  env={"ANYACCEL_MIXED_PRECISION": "bf16", "OMP_NUM_THREADS": "1"})),
    ("gpu_bf16.yaml", 0, {"cpu": True}, dict(device="cpu", num_processes=2, mixed_precision="bf16")),
    ("gpu_ids_fp16_debug.yaml", 4, {}, dict(device="gpu", num_processes=2, mixed_precision="fp16",
                                            env={"CUDA_VISIBLE_DEVICES": "0,1"})),
    ("gpu_machines.yaml", 8, {}, dict(device="gpu", num_processes=16, num_machines=2, machine_rank=1,
                                      main_process_ip="10.0.0.1", main_process_port=29500, rdzv_backend="c10d")),
    ("fsdp2.yaml", 2, {}, dict(device="gpu", strategy="fsdp", mixed_precision="bf16",
                               env={"ANYACCEL_STRATEGY": "fsdp", "ANYACCEL_FSDP_CONFIG": FSDP_BLOCK})),
    ("fsdp2.yaml", 0, {"cpu": True}, dict(device="cpu", num_processes=2, strategy="fsdp")),
    ("fsdp2_full_nowrap.yaml", 2, {}, dict(strategy="fsdp", env={"ANYACCEL_FSDP_CONFIG": (
        '{"activation_checkpointing": true, "auto_wrap_policy": "no_wrap", "reshard_after_forward": false, '
        '"state_dict_type": "FULL_STATE_DICT"}')})),
    ("nd.yaml", 4, {}, dict(device="gpu", num_processes=4, strategy="nd",
                            env={"ANYACCEL_FSDP_CONFIG": FSDP_BLOCK, **ND})),
    ("fsdp1.yaml", 2, {}, dict(strategy="fsdp", mixed_precision="bf16", note="fsdp_version 1 runs as FSDP2", env={
        "ANYACCEL_FSDP_CONFIG": '{"auto_wrap_policy": "transformer_based_wrap", "state_dict_type": '
                                '"FULL_STATE_DICT", "transformer_cls_names_to_wrap": ["Block"]}'})),
    ("fsdp1_size_offload.yaml", 2, {}, dict(strategy="fsdp", note="FSDP2 schedules its own prefetching", env={
        "ANYACCEL_FSDP_CONFIG": '{"activation_checkpointing": true, "auto_wrap_policy": "size_based_wrap", '
                                '"cpu_offload": true, "min_num_params": 100000000, "reshard_after_forward": false, '
                                '"sync_module_states": false}'})),
    ("fsdp1_no_shard.yaml", 2, {}, dict(strategy="ddp", num_processes=2, note="NO_SHARD runs as DDP")),
    ("fsdp1_hybrid_machines.yaml", 8, {}, dict(strategy="nd", num_processes=16, num_machines=2,
                                               note="replicated over the 2 machines", env={
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "8"})),
    ("deepspeed.yaml", 0, {"cpu": True}, dict(device="cpu", num_processes=2, strategy="deepspeed", env={
        "ANYACCEL_STRATEGY": "deepspeed", "ANYACCEL_MIXED_PRECISION": "bf16", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "0", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none"})),
    ("deepspeed_zero3.yaml", 2, {}, dict(strategy="deepspeed", env={
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "1",
        "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "1", "ACCELERATE_GRADIENT_CLIPPING": "0.5",
        "ANYACCEL_GRADIENT_ACCUMULATION_STEPS": "4", "ANYACCEL_MIXED_PRECISION": "bf16"})),
    ("deepspeed_machines.yaml", 8, {}, dict(strategy="deepspeed", num_processes=16, num_machines=2, machine_rank=1)),
    ("cpu2_fp8.yaml", 0, {}, dict(device="cpu", num_processes=2, mixed_precision="fp8", env={
        "ANYACCEL_MIXED_PRECISION": "fp8", "ACCELERATE_FP8_BACKEND": "AO", "ACCELERATE_FP8_PAD_INNER_DIM": "1",
        "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER": "1"})),
    ("fsdp2_fp8.yaml", 2, {}, dict(strategy="fsdp", mixed_precision="fp8", env={
        "ACCELERATE_FP8_BACKEND": "AO", "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER": "0"})),
    ("gpu_fp8_te.yaml", 2, {}, dict(device="gpu", mixed_precision="fp8", env={
        "ACCELERATE_FP8_BACKEND": "TE", "ACCELERATE_FP8_FORMAT": "E4M3", "ACCELERATE_FP8_MARGIN": "2",
        "ACCELERATE_FP8_AMAX_HISTORY_LEN": "1024", "ACCELERATE_FP8_AMAX_COMPUTE_ALGO": "most_recent",
        "ANYACCEL_FP8_OVERRIDE_LINEAR_PRECISION": "true,false,true"})),
]


@pytest.mark.parametrize("name, gpus, flags, expect", LAUNCHED)
def test_files_written_by_accelerate_config_launch_with_the_same_meaning(name, gpus, flags, expect):
    plan, notes = _plan(name, gpus, **flags)
    expect = dict(expect)
    env, note = expect.pop("env", {}), expect.pop("note", None)
    assert {k: getattr(plan, k) for k in expect} == expect
    assert {k: plan.env_dict().get(k) for k in env} == env
    if note:
        assert any(note in n for n in notes), notes


def test_the_tpu_file_asks_for_xla_replicas_on_the_tpu_cores():
    values = read_config(FILES / "xla.yaml")
    assert (values["device"], values["num_processes"], values.get("strategy")) == ("tpu", 8, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(FILES / "xla.yaml")
    assert (cfg.device, cfg.num_processes, cfg.mixed_precision) == ("tpu", 8, "no")


#: files whose one feature that is on cannot be honoured, and the words naming it
REFUSED = [
    ("cpu_mpirun.yaml", "mpirun_config (anyaccel launch starts its processes itself, not with mpirun"),
    ("gpu_numa.yaml", "enable_cpu_affinity: True (anyaccel does not pin processes to NUMA nodes)"),
    ("xla_pod.yaml", "tpu_use_cluster: True (anyaccel launch runs on the machine it is started on"),
    ("megatron.yaml", "distributed_type: MEGATRON_LM (no Megatron-LM"),
    ("fsdp1_local_state.yaml", "fsdp_config.fsdp_state_dict_type: LOCAL_STATE_DICT (FSDP2 has no local state dict"),
    ("deepspeed_pdsh.yaml", "deepspeed_config.deepspeed_multinode_launcher has the value 'pdsh'"),
]


@pytest.mark.parametrize("name, words", REFUSED)
def test_a_feature_that_is_on_and_cannot_be_honoured_stops_the_launch_in_one_line(name, words):
    path = FILES / name
    with pytest.raises(ConfigError) as info:
        load_config(path)
    line = str(info.value)
    assert "\n" not in line and words in line, line
    assert f"run `anyaccel config --from-accelerate {path}`" in line
    assert line.count("(") - line.count("(pdsh") <= 3  # the one feature (and its reason), nothing else listed
    with pytest.warns(ConfigWarning, match="left out, anyaccel cannot honour them"):
        from_accelerate(path)


#: sections older Accelerate versions wrote, with their feature off: accepted without a word
OFF_SECTIONS = [
    {"ipex_config": {"ipex": False}},
    {"mpirun_config": {}},
    {"mpirun_config": {"mpirun_hostfile": None, "mpirun_ccl": 1}},
    {"dynamo_config": {"dynamo_backend": "NO"}},
    {"dynamo_backend": "NO"},  # Accelerate before 0.18
    {"fsdp_config": {}, "deepspeed_config": {}, "megatron_lm_config": {}, "fp8_config": {}, "parallelism_config": {}},
    {"debug": True, "same_network": False, "tpu_name": "ignored", "tpu_env": [""], "tpu_vm": [""]},
]


@pytest.mark.parametrize("extra", OFF_SECTIONS)
def test_sections_describing_features_that_are_off_are_accepted_silently(tmp_path, extra):
    data = yaml.safe_load((FILES / "cpu2_bf16.yaml").read_text())
    data.update(extra)
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(path)
    assert (cfg.device, cfg.num_processes, cfg.mixed_precision, cfg.strategy, cfg.dynamo_backend) == \
        ("cpu", 2, "bf16", "auto", "no")


@pytest.mark.parametrize("extra, words", [
    ({"ipex_config": {"ipex": True}}, "ipex_config (anyaccel does not apply intel_extension_for_pytorch)"),
    ({"dynamo_config": {"dynamo_backend": "INDUCTOR", "dynamo_use_regional_compilation": True}},
     "dynamo_config.dynamo_use_regional_compilation: True"),
])
def test_features_older_or_other_files_turn_on_are_refused(tmp_path, extra, words):
    data = yaml.safe_load((FILES / "cpu2.yaml").read_text())
    data.update(extra)
    path = tmp_path / "on.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="--from-accelerate") as info:
        load_config(path)
    assert words in str(info.value)


def test_an_fp8_section_means_fp8_only_under_mixed_precision_fp8(tmp_path):
    """fp8_config is read with its meaning under mixed_precision fp8 and, as Accelerate does,
    ignored (silently) under another precision."""
    data = yaml.safe_load((FILES / "cpu2.yaml").read_text())
    data.update(mixed_precision="fp8", fp8_config={"backend": "AO", "enable_fsdp_float8_all_gather": False})
    path = tmp_path / "fp8.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    assert cfg.mixed_precision == "fp8" and cfg.fp8_config["enable_fsdp_float8_all_gather"] is False
    data.update(mixed_precision="bf16")
    path.write_text(yaml.safe_dump(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(path)
    assert cfg.mixed_precision == "bf16" and not cfg.fp8_config


def test_the_fp8_files_accelerate_writes_give_the_workers_their_fp8_settings():
    """What a plain Accelerator(mixed_precision from the file) builds in a worker of each fp8 file:
    torchao with Accelerate's defaults, torchao without the fp8 all-gather, Transformer Engine's
    recipe fields (its amax keys honoured, though Accelerate's own launcher exports them under names
    its handler does not read)."""
    from anyaccel import envvars
    from anyaccel.compat.arguments import resolve_options

    def fp8(name, gpus):
        return resolve_options(envvars.worker_settings(_plan(name, gpus)[0].env_dict())).fp8

    ao = fp8("cpu2_fp8.yaml", 0)
    assert (ao.backend, ao.pad_inner_dim, ao.fsdp_float8_all_gather, ao.recipe, ao.te) == ("AO", True, True, None, {})
    assert fp8("fsdp2_fp8.yaml", 2).fsdp_float8_all_gather is False
    te = fp8("gpu_fp8_te.yaml", 2)
    assert te.backend == "TE" and te.te == {"margin": 2, "interval": 1, "fp8_format": "E4M3", "amax_history_len": 1024,
                                            "amax_compute_algo": "most_recent", "use_autocast_during_eval": False,
                                            "override_linear_precision": (True, False, True)}


def test_old_spellings_keep_their_meaning(tmp_path):
    """Accelerate before 0.18 wrote `fp16: true` and a top-level `dynamo_backend`."""
    path = tmp_path / "old.yaml"
    path.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\nfp16: true\ndynamo_backend: INDUCTOR\n")
    cfg = load_config(path)
    assert (cfg.mixed_precision, cfg.dynamo_backend) == ("fp16", "inductor")


def _write(tmp_path, base, **changes):
    data = yaml.safe_load((FILES / base).read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path = tmp_path / "acc.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _refusal(path):
    with pytest.raises(ConfigError) as info:
        load_config(path)
    line = str(info.value)
    assert "\n" not in line and f"run `anyaccel config --from-accelerate {path}`" in line, line
    return line


#: what Accelerate 1.15's SageMakerConfig(...).to_yaml_file writes (ec2_instance_type, iam_role_name given)
SAGEMAKER = """base_job_name: accelerate-sagemaker-1
compute_environment: AMAZON_SAGEMAKER
debug: false
distributed_type: DATA_PARALLEL
dynamo_config:
  dynamo_backend: INDUCTOR
ec2_instance_type: ml.p3.16xlarge
enable_cpu_affinity: false
gpu_ids: all
iam_role_name: role
image_uri: null
mixed_precision: bf16
num_machines: 2
profile: default
py_version: py38
pytorch_version: 1.10.2
region: us-east-1
sagemaker_inputs_file: inputs.tsv
sagemaker_metrics_file: metrics.tsv
transformers_version: 4.17.0
use_cpu: false
"""


def test_a_sagemaker_file_is_one_clause_at_launch_and_in_the_conversion(tmp_path):
    """A SageMaker file (its own keys: ec2_instance_type, iam_role_name, region, ...) is refused
    with the one documented clause, not as unknown keys; the conversion leaves it out with a warning."""
    path = tmp_path / "sm.yaml"
    path.write_text(SAGEMAKER)
    line = _refusal(path)
    assert "compute_environment: AMAZON_SAGEMAKER (anyaccel does not launch on Amazon SageMaker" in line
    assert line.count("(") == 1 and "unknown" not in line and "DATA_PARALLEL" not in line, line
    with pytest.warns(ConfigWarning, match="AMAZON_SAGEMAKER"):
        cfg = from_accelerate(path)
    assert (cfg.mixed_precision, cfg.dynamo_backend) == ("bf16", "inductor")


@pytest.mark.parametrize("backend", ["ONNXRT", "TVM", "TENSORRT", "HPU_BACKEND", "NEURON"])
def test_a_compile_backend_the_launcher_lacks_is_one_clause_and_the_conversion_drops_it(tmp_path, backend):
    path = _write(tmp_path, "cpu_dynamo.yaml", dynamo_config={"dynamo_backend": backend, "dynamo_mode": "default"})
    line = _refusal(path)
    assert f"dynamo_config.dynamo_backend: {backend} (anyaccel launch compiles with inductor, eager" in line, line
    assert f'Accelerator(dynamo_backend="{backend.lower()}")' in line and line.count(" (") == 1, line
    with pytest.warns(ConfigWarning, match=backend):
        cfg = from_accelerate(path)
    assert (cfg.num_processes, cfg.dynamo_backend) == (2, "no")


@pytest.mark.parametrize("number, expect", [(1, dict(strategy="fsdp", reshard=True)),
                                            (2, dict(strategy="fsdp", reshard=False)),
                                            (3, dict(strategy="ddp")), ("3", dict(strategy="ddp")),
                                            (4, dict(strategy="fsdp", reshard=True))])
@pytest.mark.parametrize("key", ["fsdp_sharding_strategy", "fsdp_reshard_after_forward"])
def test_fsdp1_sharding_strategies_by_number_as_accelerate_reads_them(tmp_path, number, expect, key):
    """Older files wrote FSDP1's ShardingStrategy numbers (1 FULL_SHARD ... 5 HYBRID_SHARD_ZERO2)."""
    data = yaml.safe_load((FILES / "fsdp1_no_shard.yaml").read_text())
    del data["fsdp_config"]["fsdp_reshard_after_forward"]
    data["fsdp_config"][key] = number
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data))
    values = read_config(path)
    assert values["strategy"] == expect["strategy"]
    if "reshard" in expect:
        assert values["fsdp_config"].get("reshard_after_forward", True) is expect["reshard"]


def test_rendezvous_backends_are_read_as_accelerate_passes_them_to_torchrun(tmp_path):
    values = read_config(_write(tmp_path, "gpu_machines.yaml", rdzv_backend="C10D"))
    assert values["rdzv_backend"] == "c10d"
    path = _write(tmp_path, "gpu_machines.yaml", rdzv_backend="etcd")
    line = _refusal(path)
    assert "rdzv_backend: etcd (anyaccel launch meets the other machines with static or c10d" in line, line
    assert line.count(" (") == 1, line
    with pytest.warns(ConfigWarning, match="etcd"):
        cfg = from_accelerate(path)
    assert cfg.rdzv_backend == "static"


@pytest.mark.parametrize("extra", [
    {"fp8_config": {"backend": "TE", "fp8_format": "HYBRID"}},  # mixed_precision bf16: Accelerate ignores it
    {"megatron_lm_config": {"megatron_lm_tp_degree": 2}},  # distributed_type MULTI_CPU: Accelerate ignores it
])
def test_sections_of_features_another_key_turns_off_are_accepted_silently(tmp_path, extra):
    path = _write(tmp_path, "cpu2_bf16.yaml", **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(path)
    assert (cfg.device, cfg.num_processes, cfg.mixed_precision) == ("cpu", 2, "bf16")


def _no_shard(tmp_path, **fsdp):
    data = yaml.safe_load((FILES / "fsdp1_no_shard.yaml").read_text())
    data["fsdp_config"].update(fsdp)
    path = tmp_path / "no_shard.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_no_shard_runs_as_ddp_with_one_note_and_its_settings_checked(tmp_path):
    plan, notes = _plan("fsdp1_no_shard.yaml", 2)
    assert plan.strategy == "ddp"
    assert any("NO_SHARD runs as DDP" in n for n in notes)
    assert not any("runs as FSDP2" in n or "prefetching" in n for n in notes), notes
    with pytest.raises(ConfigError, match="unknown FSDP setting .auto_wrap_polcy"):
        load_config(_no_shard(tmp_path, fsdp_auto_wrap_polcy="NO_WRAP"))  # a typo is not dropped with the rest


@pytest.mark.parametrize("key, words", [
    ("fsdp_activation_checkpointing", "fsdp_config.fsdp_activation_checkpointing: true under NO_SHARD (NO_SHARD runs "
                                      "as DDP, which does not recompute activations"),
    ("fsdp_offload_params", "fsdp_config.fsdp_offload_params: true under NO_SHARD (NO_SHARD runs as DDP, which keeps "
                            "parameters on the device"),
])
def test_no_shard_refuses_what_ddp_cannot_do_one_clause_each(tmp_path, key, words):
    line = _refusal(_no_shard(tmp_path, **{key: True}))
    assert words in line and line.count(" (") == 1, line
    line = _refusal(_no_shard(tmp_path, fsdp_activation_checkpointing=True, fsdp_offload_params=True))
    assert line.count("under NO_SHARD") == 2, line
