"""``anyaccel launch``: start a training script on every process of the job.

Parses the command line into a :class:`~anyaccel.launch.plan.LaunchRequest`, reads the
configuration file, resolves a :class:`~anyaccel.launch.plan.LaunchPlan` and hands it to
:func:`~anyaccel.launch.runner.run_plan` (torch's elastic agent). Bad input is reported as one
paragraph with exit status 2 before anything starts.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import List, Optional

from ..errors import CLIError
from ..strategies import StrategyChoices
from ..strategies.options import FSDPOptions, ParallelismConfig

__all__ = ["add_parser", "run", "request_from_args"]

_DESCRIPTION = """\
Start SCRIPT (or `-m MODULE`) once per process, on this machine or as one machine of several, with
torch's elastic agent (the engine of torchrun). Everything after SCRIPT is passed to it untouched.

Where each setting comes from, first match wins: a flag given here > the configuration file
(--config_file, else $ANYACCEL_CONFIG_FILE, else the file written by `anyaccel config`) > what is
detected: one process per visible GPU, or one CPU process on a machine without GPUs
(`--num_processes N` starts N CPU processes there).

One machine: the rendezvous listens on 127.0.0.1 only, on a free port unless --main_process_port
is given, so several jobs can share a machine. Several machines: run the same command on each with
--num_machines M --machine_rank R --main_process_ip HOST_OF_RANK_0 --main_process_port PORT.
Inside `srun`, SLURM supplies the machines, ranks and main address. When a process fails, every
other process is stopped and its error is printed once, labelled with its rank."""

_EPILOG = """\
examples:
  anyaccel launch train.py --lr 3e-4                 one process per GPU (one CPU process without GPUs)
  anyaccel launch --cpu --num_processes 4 train.py   four CPU processes
  anyaccel launch -m mypkg.train --epochs 2          run a module
  anyaccel launch --num_machines 2 --machine_rank 0 --main_process_ip 10.0.0.1 --main_process_port 29500 \\
      --num_processes 16 train.py                    machine 0 of 2 (run rank 1 on the other machine)"""


def _int_at_least(lo: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; expected {what}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{value} is too small; expected {what}")
        return value

    return parse


def _port(text: str) -> int:
    value = _int_at_least(1, "a port from 1 to 65535")(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is too large; expected a port from 1 to 65535")
    return value


def _seconds(text: str, allow_zero: bool) -> float:
    expected = "a number of seconds >= 0 (0 turns it off)" if allow_zero else "a number of seconds > 0"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; expected {expected}") from None
    if value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not finite; expected {expected}")
    if not (value >= 0 if allow_zero else value > 0):  # nan too
        raise argparse.ArgumentTypeError(f"{text} must be {expected}")
    return value


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    return _seconds(text, allow_zero=False)


def _non_negative_seconds(text: str) -> float:
    """argparse type: a finite number of seconds >= 0, where 0 turns the feature off."""
    return _seconds(text, allow_zero=True)


def _gpu_ids(text: str) -> str:
    from ..config.schema import ConfigError, check_value

    try:
        return check_value("gpu_ids", text)
    except ConfigError:
        raise argparse.ArgumentTypeError(f"{text!r} is not `all` or comma-separated GPU ids such as 0,1") from None


def _add(group, name: str, **kw) -> None:
    """Add ``--some_flag`` also as ``--some-flag``."""
    group.add_argument(name, *([name.replace("_", "-")] if "_" in name else []), **kw)


def _yes_no(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true/false")


# Accelerate's FSDP flags (names of the config file's fsdp_config keys, with the fsdp_ prefix).
_FSDP_FLAGS = (
    ("--fsdp_version", dict(type=int, choices=(2,), metavar="2", help="FSDP version (anyaccel implements FSDP2)")),
    ("--fsdp_auto_wrap_policy", dict(choices=("transformer_based_wrap", "size_based_wrap", "no_wrap"),
                                     type=str.lower, help="which blocks are sharded as their own unit")),
    ("--fsdp_transformer_layer_cls_to_wrap", dict(metavar="CLASSES", help="comma-separated class names to wrap")),
    ("--fsdp_min_num_params", dict(type=_int_at_least(1, "a parameter count >= 1"), metavar="N",
                                   help="size_based_wrap threshold")),
    ("--fsdp_reshard_after_forward", dict(type=_yes_no, metavar="BOOL", help="free gathered parameters after forward")),
    ("--fsdp_offload_params", dict(type=_yes_no, metavar="BOOL", help="keep shards in host memory (GPU only)")),
    ("--fsdp_activation_checkpointing", dict(type=_yes_no, metavar="BOOL", help="recompute activations of wrapped blocks")),
    ("--fsdp_state_dict_type", dict(choices=("SHARDED_STATE_DICT", "FULL_STATE_DICT"), type=str.upper,
                                    help="how save_state stores models (default SHARDED_STATE_DICT)")),
)


# Accelerate's N-D parallelism flags (the config file's parallelism_config keys)
_PARALLELISM_FLAGS = (
    ("--parallelism_config_dp_replicate_size", "model replicas (outermost mesh dimension, across machines)"),
    ("--parallelism_config_dp_shard_size", "processes each replica is sharded over (FSDP2)"),
    ("--parallelism_config_tp_size", "tensor-parallel processes (innermost mesh dimension, within a machine)"),
    ("--parallelism_config_cp_size", "context-parallel processes (needs CUDA SDPA; not available yet)"),
)


def add_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Register ``launch`` on the ``anyaccel`` sub-command parsers; it runs :func:`run`."""
    p = subparsers.add_parser(
        "launch",
        help="run a training script on every process (this machine, several machines, SLURM)",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="anyaccel launch [options] SCRIPT [script args...]\n       anyaccel launch [options] -m MODULE [module args...]",
    )

    g = p.add_argument_group("processes and machines")
    opt_g = functools.partial(_add, g)
    opt_g("--num_processes", type=_int_at_least(1, "the total number of processes over all machines, >= 1"),
          metavar="N", help="total processes over all machines (default: one per visible GPU, else 1)")
    opt_g("--num_machines", type=_int_at_least(1, "the number of machines, >= 1"), metavar="M",
          help="number of machines (default 1)")
    opt_g("--machine_rank", type=_int_at_least(0, "this machine's rank, 0 to num_machines-1"), metavar="R",
          help="rank of this machine, 0 on the main machine (default 0)")
    opt_g("--main_process_ip", metavar="HOST", help="address of machine 0 (several machines only)")
    opt_g("--main_process_port", type=_port, metavar="PORT",
          help="rendezvous port (default: a free port on one machine, 29500 on several)")
    opt_g("--rdzv_backend", choices=("static", "c10d"),
          help="rendezvous between machines: static (fixed machine ranks, default) or c10d")
    opt_g("--max_restarts", type=_int_at_least(0, "a count >= 0"), metavar="K",
          help="restart every process up to K times after a failure (default 0), as torchrun")
    opt_g("--monitor_interval", type=positive_seconds, metavar="SECONDS",
          help="how often the agent checks the processes (default 0.1)")
    opt_g("--num_cpu_threads_per_process", type=_int_at_least(1, "a thread count >= 1"), metavar="T",
          help="OMP_NUM_THREADS for each process (default: 1 when several processes share a machine)")

    h = p.add_argument_group("hardware and training")
    opt_h = functools.partial(_add, h)
    opt_h("--cpu", action="store_true", default=False, help="run on the CPU even when GPUs are visible")
    opt_h("--gpu_ids", type=_gpu_ids, metavar="IDS", help="GPUs to use on this machine: all, or ids such as 0,1")
    opt_h("--mixed_precision", type=str.lower, choices=("no", "fp16", "bf16"), help="mixed precision (default no)")
    opt_h("--gradient_accumulation_steps", type=_int_at_least(1, "a step count >= 1"), metavar="S",
          help="batches per optimizer step (default 1)")
    opt_h("--multi_gpu", action="store_true", help=argparse.SUPPRESS)  # Accelerate habit; multi-GPU is automatic

    s = p.add_argument_group("sharding (FSDP2) and compilation")
    opt_s = functools.partial(_add, s)
    opt_s("--strategy", type=str.lower, choices=StrategyChoices(), metavar="NAME",  # the strategy registry's
          help="how models are wrapped across processes: %(choices)s (default auto: DDP for several processes; "
               "strategies of other packages come from their anyaccel.strategies entry points)")
    opt_s("--use_fsdp", action="store_true", help="same as --strategy fsdp (Accelerate's flag)")
    for flag, kw in _FSDP_FLAGS:
        opt_s(flag, **kw)
    n = p.add_argument_group("N-D parallelism (ParallelismConfig; the sizes multiply to --num_processes)")
    opt_n = functools.partial(_add, n)
    opt_n("--use_parallelism_config", action="store_true",
          help="same as --strategy nd (Accelerate's flag); sizes not given are 1, all 1: plain replicas")
    for flag, text in _PARALLELISM_FLAGS:
        opt_n(flag, type=_int_at_least(1, "a number of processes >= 1"), metavar="N", help=text + " (default 1)")
    opt_s("--dynamo_backend", type=str.lower, choices=("no", "inductor", "eager", "aot_eager", "cudagraphs", "openxla"),
          help="torch.compile prepared models with this backend (default no)")
    opt_s("--dynamo_mode", choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
          help="torch.compile mode")

    r = p.add_argument_group("hangs and preemption")
    opt_r = functools.partial(_add, r)
    opt_r("--hang_timeout", type=_non_negative_seconds, metavar="SECONDS",
          help="a rank waiting this long in a collective prints where every rank is (default 300; 0: off)")
    opt_r("--preemption_signals", metavar="SIGNALS",
          help="signals that make every rank checkpoint at the next step and exit 75 (default SIGTERM,SIGUSR1; none)")
    opt_r("--preemption_grace", type=positive_seconds, metavar="SECONDS",
          help="how long the workers get to save that checkpoint before they are killed (default 120)")

    o = p.add_argument_group("other")
    opt_o = functools.partial(_add, o)
    opt_o("--config_file", metavar="PATH", help="configuration file to read (default: see above)")
    o.add_argument("--quiet", "-q", action="store_true", help="print nothing of the launcher's own but errors")
    opt_o("--debug", action="store_true", help="show the agent's log and Python tracebacks of the launcher")
    p.add_argument("-m", dest="module", action="store_true",
                   help="the first word after the options is a module name (as `python -m`), not a script")
    p.add_argument("script_and_args", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS...]", help=argparse.SUPPRESS)
    p.set_defaults(func=run)
    return p


def request_from_args(args: argparse.Namespace):
    """The :class:`LaunchRequest` of a parsed command line; raises :class:`CLIError` for a missing
    or nonexistent script."""
    from .plan import LaunchRequest

    command: List[str] = list(args.script_and_args or [])
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        what = "MODULE after -m" if args.module else "SCRIPT"
        raise CLIError(
            f"no {what} given. Usage: `anyaccel launch [options] train.py [script args]` or "
            "`anyaccel launch [options] -m package.module [args]`; see `anyaccel launch --help`."
        )
    target, rest = command[0], tuple(command[1:])
    if args.module:
        _check_module(target)
    else:
        if target.startswith("-"):
            raise CLIError(f"unrecognized option {target!r} before the script; see `anyaccel launch --help`.")
        if not os.path.isfile(target):
            problem = "is a directory, not a Python file" if os.path.isdir(target) else "does not exist"
            raise CLIError(
                f"script {target!r} {problem} (looked relative to {os.getcwd()}). Give the path of the "
                "training script, or `-m package.module` to run a module."
            )
    return LaunchRequest(
        target=target,
        is_module=bool(args.module),
        script_args=rest,
        num_processes=args.num_processes,
        num_machines=args.num_machines,
        machine_rank=args.machine_rank,
        main_process_ip=args.main_process_ip,
        main_process_port=args.main_process_port,
        mixed_precision=args.mixed_precision,
        cpu=bool(args.cpu),
        gpu_ids=args.gpu_ids,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        rdzv_backend=args.rdzv_backend,
        num_cpu_threads_per_process=args.num_cpu_threads_per_process,
        strategy=_strategy_flag(args),
        fsdp_options=tuple((flag[2:], getattr(args, flag[2:])) for flag, _ in _FSDP_FLAGS
                           if getattr(args, flag[2:]) is not None),
        parallelism_options=tuple((flag[2:], getattr(args, flag[2:])) for flag, _ in _PARALLELISM_FLAGS
                                  if getattr(args, flag[2:]) is not None),
        dynamo_backend=args.dynamo_backend,
        dynamo_mode=args.dynamo_mode,
        hang_timeout=args.hang_timeout,
        preemption_signals=args.preemption_signals,
        preemption_grace=args.preemption_grace,
        debug=bool(args.debug),
        quiet=bool(args.quiet),
    )


def _strategy_flag(args: argparse.Namespace) -> Optional[str]:
    """``--strategy``, else what Accelerate's ``--use_parallelism_config`` (``nd``; Accelerate
    requires ``--use_fsdp`` next to it: FSDP2 shards nd's data-parallel dimensions) or
    ``--use_fsdp`` alone mean; a size flag (``--parallelism_config_*_size``) counts as
    ``--use_parallelism_config``. Raises CLIError for ``--use_parallelism_config`` next to another
    ``--strategy`` (one of the two would be ignored)."""
    sizes = any(getattr(args, flag.lstrip("-"), None) is not None for flag, _ in _PARALLELISM_FLAGS)
    if args.strategy is not None:
        if args.use_parallelism_config and args.strategy != ParallelismConfig.strategy:
            raise CLIError(f"--use_parallelism_config asks for the {ParallelismConfig.strategy} strategy but --strategy "
                           f"is {args.strategy}: give one of them")
        return args.strategy
    if args.use_parallelism_config or (sizes and args.use_fsdp):
        return ParallelismConfig.strategy
    return FSDPOptions.strategy if args.use_fsdp else None


def _check_module(name: str) -> None:
    import importlib.util

    top = name.split(".")[0]
    if not top.isidentifier() or not all(part.isidentifier() for part in name.split(".")):
        raise CLIError(f"{name!r} is not a module name such as package.module (for a file, leave out -m).")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise CLIError(
            f"no module named {top!r} (from -m {name}) can be imported here (working directory {os.getcwd()}). "
            "Install the package, run from its parent folder, or add it to PYTHONPATH."
        )


def load_config_for(explicit: Optional[str]):
    """The configuration in effect and its path (``(None, None)`` when there is no file).
    Warnings about the file are printed as one line each."""
    import warnings

    from ..config.file import find_config_file, load_config
    from ..config.schema import ConfigWarning

    path = find_config_file(explicit)
    if path is None:
        return None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        config = load_config(path)
    for w in caught:
        if issubclass(w.category, ConfigWarning):
            print(f"anyaccel launch: warning: {w.message}", file=sys.stderr)
    return config, str(path)


def run(args: argparse.Namespace) -> int:
    """Carry out ``anyaccel launch``; returns the exit status (the job's: 0, or 1 when a worker
    failed, 128+N when stopped by signal N)."""
    from .plan import resolve_plan

    request = request_from_args(args)
    config, path = load_config_for(args.config_file)
    gpu_count = 0
    wants_gpu = not request.cpu and (config is None or config.device in ("auto", "gpu"))
    if wants_gpu:
        from ..devices import cuda_device_count

        gpu_count = cuda_device_count()
    plan = resolve_plan(request, config, os.environ, gpu_count, path)
    from .runner import run_plan

    return run_plan(plan)
