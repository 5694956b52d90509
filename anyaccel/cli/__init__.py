"""The ``anyaccel`` command: ``config``, ``launch``, ``test``, ``env``, ``estimate-memory`` and ``merge-weights``.

Each sub-command lives in its own module and exposes ``add_parser(subparsers)``; this file only
wires them together and turns expected failures into one-paragraph messages with a non-zero exit
status (never a Python traceback). ``--debug`` (or ``ANYACCEL_DEBUG=1``) shows the traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ..errors import CLIError, ConfigError

__all__ = ["main", "CLIError"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one paragraph, exit 2, like argparse but with a hint
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\nRun `{self.prog} --help` for the options.\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="anyaccel", description="Run one PyTorch script on CPU, GPUs, several machines or a TPU.")
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"anyaccel {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{config,launch,test,env,estimate-memory,merge-weights}", parser_class=_Parser)
    from ..config import command as config_command
    from ..launch import command as launch_command
    from . import env_report, selftest

    config_command.add_parser(sub)
    launch_command.add_parser(sub)
    selftest.add_parser(sub)
    env_report.add_parser(sub)
    from ..big_modeling import commands as big_model_commands

    from ..strategies import memory_layouts

    big_model_commands.add_estimate_parser(sub, memory_layouts)
    big_model_commands.add_merge_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the sub-command's usage and the nearest option, not the top-level usage
        _unknown_options(parser, getattr(args, "command", None), unknown)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    debug = bool(getattr(args, "debug", False)) or _debug_env()
    try:
        return int(args.func(args) or 0)
    except CLIError as exc:
        print(f"anyaccel {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"anyaccel {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # last resort: still one paragraph unless debugging
        if debug:
            raise
        if isinstance(exc, ConfigError):
            print(f"anyaccel {args.command}: error: {exc}", file=sys.stderr)
            return 2
        print(
            f"anyaccel {args.command}: error: {type(exc).__name__}: {exc}\n"
            "This looks like a bug in anyaccel; rerun with --debug (or ANYACCEL_DEBUG=1) for the traceback "
            "and include `anyaccel env` in the report.",
            file=sys.stderr,
        )
        return 1


def _unknown_options(parser: argparse.ArgumentParser, command: Optional[str], unknown: List[str]) -> None:
    """Exit 2 with the usage of the command the options were given to and, for each unknown
    option, the nearest one it has (``--num_proceses``: did you mean ``--num_processes``?)."""
    from ..optionspec import close_match

    target = parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            target = action.choices[command]
    known = [o for a in target._actions for o in a.option_strings]
    parts = []
    for word in unknown:
        near = close_match(word.split("=", 1)[0], known) if word.startswith("-") else None
        parts.append(f"{word} (did you mean {near}?)" if near else word)
    target.error(f"unrecognized arguments: {' '.join(parts)}")


def _debug_env() -> bool:
    from .. import envvars

    try:
        return bool(envvars.read(envvars.DEBUG))
    except ConfigError:
        return False

