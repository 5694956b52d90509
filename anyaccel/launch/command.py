"""``anyaccel launch``: start a training script on every process of the job.

Parses the command line into a :class:`~anyaccel.launch.plan.LaunchRequest`, reads the
configuration file, resolves a :class:`~anyaccel.launch.plan.LaunchPlan` and hands it to
:func:`~anyaccel.launch.runner.run_plan` (torch's elastic agent). Bad input is reported as one
paragraph with exit status 2 before anything starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import optionspec
from ..errors import CLIError, ConfigError
from ..strategies.deepspeed.config import DeepSpeedOptions
from ..strategies.fsdp.options import FSDPOptions
from ..strategies.nd.options import ParallelismConfig
from .plan import LaunchPlan, LaunchRequest

__all__ = ["add_parser", "add_option_flags", "run", "request_from_args", "plan_from_args", "load_config_for"]

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


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0 (``anyaccel test --timeout``), worded as
    every option's check (:func:`anyaccel.optionspec.check`)."""
    return _flag_type(optionspec.option("preemption_grace"))(text)


def _flag_type(row: optionspec.Option) -> Callable[[str], Any]:
    """argparse type of ``row``'s flag: its text parsed and checked by the row, so a bad value is
    worded as from every other entry point (argparse prefixes ``argument --flag:``)."""

    def parse(text: str) -> Any:
        try:
            return optionspec.parse_text(row, text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(exc.message) from None

    parse.__name__ = row.name
    return parse


def add_option_flags(parser: argparse.ArgumentParser) -> Dict[str, Any]:
    """Add a flag for every row of the option table that has one (``--name`` and ``--name-with-
    dashes``), in its ``--help`` group; returns the groups by name (for the command's own flags).
    A flag left out is ``None`` in the parsed arguments: "not given"."""
    groups = {name: parser.add_argument_group(name) for name in optionspec.GROUPS}
    for row in optionspec.options_with("flag"):
        kw: Dict[str, Any] = dict(dest=row.dest, default=None)
        if row.switch:
            kw.update(action="store_const", const=True)
        else:
            kw.update(type=_flag_type(row), metavar=row.metavar)
            choices = optionspec.choices_of(row)
            if choices is not None:  # shown in --help; the type's check comes first, in the one wording
                kw.update(choices=choices)
        kw["help"] = optionspec.help_text(row, fill="%(choices)s") if row.help_from else row.help
        groups[row.group].add_argument(*optionspec.flag_names(row), **kw)
    return groups


def add_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Register ``launch`` on the ``anyaccel`` sub-command parsers; it runs :func:`run`. Its
    options are the option table's flags (:func:`add_option_flags`) plus the command's own
    (``--config_file``, ``--quiet``, ``-m``) and Accelerate's spellings of a strategy
    (``--use_fsdp``, ``--use_parallelism_config``, ``--use_deepspeed``, ``--multi_gpu``)."""
    p = subparsers.add_parser(
        "launch",
        help="run a training script on every process (this machine, several machines, SLURM)",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="anyaccel launch [options] SCRIPT [script args...]\n       anyaccel launch [options] -m MODULE [module args...]",
    )
    groups = add_option_flags(p)
    processes, hardware, sharding, nd, deepspeed, _, _, other = (groups[name] for name in optionspec.GROUPS)
    hardware.add_argument("--multi_gpu", "--multi-gpu", action="store_true",
                          help="Accelerate's flag: one process per GPU, which is what happens without it; stops when "
                               "no GPU is visible (pass --cpu for CPU processes)")
    sharding.add_argument("--use_fsdp", "--use-fsdp", action="store_true",
                          help="same as --strategy fsdp (Accelerate's flag)")
    nd.add_argument("--use_parallelism_config", "--use-parallelism-config", action="store_true",
                    help="same as --strategy nd (Accelerate's flag); sizes not given are 1, all 1: plain replicas")
    deepspeed.add_argument("--use_deepspeed", "--use-deepspeed", action="store_true",
                           help="same as --strategy deepspeed (Accelerate's flag)")
    other.add_argument("--config_file", "--config-file", metavar="PATH",
                       help="configuration file to read (default: see above); one written by `accelerate config` "
                            "is read with the same meaning")
    other.add_argument("--quiet", "-q", action="store_true", help="print nothing of the launcher's own but errors")
    p.add_argument("-m", dest="module", action="store_true",
                   help="the first word after the options is a module name (as `python -m`), not a script")
    p.add_argument("script_and_args", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS...]", help=argparse.SUPPRESS)
    p.set_defaults(func=run)
    return p


def request_from_args(args: argparse.Namespace) -> LaunchRequest:
    """The :class:`LaunchRequest` of a parsed command line: every option flag given, by option
    name. Raises :class:`CLIError` for a missing or nonexistent script."""
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
    given = {row.name: getattr(args, row.dest) for row in optionspec.options_with("flag")
             if getattr(args, row.dest, None) is not None}
    strategy = _strategy_flag(args)
    if strategy is not None:
        given["strategy"] = strategy
    return LaunchRequest(target=target, is_module=bool(args.module), script_args=rest, given=tuple(given.items()),
                         quiet=bool(args.quiet), multi_gpu=bool(getattr(args, "multi_gpu", False)))


def _strategy_flag(args: argparse.Namespace) -> Optional[str]:
    """``--strategy``, else what Accelerate's ``--use_parallelism_config`` (``nd``; Accelerate
    requires ``--use_fsdp`` next to it: FSDP2 shards nd's data-parallel dimensions) or
    ``--use_fsdp`` alone mean, or ``--use_deepspeed`` (``deepspeed``); a size flag
    (``--parallelism_config_*_size``) counts as ``--use_parallelism_config``. Raises CLIError for
    such a flag next to another ``--strategy``, or for two of them (one would be ignored)."""
    sizes = any(getattr(args, row.dest, None) is not None for row in optionspec.section_rows("parallelism_config"))
    use_deepspeed = bool(getattr(args, "use_deepspeed", False))
    if use_deepspeed and (args.use_fsdp or args.use_parallelism_config):
        raise CLIError(f"--use_deepspeed and {'--use_fsdp' if args.use_fsdp else '--use_parallelism_config'} ask for "
                       "two strategies: give one of them")
    if args.strategy is not None:
        for flag, wants in (("--use_parallelism_config", ParallelismConfig.strategy if args.use_parallelism_config
                             else None), ("--use_deepspeed", DeepSpeedOptions.strategy if use_deepspeed else None)):
            if wants is not None and args.strategy != wants:
                raise CLIError(f"{flag} asks for the {wants} strategy but --strategy is {args.strategy}: give one of "
                               "them")
        return args.strategy
    if use_deepspeed:
        return DeepSpeedOptions.strategy
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


def load_config_for(explicit: Optional[str]) -> Tuple[Optional[Dict[str, Any]], Optional[str], List[str]]:
    """The configuration file's settings (``{key: value}``, checked with the flags by the plan),
    its path and notes about it (``(None, None, [])`` when there is no file). Warnings about the
    file are printed as one line each."""
    import warnings

    from ..config.file import find_config_file, read_config
    from ..config.schema import ConfigWarning

    path = find_config_file(explicit)
    if path is None:
        return None, None, []
    notes: List[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        values = read_config(path, notes)
    for w in caught:
        if issubclass(w.category, ConfigWarning):
            print(f"anyaccel launch: warning: {w.message}", file=sys.stderr)
    return values, str(path), notes


def plan_from_args(args: argparse.Namespace) -> LaunchPlan:
    """What ``anyaccel launch`` (and ``anyaccel test``) will run for a parsed command line: the
    request, the configuration file, the visible GPUs, resolved into one plan. Starts nothing."""
    from .plan import resolve_plan

    request = request_from_args(args)
    values, path, notes = load_config_for(args.config_file)
    gpu_count = 0
    if not request.cpu:
        from ..environment.devices import cuda_device_count

        gpu_count = cuda_device_count()
    return resolve_plan(request, values, os.environ, gpu_count, path, notes=notes)


def run(args: argparse.Namespace) -> int:
    """Carry out ``anyaccel launch``; returns the exit status (the job's: 0, or 1 when a worker
    failed, 128+N when stopped by signal N)."""
    plan = plan_from_args(args)
    from .runner import run_plan

    return run_plan(plan)
