"""What `anyaccel launch` decides before starting anything (pure plan resolution, bad input).

No process is spawned here: `resolve_plan` is a pure function of flags, config file, environment
variables and the number of visible GPUs, and bad command lines fail before anything starts.
"""

import re
import subprocess
import sys

import pytest

from anyaccel import cli
from anyaccel.config.schema import Config
from anyaccel.launch.plan import LaunchRequest, PlanError, resolve_plan
from anyaccel.strategies.options import ParallelismConfig

from conftest import SCRIPTS, clean_env

SCRIPT = str(SCRIPTS / "launch_train.py")


def plan(config=None, env=None, gpus=0, **flags):
    return resolve_plan(LaunchRequest.of(SCRIPT, **flags), config, env or {}, gpus)


# ---- defaults --------------------------------------------------------------------------------


def test_cpu_only_machine_defaults_to_one_process():
    p = plan()
    assert (p.num_processes, p.nproc_per_node, p.device, p.mode) == (1, 1, "cpu", "agent")
    assert "ANYACCEL_USE_CPU" not in p.env_dict()  # auto: one process may still pick Apple MPS


def test_num_processes_on_a_cpu_only_machine_gives_real_cpu_ranks():
    p = plan(num_processes=2)
    assert (p.num_processes, p.nproc_per_node, p.device) == (2, 2, "cpu")
    assert p.env_dict()["OMP_NUM_THREADS"] == "1"  # as torchrun: processes must not oversubscribe


def test_one_process_per_visible_gpu_by_default():
    p = plan(gpus=4)
    assert (p.num_processes, p.nproc_per_node, p.device) == (4, 4, "gpu")
    assert "ANYACCEL_USE_CPU" not in p.env_dict()


def test_gpu_ids_narrow_the_gpus_and_set_cuda_visible_devices():
    p = plan(gpus=4, gpu_ids="1,3")
    assert p.num_processes == 2 and p.env_dict()["CUDA_VISIBLE_DEVICES"] == "1,3"
    with pytest.raises(PlanError, match="names GPU 7, but this machine has 4 GPU"):
        plan(gpus=4, gpu_ids="0,7")


def test_cpu_flag_wins_over_visible_gpus():
    p = plan(gpus=4, cpu=True, num_processes=3)
    assert (p.device, p.num_processes) == ("cpu", 3)
    assert p.env_dict()["ANYACCEL_USE_CPU"] == "1"


def test_single_machine_rendezvous_is_loopback_on_a_free_port():
    p = plan(num_processes=2, main_process_ip="10.0.0.5")
    assert p.main_process_ip == "127.0.0.1" and p.main_process_port is None  # the runner binds a free port
    assert any("ignored on one machine" in n for n in p.notes)
    assert plan(main_process_port=29999).main_process_port == 29999


def test_script_arguments_are_kept_untouched():
    args = ("--num_processes", "7", "--", "-m", "x y")
    p = plan(script_args=args)
    assert p.script_args == args and p.num_processes == 1


def test_launcher_settings_reach_workers_as_a_few_variables():
    p = plan(num_processes=2, mixed_precision="bf16", gradient_accumulation_steps=4, debug=True)
    assert p.env_dict() == {
        "ANYACCEL_MIXED_PRECISION": "bf16",
        "ANYACCEL_GRADIENT_ACCUMULATION_STEPS": "4",
        "ANYACCEL_DEBUG": "1",
        "OMP_NUM_THREADS": "1",
    }
    assert plan(num_processes=2, env={"OMP_NUM_THREADS": "3"}).env_dict().get("OMP_NUM_THREADS") is None
    assert plan(num_processes=2, num_cpu_threads_per_process=2).env_dict()["OMP_NUM_THREADS"] == "2"


# ---- precedence: flag > config file > detected default ----------------------------------------


def test_config_file_beats_detected_default_and_flag_beats_config_file():
    cfg = Config(device="cpu", num_processes=3, mixed_precision="bf16", max_restarts=2)
    p = plan(config=cfg, gpus=8)
    assert (p.device, p.num_processes, p.mixed_precision, p.max_restarts) == ("cpu", 3, "bf16", 2)
    assert p.source("num_processes") == "config file"
    p = plan(config=cfg, gpus=8, num_processes=2, mixed_precision="no", max_restarts=0)
    assert (p.num_processes, p.mixed_precision, p.max_restarts) == (2, "no", 0)
    assert p.source("num_processes") == "flag" and p.source("device") == "config file"
    assert plan(gpus=8).source("num_processes") == "default"


def test_config_file_on_disk_is_read_by_the_cli(tmp_path, monkeypatch):
    from anyaccel.launch import command

    path = tmp_path / "c.yaml"
    path.write_text("device: cpu\nnum_processes: 3\nmixed_precision: bf16\n")
    config, where, notes = command.load_config_for(str(path))
    p = resolve_plan(LaunchRequest.of(SCRIPT, num_processes=2), config, {}, 0, where, notes=notes)
    assert (p.num_processes, p.mixed_precision, p.config_path) == (2, "bf16", str(path))


def test_help_documents_the_precedence(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["launch", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "a flag given here > the configuration file" in text
    assert "--num_processes" in text and "--main_process_ip" in text and "-m" in text


# ---- several machines ----------------------------------------------------------------------


def test_several_machines_split_the_total_and_use_the_main_address():
    p = plan(num_processes=8, num_machines=2, machine_rank=1, main_process_ip="10.1.1.1", main_process_port=1234)
    assert (p.nproc_per_node, p.machine_rank, p.main_process_ip, p.main_process_port) == (4, 1, "10.1.1.1", 1234)
    assert plan(num_machines=2, main_process_ip="h").main_process_port == 29500


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(num_machines=2), "main_process_ip"),
        (dict(num_machines=2, machine_rank=2, main_process_ip="h"), "machine_rank"),
        (dict(num_machines=2, num_processes=3, main_process_ip="h"), "multiple of 2"),
        (dict(num_machines=2, main_process_ip="h", max_restarts=1), "--rdzv_backend c10d"),
    ],
)
def test_impossible_multi_machine_requests_are_refused(flags, message):
    with pytest.raises(PlanError, match=message):
        plan(**flags)


def test_no_gpu_but_config_says_gpu():
    with pytest.raises(PlanError, match="no CUDA GPU is visible"):
        plan(config=Config(device="gpu"))


# ---- SLURM ---------------------------------------------------------------------------------


def slurm(ntasks, nnodes, procid=0, nodeid=0, step=True, **extra):
    env = {
        "SLURM_JOB_ID": "4242", "SLURM_NTASKS": str(ntasks), "SLURM_NNODES": str(nnodes),
        "SLURM_PROCID": str(procid), "SLURM_LOCALID": "0", "SLURM_NODEID": str(nodeid),
        "SLURM_NODELIST": "gpu[07-08]" if nnodes == 2 else "gpu07",
    }  # fmt: skip
    if step:
        env.update(SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS=str(ntasks), SLURM_STEP_NUM_NODES=str(nnodes))
    env.update(extra)
    return env


def test_srun_with_several_tasks_per_node_runs_the_script_in_each_task():
    p = plan(env=slurm(4, 1, procid=2))
    assert (p.mode, p.num_processes, p.nproc_per_node) == ("in_process", 4, 1)
    with pytest.raises(PlanError, match="srun started 4 tasks"):
        plan(env=slurm(4, 1), num_processes=2)
    p = plan(env=slurm(4, 1), config=Config(num_processes=2))  # a workstation config file: SLURM wins, with a note
    assert p.num_processes == 4 and any("ignored" in n for n in p.notes)


def test_srun_with_one_task_per_node_makes_each_task_the_node_agent():
    p = plan(env=slurm(2, 2, procid=1, nodeid=1), num_processes=4, cpu=True)
    assert (p.mode, p.num_machines, p.machine_rank, p.nproc_per_node) == ("agent", 2, 1, 2)
    assert (p.main_process_ip, p.main_process_port) == ("gpu07", 15000 + 4242)
    with pytest.raises(PlanError, match="--num_machines 3"):
        plan(env=slurm(2, 2), num_machines=3)


def test_srun_with_uneven_tasks_per_node_runs_every_task():
    # srun -N2 -n3: 2 tasks on the first node, 1 on the second (plain `srun python` handles it too)
    p = plan(env=slurm(3, 2, procid=2, nodeid=1, SLURM_STEP_TASKS_PER_NODE="2,1"))
    assert (p.mode, p.num_processes, p.num_machines, p.machine_rank, p.nproc_per_node) == ("in_process", 3, 2, 1, 1)


def test_run_id_is_the_same_on_every_machine():
    # srun set the machines: every agent is in the same job, whose id keeps jobs apart
    assert plan(env=slurm(2, 2, procid=1, nodeid=1), num_processes=4, cpu=True).run_id == "anyaccel-4242"
    # machines given by hand, each from a shell inside a SLURM job of its own: the job ids differ
    by_hand = dict(num_machines=2, main_process_ip="10.0.0.1", cpu=True)
    ids = {plan(env=slurm(1, 1, SLURM_JOB_ID=job), machine_rank=rank, **by_hand).run_id
           for job, rank in (("123", 0), ("124", 1))}
    assert ids == {"anyaccel"}


def test_batch_script_without_srun_never_waits_for_machines_that_will_not_come():
    env = slurm(2, 2, step=False)
    p = plan(env=env)
    assert p.num_machines == 1 and any("not by srun" in n for n in p.notes)
    with pytest.raises(PlanError, match="not by srun"):
        plan(env=env, num_machines=2, main_process_ip="gpu07")
    assert plan(env={**env, "ANYACCEL_DISABLE_SLURM": "1"}).notes == ("running 1 CPU process; pass --num_processes N for N CPU processes.",)


# ---- bad input on the real command line: one paragraph, non-zero, no traceback -------------


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["launch", "no_such_script.py"], "script 'no_such_script.py' does not exist"),
        (["launch", "--num_processes", "0", SCRIPT], "--num_processes/--num-processes: invalid value 0; allowed: an integer >= 1"),
        (["launch", "--num_processes", "two", SCRIPT], "invalid value 'two'; allowed: an integer >= 1"),
        (["launch", "--bogus", SCRIPT], "unrecognized arguments: --bogus"),
        (["launch"], "no SCRIPT given"),
        (["launch", "-m"], "no MODULE after -m given"),
        (["launch", "-m", "no_such_module_xyz"], "no module named 'no_such_module_xyz'"),
        (["launch", "--num_machines", "2", SCRIPT], "main_process_ip"),
        (["launch", "--main_process_port", "70000", SCRIPT], "an integer from 1 to 65535"),
        (["launch", "--mixed_precision", "fp4", SCRIPT], "invalid value 'fp4'; allowed: one of no, fp16, bf16, fp8"),
        (["launch", "--mixed_precision", "bf61", SCRIPT], "(did you mean 'bf16'?)"),
    ],
)
def test_bad_input_is_one_paragraph_and_a_nonzero_exit(argv, expected, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert expected in err, err
    assert "Traceback" not in err


def test_bad_input_through_the_installed_command():
    proc = subprocess.run(
        [sys.executable, "-m", "anyaccel.cli", "launch", "--num_processes", "0", "train.py"],
        capture_output=True, text=True, env=clean_env(), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--num-processes: invalid value 0; allowed: an integer >= 1" in proc.stderr


def test_busy_port_is_a_clear_error_before_anything_starts(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        code = cli.main(["launch", "--cpu", "--num_processes", "2", "--main_process_port", str(port), SCRIPT])
    err = capsys.readouterr().err
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err


# ---- anyaccel env --------------------------------------------------------------------------


def test_env_report_has_versions_devices_environment_and_config(tmp_path, capsys, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("num_processes: 2\nmixed_precision: bf16\n")
    monkeypatch.setenv("ANYACCEL_CONFIG_FILE", str(path))
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    import torch

    for expected in ("anyaccel version: 0.1.0", f"PyTorch version: {torch.__version__}", "Python version",
                     "GPUs:", "Detected environment: source=single world_size=1", f"Config file: {path}",
                     "mixed_precision=bf16"):  # fmt: skip
        assert expected in out, out


# ---- sharding and compilation ----------------------------------------------------------------


def test_fsdp_and_compile_reach_the_workers_from_the_config_file_or_flags():
    cfg = Config(strategy="fsdp", fsdp_config={"transformer_cls_names_to_wrap": ["Block"]}, dynamo_backend="inductor")
    env = plan(config=cfg, num_processes=2).env_dict()
    assert env["ANYACCEL_STRATEGY"] == "fsdp" and env["ANYACCEL_DYNAMO_BACKEND"] == "inductor"
    assert env["ANYACCEL_FSDP_CONFIG"] == '{"transformer_cls_names_to_wrap": ["Block"]}'
    # a flag overrides one FSDP setting and keeps the file's others
    env = plan(config=cfg, num_processes=2, fsdp_activation_checkpointing=True).env_dict()
    assert env["ANYACCEL_FSDP_CONFIG"] == ('{"fsdp_activation_checkpointing": true, '
                                           '"transformer_cls_names_to_wrap": ["Block"]}')
    # --fsdp_* flags alone ask for FSDP; --strategy ddp with an fsdp_config is a contradiction
    assert plan(num_processes=2, fsdp_min_num_params=1000).strategy == "fsdp"
    with pytest.raises(PlanError, match="fsdp_config' is set but strategy is ddp"):
        plan(config=cfg, num_processes=2, strategy="ddp")
    assert "ANYACCEL_STRATEGY" not in plan(num_processes=2).env_dict()  # auto: decided by the Accelerator


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--monitor_interval", "0", "invalid value 0.0; allowed: a number of seconds > 0"),
        ("--preemption_grace", "inf", "invalid value inf; allowed: a number of seconds > 0"),
        ("--hang_timeout", "-1", "invalid value -1.0; allowed: a number of seconds >= 0 (0 turns the reports off)"),
        ("--hang_timeout", "nan", "invalid value nan; allowed: a number of seconds >= 0"),
        ("--hang_timeout", "soon", "invalid value 'soon'; allowed: a number of seconds >= 0"),
    ],
)
def test_seconds_flags_name_the_value_and_the_rule(flag, value, message, capsys):
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["launch", flag, value, "train.py"])
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and message in err, err


def test_seconds_flags_take_finite_values_and_zero_where_zero_turns_it_off():
    args = cli.build_parser().parse_args(["launch", "--hang_timeout", "0", "--monitor_interval", "0.5",
                                          "--preemption_grace", "90", "train.py"])
    assert (args.hang_timeout, args.monitor_interval, args.preemption_grace) == (0.0, 0.5, 90.0)


# ---- bad input stops (issue 29): one line, exit 2, no traceback, nothing runs ------------------------


def test_a_typod_launch_flag_prints_launchs_usage_and_the_flag_it_meant(capsys):
    code = None
    try:
        code = cli.main(["launch", "--num_proceses", "2", "--cpu", SCRIPT])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.startswith("usage: anyaccel launch [options] SCRIPT")  # launch's usage, not the top-level one
    assert "unrecognized arguments: --num_proceses (did you mean --num_processes?)" in err


def test_multi_gpu_without_gpus_stops_and_says_to_pass_cpu(capsys):
    with pytest.raises(PlanError, match=r"--multi_gpu asks for one process per GPU, but no CUDA GPU is visible .*"
                                        r"Pass --cpu"):
        resolve_plan(LaunchRequest.of(SCRIPT, multi_gpu=True, num_processes=2), None, {}, 0)
    assert resolve_plan(LaunchRequest.of(SCRIPT, multi_gpu=True), None, {}, 2).num_processes == 2  # GPUs: as before
    assert resolve_plan(LaunchRequest.of(SCRIPT, multi_gpu=True, cpu=True, num_processes=2), None, {}, 0).device == "cpu"
    assert cli.main(["launch", "--multi_gpu", "--num_processes", "2", SCRIPT]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Pass --cpu" in err and "Traceback" not in err


def test_estimate_memory_imports_a_factory_from_the_working_directory(tmp_path):
    (tmp_path / "mymodels.py").write_text("import torch\n\ndef make():\n    return torch.nn.Linear(8, 4)\n")
    proc = subprocess.run([sys.executable, "-c", "import sys; from anyaccel.cli import main; sys.exit(main())",
                           "estimate-memory", "mymodels:make", "--num_processes", "2", "--json"],
                          capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert '"parameters": 36' in proc.stdout


# ---- the option table drives the launcher ------------------------------------------------------------


def test_pipeline_and_sequence_sizes_travel_from_flag_and_file_to_the_worker():
    """pp_size / sp_size were added as rows of the option table only: their flag, key and
    variable exist and carry the value (the nd strategy refuses > 1 until they land)."""
    cfg = Config(num_processes=4, parallelism_config={"parallelism_config_pp_size": 2, "dp_shard_size": 2})
    env = plan(config=cfg, num_processes=4).env_dict()
    assert (env["PARALLELISM_CONFIG_PP_SIZE"], env["PARALLELISM_CONFIG_SP_SIZE"], env["ANYACCEL_STRATEGY"]) == \
        ("2", "1", "nd")
    args = cli.build_parser().parse_args(["launch", "--cpu", "--num_processes", "4", "--parallelism_config_sp_size",
                                          "2", "--parallelism-config-dp-shard-size", "2", SCRIPT])
    from anyaccel.launch.command import request_from_args

    p = resolve_plan(request_from_args(args), None, {}, 0)
    assert (p.env_dict()["PARALLELISM_CONFIG_SP_SIZE"], p.strategy, p.source("parallelism_config")) == \
        ("2", "nd", "flag")


def test_pipeline_and_sequence_settings_travel_from_flag_and_file_to_the_parallelism_config():
    """Issue 31 item 1: pp_schedule, pp_microbatches, pp_stages_per_rank, pp_split_points and
    sp_backend are rows of the option table: a config key or a launch flag reaches the workers'
    ParallelismConfig, checked once with the table's words."""
    from anyaccel import envvars
    from anyaccel.config.schema import check_value
    from anyaccel.errors import ConfigError
    from anyaccel.launch.command import request_from_args
    from anyaccel.compat.arguments import resolve_options

    def config_of(env):
        return resolve_options(envvars.worker_settings(env)).strategy_options

    cfg = Config(num_processes=4, parallelism_config={
        "parallelism_config_pp_size": 2, "dp_shard_size": 2, "pp_schedule": "interleaved1f1b",
        "pp_stages_per_rank": 2, "parallelism_config_pp_split_points": ["layers.1", "layers.2", "layers.3"]})
    env = plan(config=cfg, num_processes=4).env_dict()
    assert (env["PARALLELISM_CONFIG_PP_SCHEDULE"], env["PARALLELISM_CONFIG_PP_SPLIT_POINTS"]) == \
        ("Interleaved1F1B", "layers.1,layers.2,layers.3")
    config = config_of(env)
    assert (config.pp_size, config.pp_schedule, config.pp_stages_per_rank, config.pp_split_points) == \
        (2, "Interleaved1F1B", 2, ("layers.1", "layers.2", "layers.3"))
    args = cli.build_parser().parse_args([
        "launch", "--cpu", "--num_processes", "2", "--parallelism_config_pp_size", "2", "--parallelism_config_pp_schedule",
        "gpipe", "--parallelism-config-pp-microbatches", "4", "--parallelism_config_pp_split_points", "0.3", SCRIPT])
    config = config_of(resolve_plan(request_from_args(args), None, {}, 0).env_dict())
    assert (config.pp_schedule, config.pp_microbatches, config.pp_stages_per_rank, config.pp_split_points) == \
        ("GPipe", 4, 1, ("0.3",))
    args = cli.build_parser().parse_args(["launch", "--cpu", "--num_processes", "2", "--parallelism_config_sp_size", "2",
                                          "--parallelism_config_sp_backend", "deepspeed", SCRIPT])
    assert config_of(resolve_plan(request_from_args(args), None, {}, 0).env_dict()).sp_backend == "deepspeed"
    refused = "has the value 'pipedream' (torch.distributed.pipelining's schedule names, any case); allowed: one of 1F1B"
    with pytest.raises(ConfigError, match=r"parallelism_config.parallelism_config_pp_schedule' " + re.escape(refused)):
        check_value("parallelism_config", {"pp_schedule": "pipedream"})
    with pytest.raises(ConfigError, match=r"^PARALLELISM_CONFIG_PP_SCHEDULE " + re.escape(refused)):
        envvars.worker_settings({"PARALLELISM_CONFIG_PP_SCHEDULE": "pipedream"})
    with pytest.raises(ConfigError, match=r"^ParallelismConfig.pp_schedule " + re.escape(refused)):
        ParallelismConfig(pp_schedule="pipedream")
    with pytest.raises(ConfigError, match=r"^PARALLELISM_CONFIG_PP_MICROBATCHES has the value 0; allowed: an integer >= 1$"):
        envvars.worker_settings({"PARALLELISM_CONFIG_PP_MICROBATCHES": "0"})


def test_every_flag_of_the_table_is_a_launch_flag_and_every_key_a_config_key():
    from anyaccel import optionspec
    from anyaccel.config.schema import Config as Schema

    parser = cli.build_parser()
    launch = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction)).choices["launch"]
    flags = {o for a in launch._actions for o in a.option_strings}
    for row in optionspec.options_with("flag"):
        assert set(optionspec.flag_names(row)) <= flags, row.name
    keys = {f for f in Schema().to_dict()}
    assert keys == {row.key for row in optionspec.options_with("key")}


def _launch_plan(*argv, config=None):
    from anyaccel.launch.command import request_from_args

    return resolve_plan(request_from_args(cli.build_parser().parse_args(["launch", *argv, SCRIPT])), config, {}, 0)


def test_deepspeed_flags_and_keys_reach_the_workers_as_accelerates_variables(tmp_path):
    """Accelerate's `--use_deepspeed --zero_stage ...` and `deepspeed_config:` keys become the
    ACCELERATE_* variables its DeepSpeedPlugin reads; a flag overrides one key of the file's section."""
    p = _launch_plan("--cpu", "--num_processes", "2", "--use_deepspeed", "--zero_stage", "3", "--offload_param_device",
                     "cpu", "--gradient_clipping", "1", "--zero3_save_16bit_model", "true")
    env = p.env_dict()
    assert p.strategy == "deepspeed" and env["ANYACCEL_STRATEGY"] == "deepspeed"
    assert (env["ACCELERATE_DEEPSPEED_ZERO_STAGE"], env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"],
            env["ACCELERATE_GRADIENT_CLIPPING"], env["ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"]) == \
        ("3", "cpu", "1.0", "1")
    assert _launch_plan("--cpu", "--use_deepspeed").env_dict()["ANYACCEL_STRATEGY"] == "deepspeed"  # defaults: 2
    cfg = {"deepspeed_config": {"zero_stage": 1, "offload_optimizer_device": "cpu"}, "gradient_accumulation_steps": 4}
    p = _launch_plan("--cpu", "--zero_stage", "2", config=cfg)  # a setting alone selects deepspeed, as a section does
    env = p.env_dict()
    assert (p.strategy, p.source("deepspeed_config"), env["ACCELERATE_DEEPSPEED_ZERO_STAGE"],
            env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"], env["ANYACCEL_GRADIENT_ACCUMULATION_STEPS"]) == \
        ("deepspeed", "flag", "2", "cpu", "4")
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 3}, "gradient_clipping": "auto"}')
    env = _launch_plan("--cpu", "--deepspeed_config_file", str(ds), "--gradient_clipping", "0.5").env_dict()
    assert (env["ACCELERATE_DEEPSPEED_CONFIG_FILE"], env["ACCELERATE_GRADIENT_CLIPPING"]) == (str(ds), "0.5")


@pytest.mark.parametrize("argv, message", [
    (["--zero_stage", "4"], "argument --zero_stage/--zero-stage: invalid value 4; allowed: an integer from 0 to 3"),
    (["--offload_param_device", "gpu"], "invalid value 'gpu'; allowed: one of none, cpu, nvme"),
    (["--offload_param_device", "cpu"], "offload_param.device='cpu' needs ZeRO stage 3; this config has stage 2"),
    (["--deepspeed_multinode_launcher", "pdsh"], "allowed: standard (torch's elastic agent, which anyaccel launch"),
    (["--deepspeed_config_file", "missing.json"], "'missing.json' (no such file); allowed: the path of an existing"),
    (["--use_deepspeed", "--strategy", "ddp"], "--use_deepspeed asks for the deepspeed strategy but --strategy is ddp"),
    (["--use_deepspeed", "--use_fsdp"], "--use_deepspeed and --use_fsdp ask for two strategies"),
    (["--zero_stage", "2", "--strategy", "fsdp"], "key 'deepspeed_config' is set but strategy is fsdp"),
])  # fmt: skip
def test_bad_deepspeed_launch_settings_stop_before_anything_starts(argv, message, capsys):
    try:
        code = cli.main(["launch", "--cpu", *argv, SCRIPT])
    except SystemExit as exc:  # argparse's own exit, for a flag's value
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_deepspeed_setting_the_config_file_sets_otherwise_is_refused(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 3}}')
    with pytest.raises(PlanError, match=r"zero_stage is 2 but the DeepSpeed config file .*ds.json sets "
                                        r"zero_optimization.stage to 3; set it in one place"):
        _launch_plan("--deepspeed_config_file", str(ds), "--zero_stage", "2", "--cpu")
