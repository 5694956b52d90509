"""A configuration file written by ``accelerate config`` (Accelerate 1.15, and the sections older
versions wrote) read with the same meaning: :func:`accelerate_values` turns its settings into
anyaccel's keys. The rule, setting by setting:

* what anyaccel has under the same name (processes, machines, rendezvous, GPU ids, mixed
  precision) is kept; ``distributed_type`` and ``use_cpu`` choose the device and the strategy
  (``FSDP`` -> ``fsdp`` or, for FSDP1's ``HYBRID_SHARD`` over several machines, ``nd`` with one
  replica per machine; FSDP1's ``NO_SHARD`` -> DDP; ``DEEPSPEED`` -> ``deepspeed``;
  ``parallelism_config`` -> ``nd``); ``dynamo_config`` sets the compile options;
* a section that describes a feature that is **off** (``ipex_config: {ipex: false}``, an
  ``mpirun_config`` without a hostfile, ``dynamo_config`` with backend ``NO``, an
  ``fp8_config`` when ``mixed_precision`` is not fp8, a ``megatron_lm_config`` under another
  ``distributed_type`` — Accelerate ignores both then —, the TPU-pod keys of a file whose
  ``tpu_use_cluster`` is false, ...) and what
  changes nothing here (``debug``: anyaccel always checks collectives' shapes; ``same_network``;
  FSDP1's ``use_orig_params``, which FSDP2 always does) are accepted silently;
* FSDP1 settings whose work FSDP2 does its own way are read into their FSDP2 meaning, with one
  note for the launch summary (``notes``) where the run differs in speed only;
* a feature that is **on** and cannot be honoured (an mpirun hostfile, IPEX, NUMA affinity, a
  TPU pod, Megatron-LM, regional compilation, a compile backend or rendezvous anyaccel's launcher
  does not have, FSDP1's local state dict, activation checkpointing or offloading under FSDP1's
  ``NO_SHARD``, DeepSpeed's own multi-machine launchers, SageMaker — one clause for the whole
  SageMaker file, whose own keys are then not read —, ...) is one clause each of one :class:`ConfigError` that
  points at ``anyaccel config --from-accelerate`` (``strict``: ``anyaccel launch``), or left out
  with a :class:`ConfigWarning` (the conversion).

Local and pure (reads no file; :mod:`anyaccel.config.file` reads them).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from .. import optionspec
from ..strategies.options import DDPOptions, FSDPOptions, ParallelismConfig
from .schema import ConfigError, ConfigWarning

__all__ = ["accelerate_values", "is_accelerate_config"]

_DEVICES = {"NO": None, "MULTI_CPU": "cpu", "MULTI_GPU": "gpu", "XLA": "tpu", "TPU": "tpu", "FSDP": "gpu",
            "DEEPSPEED": "gpu"}
#: Accelerate keys that are anyaccel keys with the same meaning (the option rows marked ``accelerate``)
_SAME = tuple(row.key for row in optionspec.options_with("key") if row.accelerate and row.key
              and row.key not in ("fsdp_config", "parallelism_config", "deepspeed_config"))
#: Accelerate keys read into other keys by :func:`accelerate_values` (``fp16`` and a top-level
#: ``dynamo_backend``: the spellings of Accelerate before 0.18)
_READ = ("compute_environment", "distributed_type", "use_cpu", "dynamo_config", "fsdp_config", "parallelism_config",
         "deepspeed_config", "fp16", "dynamo_backend")


def _always(value: Any, data: Mapping[str, Any]) -> bool:
    return True


#: Accelerate keys that carry nothing to do here: ``key -> off(value, file)``, True when the value
#: (in that file) asks for nothing anyaccel does not do
_OFF: Dict[str, Callable[[Any, Mapping[str, Any]], bool]] = {
    "main_training_function": _always,  # the function a TPU notebook launcher calls
    "same_network": _always,  # a hint for the rendezvous question
    "debug": _always,  # Accelerate's debug mode checks collectives' shapes: anyaccel always does
    "downcast_bf16": lambda v, d: v in (False, "no", None),
    "enable_cpu_affinity": lambda v, d: v in (False, None),
    "tpu_use_cluster": lambda v, d: v in (False, None),
    # the TPU pod's settings: used only with tpu_use_cluster, which is its own clause
    **{key: _always for key in ("tpu_use_sudo", "tpu_env", "tpu_name", "tpu_zone", "tpu_vm", "commands",
                                "command_file")},
    # read only under distributed_type MEGATRON_LM, which is its own clause
    "megatron_lm_config": _always,
    "mpirun_config": lambda v, d: not v or (isinstance(v, Mapping) and not v.get("mpirun_hostfile")),
    "ipex_config": lambda v, d: not v or (isinstance(v, Mapping) and not v.get("ipex")),
}
_WHY = {
    "mpirun_config": "anyaccel launch starts its processes itself, not with mpirun: run it on each machine",
    "ipex_config": "anyaccel does not apply intel_extension_for_pytorch",
    "enable_cpu_affinity": "anyaccel does not pin processes to NUMA nodes",
    "downcast_bf16": "anyaccel does not downcast float32 to bf16 on TPUs",
    "tpu_use_cluster": "anyaccel launch runs on the machine it is started on: start it on every TPU VM of the pod",
}
#: the keys of a SageMaker file (Accelerate's ``SageMakerConfig``): not read, the whole file is one clause
_SAGEMAKER = ("ec2_instance_type", "iam_role_name", "image_uri", "profile", "region", "base_job_name",
              "pytorch_version", "transformers_version", "py_version", "sagemaker_inputs_file",
              "sagemaker_metrics_file", "additional_args")
#: FSDP1's sharding strategies by number (``torch.distributed.fsdp.ShardingStrategy``), as older
#: files wrote them and Accelerate still reads them
_FSDP1_NUMBERS = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD",
                  "5": "HYBRID_SHARD_ZERO2"}
_CANONICAL_FSDP = {"offload_params": "cpu_offload", "transformer_layer_cls_to_wrap": "transformer_cls_names_to_wrap"}


def _sagemaker(data: Mapping[str, Any]) -> bool:
    return str(data.get("compute_environment") or "").upper() == "AMAZON_SAGEMAKER"


def is_accelerate_config(data: Mapping[str, Any]) -> bool:
    """Whether ``data`` (a parsed file) was written by ``accelerate config``: it has Accelerate's
    ``distributed_type``, or its ``compute_environment`` is one of Accelerate's
    (``LOCAL_MACHINE``, ``AMAZON_SAGEMAKER``) rather than anyaccel's. Local."""
    environment = data.get("compute_environment")
    return "distributed_type" in data or (isinstance(environment, str) and environment.isupper())


def accelerate_values(data: Mapping[str, Any], source: str, strict: bool,
                      notes: Optional[List[str]] = None) -> Dict[str, Any]:
    """An Accelerate config file's settings as anyaccel keys, with the same meaning (the rule is
    the module docstring's). ``notes`` receives the lines the launch summary shows (how FSDP1
    settings are run). Settings anyaccel cannot honour are one :class:`ConfigError` naming every
    one of them and ``anyaccel config --from-accelerate`` (``strict``), or left out with a
    :class:`ConfigWarning` (not ``strict``: the conversion). An unknown key is an error naming the
    nearest known one. Local."""
    kind = str(data.get("distributed_type") or "NO").upper()
    deepspeed_refused = _deepspeed_refused(kind, data.get("deepspeed_config"))
    fsdp_values, fsdp_refused, fsdp_notes = _fsdp(data, source) if kind == "FSDP" else ({}, [], [])
    dynamo = _dynamo_section(data)
    refused = _refused(data) + list(deepspeed_refused.values()) + fsdp_refused + _dynamo_refused(dynamo)
    known = set(_SAME) | set(_READ) | set(_OFF) | (set(_SAGEMAKER) if _sagemaker(data) else set())
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
    out: Dict[str, Any] = {k: data[k] for k in _SAME if data.get(k) not in (None, "", {})}
    if out.get("num_processes") == -1:  # ClusterConfig's "not set"
        del out["num_processes"]
    if _sagemaker(data):  # SageMaker's instance count, not machines anyaccel launch meets (refused above)
        out.pop("num_machines", None)
    if "rdzv_backend" in out:  # torchrun's names, any case; one anyaccel's launcher lacks is refused above
        rdzv = str(out.pop("rdzv_backend")).lower()
        if rdzv in optionspec.RDZV_BACKENDS:
            out["rdzv_backend"] = rdzv
    if data.get("mixed_precision") in (None, "") and data.get("fp16"):  # Accelerate before 0.18
        out["mixed_precision"] = "fp16"
    if out.get("fp8_config") is not None and str(out.get("mixed_precision")).lower() != "fp8":
        del out["fp8_config"]  # fp8 is off: Accelerate does not read the section either
    out["device"] = "cpu" if data.get("use_cpu") is True else (_DEVICES.get(kind) or "auto")
    out.update(fsdp_values)
    out.update(_deepspeed_values(kind, data.get("deepspeed_config") or {}, deepspeed_refused))
    if data.get("parallelism_config"):  # Accelerate's N-D sizes: the nd strategy (fsdp_config: how it shards)
        out.update(strategy=ParallelismConfig.strategy, parallelism_config=data["parallelism_config"])
    out.update(_dynamo_values(dynamo))
    num_machines = out.get("num_machines", 1)
    if isinstance(num_machines, int) and num_machines > 1:
        out["compute_environment"] = "several_machines"
    if notes is not None:
        notes.extend(f"{source}: {note}" for note in fsdp_notes)
    return out


def _refused(data: Mapping[str, Any]) -> List[str]:
    """Each top-level setting of an Accelerate file anyaccel cannot honour, as ``"key: value (why)"``."""
    refused = []
    environment = str(data.get("compute_environment") or "LOCAL_MACHINE").upper()
    if _sagemaker(data):  # one clause: the file's SageMaker keys and distributed types are not read
        refused.append(f"compute_environment: {data['compute_environment']} (anyaccel does not launch on Amazon "
                       "SageMaker: run anyaccel launch on the instances, each started as one machine)")
    elif environment != "LOCAL_MACHINE":
        refused.append(f"compute_environment: {data['compute_environment']} (anyaccel runs on machines you start it "
                       "on: LOCAL_MACHINE)")
    kind = str(data.get("distributed_type") or "NO").upper()
    rdzv = data.get("rdzv_backend")
    if rdzv not in (None, "") and str(rdzv).lower() not in optionspec.RDZV_BACKENDS:
        refused.append(f"rdzv_backend: {rdzv} (anyaccel launch meets the other machines with "
                       f"{' or '.join(optionspec.RDZV_BACKENDS)}; c10d needs no {rdzv} server, only "
                       "main_process_ip and main_process_port)")
    if kind not in _DEVICES and not _sagemaker(data):
        why = {"MEGATRON_LM": "no Megatron-LM: the nd strategy does tensor parallelism"}
        refused.append(f"distributed_type: {data['distributed_type']} ("
                       + why.get(kind, "anyaccel runs DDP, FSDP2 and DeepSpeed on CPUs and CUDA GPUs, replicas on TPUs; "
                                       f"allowed: {', '.join(_DEVICES)}") + ")")
    for key, off in _OFF.items():
        value = data.get(key)
        if key in data and not off(value, data):
            shown = key if isinstance(value, Mapping) else f"{key}: {value!r}"
            refused.append(f"{shown} ({_WHY.get(key, 'no anyaccel meaning')})")
    return refused


# ---- dynamo ------------------------------------------------------------------------------------
def _dynamo_section(data: Mapping[str, Any]) -> Dict[str, Any]:
    """``dynamo_config`` (with an old top-level ``dynamo_backend``), ``{}`` when the backend is NO."""
    section = dict(data.get("dynamo_config") or {}) if isinstance(data.get("dynamo_config") or {}, Mapping) else {}
    if data.get("dynamo_backend") is not None:
        section.setdefault("dynamo_backend", data["dynamo_backend"])
    return section if str(section.get("dynamo_backend") or "no").lower() != "no" else {}


def _dynamo_refused(section: Mapping[str, Any]) -> List[str]:
    """The compile settings anyaccel's launcher cannot honour: regional compilation, and a backend
    that is not one of its choices (Accelerate's ``ONNXRT``, ``TVM``, ``TENSORRT``, ``HPU_BACKEND``,
    ... need their own packages or devices)."""
    refused = []
    backend = str(section.get("dynamo_backend") or "no")
    if section and backend.lower() not in optionspec.DYNAMO_BACKENDS:
        refused.append(f"dynamo_config.dynamo_backend: {backend} (anyaccel launch compiles with "
                       f"{', '.join(b for b in optionspec.DYNAMO_BACKENDS if b != 'no')}; for another torch.compile "
                       f"backend pass Accelerator(dynamo_backend=\"{backend.lower()}\") in the script)")
    if section.get("dynamo_use_regional_compilation"):
        refused.append("dynamo_config.dynamo_use_regional_compilation: True (anyaccel compiles the whole model; "
                       "leave regional compilation off)")
    return refused


def _dynamo_values(section: Mapping[str, Any]) -> Dict[str, Any]:
    """The compile keys of a ``dynamo_config`` whose backend is on (Accelerate passes the flags it
    wrote, ``false`` included, to ``torch.compile``); ``{}`` for a backend :func:`_dynamo_refused` refuses."""
    if not section or str(section["dynamo_backend"]).lower() not in optionspec.DYNAMO_BACKENDS:
        return {}
    out: Dict[str, Any] = {"dynamo_backend": str(section["dynamo_backend"]).lower()}
    for key, name in (("dynamo_mode", "dynamo_mode"), ("dynamo_use_fullgraph", "dynamo_use_fullgraph"),
                      ("dynamo_use_dynamic", "dynamo_use_dynamic")):
        if section.get(key) is not None:
            out[name] = section[key]
    return out


# ---- DeepSpeed ---------------------------------------------------------------------------------
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
    top-level key (read by :func:`_deepspeed_values`), a ``null`` is "not set"."""
    return {k: v for k, v in section.items() if k != "gradient_accumulation_steps" and v is not None}


def _deepspeed_values(kind: str, section: Mapping[str, Any], refused: Mapping[str, str]) -> Dict[str, Any]:
    """Accelerate's DeepSpeed: the deepspeed strategy with the section's settings."""
    if kind != "DEEPSPEED":
        return {}
    out: Dict[str, Any] = {"strategy": "deepspeed"}
    settings = {k: v for k, v in _deepspeed_section(section).items() if k not in refused}
    if settings:
        out["deepspeed_config"] = settings
    if section.get("gradient_accumulation_steps") not in (None, "auto"):
        out["gradient_accumulation_steps"] = section["gradient_accumulation_steps"]
    return out


# ---- FSDP ---------------------------------------------------------------------------------------
def _fsdp(data: Mapping[str, Any], source: str) -> Tuple[Dict[str, Any], List[str], List[str]]:
    """``distributed_type: FSDP``'s keys ``(values, refused, notes)``: ``fsdp_config`` in FSDP2's
    terms (``strategy: fsdp``), FSDP1's ``NO_SHARD`` as DDP (:func:`_no_shard`), its
    ``HYBRID_SHARD`` over several machines as ``nd`` with one replica per machine."""
    settings = {(_CANONICAL_FSDP.get(k[5:], k[5:]) if k.startswith("fsdp_") and k != "fsdp_version" else k): v
                for k, v in (data.get("fsdp_config") or {}).items()}
    notes, refused = [], []
    version = str(settings.pop("fsdp_version", ""))  # none written: Accelerate reads FSDP1
    if version != "2":  # FSDP1's numbered sharding strategies, as Accelerate reads them
        for key in ("sharding_strategy", "reshard_after_forward"):
            if not isinstance(settings.get(key), bool) and str(settings.get(key)) in _FSDP1_NUMBERS:
                settings[key] = _FSDP1_NUMBERS[str(settings[key])]
    sharding = str(settings.get("reshard_after_forward", settings.get("sharding_strategy", ""))).upper()
    if version == "1" and sharding != "NO_SHARD":
        notes.append("fsdp_version 1 runs as FSDP2 (torch's fully_shard): the same model, optimizer, loop and "
                     "results; checkpoints are anyaccel's")
    for key in ("use_orig_params", "limit_all_gathers"):  # what FSDP2 always does, or never needs
        settings.pop(key, None)
    prefetch = [f"{key}={settings.pop(key)!r}" for key in ("backward_prefetch", "forward_prefetch")
                if settings.get(key) not in (None, False, "BACKWARD_PRE")]
    settings = {k: v for k, v in settings.items() if k not in ("backward_prefetch", "forward_prefetch")}
    if prefetch and sharding != "NO_SHARD":
        notes.append(f"FSDP1's {', '.join(prefetch)}: FSDP2 schedules its own prefetching (the speed may differ, "
                     "the numbers do not)")
    if settings.pop("cpu_ram_efficient_loading", None) is True:  # FSDP1 then forces sync_module_states
        settings["sync_module_states"] = True
    if str(settings.get("state_dict_type", "")).upper() == "LOCAL_STATE_DICT":
        del settings["state_dict_type"]
        refused.append("fsdp_config.fsdp_state_dict_type: LOCAL_STATE_DICT (FSDP2 has no local state dict; "
                       "SHARDED_STATE_DICT has each process write its own part)")
    if sharding == "NO_SHARD":  # FSDP1's NO_SHARD is data parallelism: every process holds everything
        return _no_shard(settings, source, refused, notes)
    values: Dict[str, Any] = {"strategy": FSDPOptions.strategy}
    if sharding.startswith("HYBRID_SHARD"):
        settings.pop("sharding_strategy", None)
        settings["reshard_after_forward"] = sharding == "HYBRID_SHARD"
        machines, processes = int(data.get("num_machines") or 1), data.get("num_processes")
        if machines > 1 and isinstance(processes, int) and processes % machines == 0:
            values = {"strategy": ParallelismConfig.strategy, "parallelism_config": {"parallelism_config_dp_replicate_size": machines,
                                                               "parallelism_config_dp_shard_size": processes // machines}}
            notes.append(f"FSDP1's {sharding} runs as FSDP2 sharded within each machine and replicated over the "
                         f"{machines} machines (the nd strategy)")
        else:
            notes.append(f"FSDP1's {sharding} on one machine shards over all its processes, as FSDP1 does")
    fsdp_config = _fsdp_settings(settings, source)
    if fsdp_config or values["strategy"] == FSDPOptions.strategy:
        values["fsdp_config"] = fsdp_config
    return values, refused, notes


def _no_shard(settings: Dict[str, Any], source: str, refused: List[str],
              notes: List[str]) -> Tuple[Dict[str, Any], List[str], List[str]]:
    """FSDP1's ``NO_SHARD`` (every process holds the whole model): DDP. The settings are checked
    as any ``fsdp_config`` is; the two that ask DDP for what it does not do — recomputing
    activations, keeping parameters in host memory — are refused, one clause each; the wrap
    policy, module-state sync (DDP starts from rank 0's weights anyway) and the state dict type
    (DDP writes full files, which every strategy loads) change nothing."""
    settings = {k: v for k, v in settings.items() if k not in ("sharding_strategy", "reshard_after_forward")}
    checked = _fsdp_settings(settings, source)
    if checked.get("activation_checkpointing"):
        refused.append("fsdp_config.fsdp_activation_checkpointing: true under NO_SHARD (NO_SHARD runs as DDP, which "
                       "does not recompute activations: use FULL_SHARD or SHARD_GRAD_OP to keep it)")
    if checked.get("cpu_offload"):
        refused.append("fsdp_config.fsdp_offload_params: true under NO_SHARD (NO_SHARD runs as DDP, which keeps "
                       "parameters on the device: use FULL_SHARD or SHARD_GRAD_OP to offload)")
    notes.append("FSDP1's NO_SHARD runs as DDP (every process holds the whole model, as NO_SHARD does; checkpoints "
                 "are full files, which every strategy loads)")
    return {"strategy": DDPOptions.strategy}, refused, notes


def _fsdp_settings(settings: Dict[str, Any], source: str) -> Dict[str, Any]:
    """FSDP settings in anyaccel's ``fsdp_config`` keys, only those that differ from the defaults;
    checked by building the plugin (a bad value is a :class:`ConfigError` naming it)."""
    from ..compat.plugins import fsdp_plugin_from_dict

    try:
        plugin = fsdp_plugin_from_dict(settings, source="fsdp_config")
    except ValueError as exc:
        raise ConfigError(str(exc), source=source, key="fsdp_config") from None
    keep = ("reshard_after_forward", "auto_wrap_policy", "transformer_cls_names_to_wrap", "min_num_params",
            "cpu_offload", "activation_checkpointing", "state_dict_type", "sync_module_states")
    defaults = type(plugin)()
    return {k: getattr(plugin, k) for k in keep if getattr(plugin, k) != getattr(defaults, k)}
