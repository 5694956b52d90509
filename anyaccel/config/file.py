"""The configuration file: where it lives, reading it strictly, writing it atomically, and
converting an Accelerate ``default_config.yaml``."""

from __future__ import annotations

import os
import pathlib
from typing import Any, Dict, List, Mapping, Optional, Union

import yaml

from .. import envvars
from ..fileio import atomic_write_text
from .accelerate_file import accelerate_values, is_accelerate_config
from .schema import Config, ConfigError, field_help, known_keys

__all__ = [
    "default_config_path",
    "find_config_file",
    "load_config",
    "save_config",
    "dump_config",
    "read_config",
    "accelerate_config_path",
    "from_accelerate",
    "accelerate_values",
    "is_accelerate_config",
]

PathLike = Union[str, "os.PathLike[str]"]


def _home(env: Mapping[str, str]) -> pathlib.Path:
    return pathlib.Path(env["HOME"]) if env.get("HOME") else pathlib.Path.home()


def _expand(path: PathLike, env: Mapping[str, str]) -> pathlib.Path:
    text = os.fspath(path)
    if text == "~" or text.startswith("~/"):
        return _home(env) / text[2:]
    return pathlib.Path(text).expanduser()


def default_config_path(env: Mapping[str, str] = os.environ) -> pathlib.Path:
    """Where ``anyaccel config`` writes and ``anyaccel launch`` looks; the first that applies:

    1. ``$ANYACCEL_CONFIG_FILE`` (the file itself);
    2. ``$ANYACCEL_HOME/default_config.yaml``;
    3. ``$XDG_CONFIG_HOME/anyaccel/default_config.yaml``;
    4. ``~/.config/anyaccel/default_config.yaml``.

    Empty variables count as unset. The file need not exist.
    """
    if env.get(envvars.CONFIG_FILE.name):
        return _expand(env[envvars.CONFIG_FILE.name], env)
    if env.get(envvars.HOME.name):
        return _expand(env[envvars.HOME.name], env) / "default_config.yaml"
    if env.get("XDG_CONFIG_HOME"):
        return _expand(env["XDG_CONFIG_HOME"], env) / "anyaccel" / "default_config.yaml"
    return _home(env) / ".config" / "anyaccel" / "default_config.yaml"


def find_config_file(
    explicit: Optional[PathLike] = None, env: Mapping[str, str] = os.environ
) -> Optional[pathlib.Path]:
    """The configuration file in effect: ``explicit`` when given (it must exist, else
    :class:`ConfigError`), otherwise :func:`default_config_path` when that file exists, else None
    (built-in defaults apply)."""
    if explicit is not None and os.fspath(explicit) != "":
        path = _expand(explicit, env)
        if not path.is_file():
            problem = "is a directory" if path.is_dir() else "does not exist"
            raise ConfigError(
                f"config file {path} {problem}; create it with `anyaccel config --config_file {path}` "
                "or leave out --config_file to use the default file"
            )
        return path
    path = default_config_path(env)
    return path if path.is_file() else None


def _read_yaml(path: pathlib.Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the file: {getattr(exc, 'strerror', None) or exc}", source=str(path)) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise ConfigError(
            f"not valid YAML{where} ({problem}); expected `key: value` lines with keys such as "
            f"{', '.join(Config().to_dict())}",
            source=str(path),
        ) from None


def read_config(path: PathLike, notes: Optional[List[str]] = None) -> Dict[str, Any]:
    """The settings a configuration file asks for, as ``{key: value}`` (not yet checked against
    each other: :class:`Config` does that once, after ``anyaccel launch``'s flags are merged in).
    An empty file asks for nothing. A file written by ``accelerate config`` is read with the same
    meaning (:func:`accelerate_values`; ``notes`` receives one line saying so); a key that is not
    anyaccel's is a :class:`ConfigError` naming the nearest known key. A file that is not YAML or
    not a mapping is a :class:`ConfigError` naming the file."""
    path = pathlib.Path(path)
    data = _read_yaml(path)
    if data is None:
        return {}
    if isinstance(data, Mapping) and is_accelerate_config(data):
        values = accelerate_values(data, str(path), strict=True, notes=notes)
        if notes is not None:
            notes.append(f"{path} is an Accelerate config file, read with the same meaning; `anyaccel config "
                         f"--from-accelerate {path}` writes the anyaccel file it amounts to")
        return values
    return known_keys(data, str(path))


def load_config(path: PathLike) -> Config:
    """Read and check a configuration file (:func:`read_config`, then :class:`Config`). An empty
    file gives the defaults; a file that is not YAML, not a mapping, or has a bad key, type or
    value raises :class:`ConfigError` naming the file, the key and the allowed values."""
    return Config.from_dict(read_config(path), source=str(path))


def dump_config(cfg: Config, comments: bool = True) -> str:
    """``cfg`` as YAML text, keys in schema order; with ``comments`` each key gets its help line."""
    lines = []
    for key, value in cfg.to_dict().items():
        if comments:
            lines.append(f"# {field_help(key)}")
        lines.append(yaml.safe_dump({key: value}, default_flow_style=False, sort_keys=False).rstrip("\n"))
    return "\n".join(lines) + "\n"


def save_config(cfg: Config, path: PathLike) -> pathlib.Path:
    """Write ``cfg`` to ``path`` atomically (a temporary file in the same folder, fsync, then
    ``os.replace``), creating parent folders; an existing file's permissions are kept. Returns the
    path written."""
    from .. import __version__

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = (
        f"# anyaccel configuration (written by anyaccel {__version__}).\n"
        "# Rerun `anyaccel config` to change it, or edit by hand; `anyaccel config show` checks it.\n\n"
        + dump_config(cfg)
    )
    atomic_write_text(path, text)
    return path


# --------------------------------------------------------------------------------------------
# Accelerate
# --------------------------------------------------------------------------------------------

def accelerate_config_path(env: Mapping[str, str] = os.environ) -> pathlib.Path:
    """Accelerate's default file: ``$HF_HOME/accelerate/default_config.yaml``, else
    ``$XDG_CACHE_HOME/huggingface/accelerate/...``, else ``~/.cache/huggingface/accelerate/...``
    (its ``default_config.json`` when only that exists)."""
    if env.get("HF_HOME"):
        folder = _expand(env["HF_HOME"], env) / "accelerate"
    else:
        cache = _expand(env["XDG_CACHE_HOME"], env) if env.get("XDG_CACHE_HOME") else _home(env) / ".cache"
        folder = cache / "huggingface" / "accelerate"
    path = folder / "default_config.yaml"
    json_path = folder / "default_config.json"
    return json_path if not path.exists() and json_path.exists() else path


def from_accelerate(path: Optional[PathLike] = None, env: Mapping[str, str] = os.environ) -> Config:
    """Convert an Accelerate config file (default: :func:`accelerate_config_path`) to a
    :class:`Config` (what ``anyaccel config --from-accelerate`` writes): :func:`accelerate_values`,
    where settings anyaccel cannot honour are left out with a :class:`ConfigWarning` naming each
    (``anyaccel launch`` stops on them instead)."""
    path = _expand(path, env) if path is not None and os.fspath(path) != "" else accelerate_config_path(env)
    source = str(path)
    if not path.is_file():
        hint = "pass its path: `anyaccel config --from-accelerate PATH`"
        raise ConfigError(f"no Accelerate config file here; {hint}", source=source)
    data = _read_yaml(path)
    if not isinstance(data, Mapping):
        raise ConfigError("expected an Accelerate config (a mapping of `key: value` lines)", source=source)
    return Config.from_dict(accelerate_values(data, source, strict=False), source=source)


