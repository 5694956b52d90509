"""The configuration file: where it lives, reading it strictly, writing it atomically, and
converting an Accelerate ``default_config.yaml``."""

from __future__ import annotations

import os
import pathlib
from typing import Any, Dict, Mapping, Optional, Union

import yaml

from .. import envvars
from ..fileio import atomic_write_text
from ..strategies.options import FSDPOptions
from .schema import Config, ConfigError, ConfigWarning, field_help

__all__ = [
    "default_config_path",
    "find_config_file",
    "load_config",
    "save_config",
    "dump_config",
    "accelerate_config_path",
    "from_accelerate",
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


def load_config(path: PathLike) -> Config:
    """Read and check a configuration file. An empty file gives the defaults; a file that is not
    YAML, not a mapping, or has a bad key, type or value raises :class:`ConfigError` naming the file,
    the key and the allowed values. Unknown keys are ignored with a ``ConfigWarning``."""
    path = pathlib.Path(path)
    data = _read_yaml(path)
    return Config() if data is None else Config.from_dict(data, source=str(path))


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

_ACCELERATE_DEVICES = {"NO": None, "MULTI_CPU": "cpu", "MULTI_GPU": "gpu", "XLA": "tpu", "TPU": "tpu", "FSDP": "gpu"}
_ACCELERATE_COPIED = ("num_machines", "machine_rank", "main_process_ip", "main_process_port", "num_processes",
                      "gpu_ids", "mixed_precision", "rdzv_backend")


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
    :class:`Config`. Device, processes, machines, rendezvous and mixed precision are kept;
    ``distributed_type: FSDP`` becomes ``strategy: fsdp`` with its ``fsdp_config`` (FSDP1 settings
    without an FSDP2 meaning are dropped with a :class:`ConfigWarning` naming them;
    ``fsdp_version: 1`` becomes 2); ``dynamo_config`` becomes ``dynamo_backend``/``dynamo_mode``.
    Settings without a meaning here (``same_network``, ``main_training_function``,
    ``downcast_bf16``, ``tpu_*`` ...) are ignored. DeepSpeed, Megatron-LM, SageMaker, fp8 and
    devices other than CPU/GPU/TPU raise :class:`ConfigError`."""
    path = _expand(path, env) if path is not None and os.fspath(path) != "" else accelerate_config_path(env)
    source = str(path)
    if not path.is_file():
        hint = "pass its path: `anyaccel config --from-accelerate PATH`"
        raise ConfigError(f"no Accelerate config file here; {hint}", source=source)
    data = _read_yaml(path)
    if not isinstance(data, Mapping):
        raise ConfigError("expected an Accelerate config (a mapping of `key: value` lines)", source=source)

    def unsupported(key: str, value: Any, allowed: str) -> ConfigError:
        return ConfigError(
            f"Accelerate key '{key}' has the value {value!r}, which anyaccel does not support; allowed: {allowed}",
            source=source,
            key=key,
        )

    environment = str(data.get("compute_environment") or "LOCAL_MACHINE").upper()
    if environment != "LOCAL_MACHINE":
        raise unsupported("compute_environment", data["compute_environment"], "LOCAL_MACHINE")
    kind = str(data.get("distributed_type") or "NO").upper()
    if kind not in _ACCELERATE_DEVICES:
        raise unsupported(
            "distributed_type",
            data["distributed_type"],
            f"{', '.join(_ACCELERATE_DEVICES)} (anyaccel runs DDP and FSDP2 on CPUs and CUDA GPUs, replicas on "
            "TPUs; no DeepSpeed or Megatron-LM: FSDP2 is anyaccel's way to shard a large model)",
        )
    # Values are checked by Config.from_dict, so e.g. `mixed_precision: fp8` is reported with the choices.
    out: Dict[str, Any] = {k: data[k] for k in _ACCELERATE_COPIED if data.get(k) not in (None, "")}
    out["device"] = "cpu" if data.get("use_cpu") is True else (_ACCELERATE_DEVICES[kind] or "auto")
    if kind == "FSDP":
        out.update(strategy=FSDPOptions.strategy, fsdp_config=_fsdp_from_accelerate(data.get("fsdp_config") or {}, source))
    if data.get("parallelism_config"):  # Accelerate's N-D sizes: the nd strategy (fsdp_config: how it shards)
        out.update(strategy="nd", parallelism_config=data["parallelism_config"])
    dynamo = data.get("dynamo_config") or {}
    if isinstance(dynamo, Mapping) and str(dynamo.get("dynamo_backend") or "no").lower() != "no":
        out["dynamo_backend"] = str(dynamo["dynamo_backend"]).lower()
        if dynamo.get("dynamo_mode"):
            out["dynamo_mode"] = str(dynamo["dynamo_mode"])
    num_machines = out.get("num_machines", 1)
    if isinstance(num_machines, int) and num_machines > 1:
        out["compute_environment"] = "several_machines"
    return Config.from_dict(out, source=source)


def _fsdp_from_accelerate(fsdp: Mapping[str, Any], source: str) -> Dict[str, Any]:
    """Accelerate's ``fsdp_config`` in anyaccel's keys; FSDP1-only settings dropped with a warning."""
    import warnings

    from ..plugins import fsdp1_keys, fsdp_plugin_from_dict

    values = {k: v for k, v in fsdp.items() if k not in fsdp1_keys(fsdp)}
    notes = sorted(set(fsdp) - set(values))
    if str(values.get("fsdp_version", 2)) == "1":
        values["fsdp_version"] = 2
        notes.append("fsdp_version 1 (anyaccel runs FSDP2; the model, optimizer and loop stay the same)")
    if notes:
        warnings.warn(f"{source}: FSDP settings without an FSDP2 meaning were left out: {', '.join(notes)}",
                      ConfigWarning, stacklevel=3)
    try:
        plugin = fsdp_plugin_from_dict(values, source="fsdp_config")
    except ValueError as exc:
        raise ConfigError(str(exc), source=source, key="fsdp_config") from None
    keep = ("reshard_after_forward", "auto_wrap_policy", "transformer_cls_names_to_wrap", "min_num_params",
            "cpu_offload", "activation_checkpointing", "state_dict_type")
    defaults = type(plugin)()
    return {k: getattr(plugin, k) for k in keep if getattr(plugin, k) != getattr(defaults, k)}
