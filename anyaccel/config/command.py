"""``anyaccel config``: write the configuration file (questions, ``--default`` or
``--from-accelerate``) or ``show`` the one in effect."""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import warnings
from typing import Iterator, Optional

from ..errors import CLIError
from .file import default_config_path, dump_config, find_config_file, from_accelerate, load_config, save_config
from .schema import Config, ConfigError, ConfigWarning

__all__ = ["add_parser", "run"]

_DESCRIPTION = """\
Answer a few questions (arrow keys and Enter; Enter everywhere gives a working setup for this
machine) and write the configuration that `anyaccel launch` reads. `anyaccel config show` prints
the file in effect. Without --config_file the file is $ANYACCEL_CONFIG_FILE, else
$ANYACCEL_HOME/default_config.yaml, else $XDG_CONFIG_HOME/anyaccel/default_config.yaml, else
~/.config/anyaccel/default_config.yaml."""


def add_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Register ``config`` on the ``anyaccel`` sub-command parsers; it runs :func:`run`."""
    parser = subparsers.add_parser(
        "config",
        help="create or show the configuration file (interactive questions, --default, --from-accelerate)",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "action", nargs="?", choices=["show"], help="show: print the configuration in effect and its file"
    )
    parser.add_argument("--config_file", "--config-file", metavar="PATH", help="the file to write or show")
    parser.add_argument(
        "--default", action="store_true", help="write the detected settings for this machine without asking"
    )
    parser.add_argument(
        "--from-accelerate",
        "--from_accelerate",
        dest="from_accelerate",
        nargs="?",
        const="",
        metavar="PATH",
        help="convert an Accelerate config file (default: $HF_HOME/accelerate/default_config.yaml, "
        "else ~/.cache/huggingface/accelerate/default_config.yaml) into the anyaccel file it amounts to, leaving out "
        "(and naming) what anyaccel cannot honour; `anyaccel launch --config_file` reads such a file as it is",
    )
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")
    parser.set_defaults(func=run)
    return parser


@contextlib.contextmanager
def _warnings_printed() -> Iterator[None]:
    """Print configuration warnings as one line each instead of Python's warning format."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        yield
    for w in caught:
        if issubclass(w.category, ConfigWarning):
            print(f"anyaccel config: warning: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _show(explicit: Optional[str]) -> int:
    path = find_config_file(explicit)
    if path is None:
        print(
            f"# No configuration file: {default_config_path()} does not exist, so these defaults apply.\n"
            "# Create it with `anyaccel config` (or `anyaccel config --default`)."
        )
        print(dump_config(Config(), comments=False), end="")
        return 0
    with _warnings_printed():
        cfg = load_config(path)
    print(f"# {path}")
    print(dump_config(cfg, comments=False), end="")
    return 0


def _existing(path: pathlib.Path) -> Optional[Config]:
    """The file about to be replaced, as the wizard's defaults (None when absent or broken)."""
    if not path.is_file():
        return None
    try:
        with _warnings_printed():
            return load_config(path)
    except ConfigError as exc:
        print(f"anyaccel config: warning: starting from the defaults because {exc}", file=sys.stderr)
        return None


def run(args: argparse.Namespace) -> int:
    """Carry out ``anyaccel config``; returns the exit status (1 when the questions are cancelled)."""
    from_acc = getattr(args, "from_accelerate", None)
    if getattr(args, "action", None) == "show":
        if args.default or from_acc is not None:
            raise CLIError("`anyaccel config show` takes only --config_file")
        return _show(args.config_file)
    if args.default and from_acc is not None:
        raise CLIError("choose either --default or --from-accelerate, not both")
    path = pathlib.Path(args.config_file).expanduser() if args.config_file else default_config_path()

    if args.default:
        from .wizard import suggested_config

        cfg = suggested_config()
    elif from_acc is not None:
        with _warnings_printed():
            cfg = from_accelerate(from_acc or None)
    else:
        if not sys.stdin.isatty():
            raise CLIError(
                "the questions need an interactive terminal, but standard input is not one. "
                "Use `anyaccel config --default` to write the detected settings for this machine, "
                f"`anyaccel config --from-accelerate` to convert an Accelerate config, or write {path} by hand."
            )
        from .wizard import run_wizard

        defaults = _existing(path)
        print(f"Your answers will be saved to {path}. Press Ctrl-C to stop without saving.\n")
        cfg = run_wizard(defaults)
        if cfg is None:
            print("anyaccel config: cancelled, nothing was written.", file=sys.stderr)
            return 1

    try:
        save_config(cfg, path)
    except OSError as exc:
        raise CLIError(f"cannot write {path}: {exc.strerror or exc}") from None
    print(f"Configuration saved to {path}")
    if args.config_file and path != default_config_path():
        print(f"Use it with `anyaccel launch --config_file {path} your_script.py`.")
    return 0
