"""The configuration file: where it lives, reading it strictly, writing it atomically, and
converting an Accelerate ``default_config.yaml``."""

from __future__ import annotations

import os
import pathlib
from typing import Any, Dict, List, Mapping, Optional, Union

import yaml

from .. import envvars, optionspec
from ..fileio import atomic_write_text
from ..strategies.options import FSDPOptions
from .schema import Config, ConfigError, ConfigWarning, field_help, known_keys

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
        values = accelerate_values(data, str(path), strict=True)
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

_ACCELERATE_DEVICES = {"NO": None, "MULTI_CPU": "cpu", "MULTI_GPU": "gpu", "XLA": "tpu", "TPU": "tpu", "FSDP": "gpu",
                       "DEEPSPEED": "gpu"}
#: Accelerate keys that are anyaccel keys with the same meaning (the option rows marked ``accelerate``)
_ACCELERATE_SAME = tuple(row.key for row in optionspec.options_with("key") if row.accelerate and row.key
                         and row.key not in ("fsdp_config", "parallelism_config", "deepspeed_config"))
#: Accelerate keys read into other keys: handled by :func:`accelerate_values`
_ACCELERATE_READ = ("compute_environment", "distributed_type", "use_cpu", "dynamo_config", "fsdp_config",
                    "parallelism_config", "deepspeed_config")
#: Accelerate keys that change nothing at these values (``accelerate config`` writes them always)
_ACCELERATE_NO_EFFECT: Dict[str, Any] = {
    "main_training_function": None, "same_network": None,  # any value: TPU notebooks / a rendezvous hint
    "debug": None,  # Accelerate's debug mode checks collectives' shapes: anyaccel always does
    "downcast_bf16": (False, "no", None), "enable_cpu_affinity": (False, None), "tpu_use_cluster": (False, None),
    "tpu_use_sudo": (False, None), "tpu_env": ([], None), "tpu_name": (None,), "tpu_zone": (None,),
    "tpu_vm": (None, []), "commands": (None, []), "command_file": (None,),
    "megatron_lm_config": ({}, None), "mpirun_config": ({}, None),
    "ipex_config": ({}, None),
}
_ACCELERATE_WHY = {
    "megatron_lm_config": "anyaccel has no Megatron-LM; its nd strategy does tensor parallelism",
    "mpirun_config": "anyaccel launch starts its processes itself, not with mpirun",
    "enable_cpu_affinity": "anyaccel does not pin processes to CPUs",
    "downcast_bf16": "anyaccel does not downcast float32 to bf16 on TPUs",
}


def is_accelerate_config(data: Mapping[str, Any]) -> bool:
    """Whether ``data`` (a parsed file) was written by ``accelerate config``: it has Accelerate's
    ``distributed_type``, or its ``compute_environment`` is one of Accelerate's
    (``LOCAL_MACHINE``, ``AMAZON_SAGEMAKER``) rather than anyaccel's."""
    environment = data.get("compute_environment")
    return "distributed_type" in data or (isinstance(environment, str) and environment.isupper())


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


def accelerate_values(data: Mapping[str, Any], source: str, strict: bool) -> Dict[str, Any]:
    """An Accelerate config file's settings as anyaccel keys, with the same meaning. Device,
    processes, machines, rendezvous and mixed precision are kept; ``distributed_type: FSDP``
    becomes ``strategy: fsdp`` with its ``fsdp_config`` (FSDP1 settings without an FSDP2 meaning,
    e.g. ``fsdp_cpu_ram_efficient_loading``, are left out with a :class:`ConfigWarning` naming
    them; ``fsdp_version: 1`` becomes 2); ``distributed_type: DEEPSPEED`` becomes ``strategy:
    deepspeed`` with its ``deepspeed_config`` (whose ``gradient_accumulation_steps`` is the
    top-level key); ``parallelism_config`` selects ``nd``; ``dynamo_config`` becomes
    ``dynamo_backend``/``dynamo_mode``; settings that change nothing at the values ``accelerate
    config`` writes (``same_network``, ``main_training_function``, an empty ``deepspeed_config``,
    ...) are skipped; ``fp8_config`` is kept under ``mixed_precision: fp8`` (left out with a
    :class:`ConfigWarning` otherwise: Accelerate does not use it either; its ``backend: MSAMP``
    cannot be honoured). Settings anyaccel cannot honour (Megatron-LM, SageMaker, MS-AMP, DeepSpeed's own
    hostfile launchers, other devices, ...) are one :class:`ConfigError` naming every one
    of them and ``anyaccel config --from-accelerate`` (``strict``), or left out with a
    :class:`ConfigWarning` (not ``strict``: the conversion). An unknown key is an error naming the
    nearest known one."""
    import warnings

    kind = str(data.get("distributed_type") or "NO").upper()
    deepspeed_refused = _deepspeed_refused(kind, data.get("deepspeed_config"))
    refused = _accelerate_refused(data) + list(deepspeed_refused.values())
    known = set(_ACCELERATE_SAME) | set(_ACCELERATE_READ) | set(_ACCELERATE_NO_EFFECT)
    unknown = [str(k) for k in data if k not in known]
    if unknown:
        from .schema import unknown_keys_error

        raise unknown_keys_error(unknown, source, sorted(known))
    if refused and strict:
        raise ConfigError(f"an Accelerate config file with settings anyaccel cannot honour: {'; '.join(refused)}. "
                          f"Remove them, or run `anyaccel config --from-accelerate {source}` to write an anyaccel "
                          "config without them", source=source, key="distributed_type")
    if refused:
        warnings.warn(f"{source}: left out, anyaccel cannot honour them: {'; '.join(refused)}", ConfigWarning,
                      stacklevel=3)
    out = _without_unused_fp8({k: data[k] for k in _ACCELERATE_SAME if data.get(k) not in (None, "", {})}, source)
    if out.get("num_processes") == -1:  # ClusterConfig's "not set"
        del out["num_processes"]
    out["device"] = "cpu" if data.get("use_cpu") is True else (_ACCELERATE_DEVICES.get(kind) or "auto")
    if kind == "FSDP":
        out.update(strategy=FSDPOptions.strategy, fsdp_config=_fsdp_from_accelerate(data.get("fsdp_config") or {}, source))
    if kind == "DEEPSPEED":  # Accelerate's DeepSpeed: the deepspeed strategy with the section's settings
        out["strategy"] = "deepspeed"
        section = data.get("deepspeed_config") or {}
        settings = {k: v for k, v in _deepspeed_section(section).items() if k not in deepspeed_refused}
        if settings:
            out["deepspeed_config"] = settings
        if section.get("gradient_accumulation_steps") not in (None, "auto"):
            out["gradient_accumulation_steps"] = section["gradient_accumulation_steps"]
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
    return out


def _without_unused_fp8(out: Dict[str, Any], source: str) -> Dict[str, Any]:
    """``out`` without an Accelerate file's ``fp8_config`` when its ``mixed_precision`` is not fp8
    (Accelerate does not use it then either), with a :class:`ConfigWarning` saying so."""
    import warnings

    if out.get("fp8_config") and str(out.get("mixed_precision")).lower() != "fp8":
        warnings.warn(f"{source}: fp8_config left out: mixed_precision is {out.get('mixed_precision')!r}, so Accelerate "
                      "does not use it either", ConfigWarning, stacklevel=4)
        del out["fp8_config"]
    return out


def _accelerate_refused(data: Mapping[str, Any]) -> List[str]:
    """Each setting of an Accelerate file anyaccel cannot honour, as ``"key: value (why)"``."""
    refused = []
    environment = str(data.get("compute_environment") or "LOCAL_MACHINE").upper()
    if environment != "LOCAL_MACHINE":
        refused.append(f"compute_environment: {data['compute_environment']} (anyaccel runs on machines you start it "
                       "on: LOCAL_MACHINE)")
    kind = str(data.get("distributed_type") or "NO").upper()
    if kind not in _ACCELERATE_DEVICES:
        why = {"MEGATRON_LM": "no Megatron-LM: the nd strategy does tensor parallelism"}
        refused.append(f"distributed_type: {data['distributed_type']} ("
                       + why.get(kind, "anyaccel runs DDP, FSDP2 and DeepSpeed on CPUs and CUDA GPUs, replicas on TPUs; "
                                       f"allowed: {', '.join(_ACCELERATE_DEVICES)}") + ")")
    for key, harmless in _ACCELERATE_NO_EFFECT.items():
        value = data.get(key)
        if key in data and harmless is not None and value not in harmless:
            shown = key if isinstance(value, Mapping) else f"{key}: {value!r}"
            refused.append(f"{shown} ({_ACCELERATE_WHY.get(key, 'no anyaccel meaning')})")
    return refused


def _deepspeed_refused(kind: str, section: Any) -> Dict[str, str]:
    """The ``deepspeed_config`` settings that cannot be honoured, ``{key: one line}``: the section
    under another ``distributed_type`` (key ``""``: Accelerate does not use it either), and each
    key its row refuses (a value, or a key without a meaning here), in the words of
    :func:`anyaccel.optionspec.check`."""
    if not section:
        return {}
    if not isinstance(section, Mapping) or kind != "DEEPSPEED":
        return {"": f"deepspeed_config (distributed_type is {kind}, so Accelerate does not use it either; remove it, "
                    "or set distributed_type: DEEPSPEED)"}
    rows = {row.key: row for row in optionspec.section_rows("deepspeed_config")}
    refused = {}
    for key, value in _deepspeed_section(section).items():
        try:
            if key in rows:
                optionspec.check(rows[key], value, f"deepspeed_config.{key}")
            else:  # the section's own words for a key it does not have
                optionspec.check(optionspec.option("deepspeed_config"), {key: value}, "deepspeed_config")
        except ConfigError as exc:
            refused[str(key)] = exc.message
    return refused


def _deepspeed_section(section: Mapping[str, Any]) -> Dict[str, Any]:
    """Accelerate's ``deepspeed_config`` as anyaccel's: its ``gradient_accumulation_steps`` is the
    top-level key (read by :func:`accelerate_values`), a ``null`` is "not set"."""
    return {k: v for k, v in section.items() if k != "gradient_accumulation_steps" and v is not None}


def _fsdp_from_accelerate(fsdp: Mapping[str, Any], source: str) -> Dict[str, Any]:
    """Accelerate's ``fsdp_config`` in anyaccel's keys; FSDP1-only settings dropped with a warning."""
    import warnings

    from ..compat.plugins import fsdp1_keys, fsdp_plugin_from_dict

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
