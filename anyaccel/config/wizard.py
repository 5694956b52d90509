"""The interactive ``anyaccel config`` questions (questionary prompts) and hardware detection.

Pressing Enter at every prompt gives :func:`suggested_config` for this machine (or keeps the
existing file's values when one is passed as ``defaults``).
"""

from __future__ import annotations

import glob
import importlib.util
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..strategies import default_for_processes, selectable_names, strategy_entry
from ..strategies.options import FSDPOptions, ParallelismConfig
from .schema import Config, ConfigError, check_value, field_allowed, mixed_precision_choices, parallelism_sizes

__all__ = ["detect", "suggested_config", "run_wizard", "strategy_choices"]


def detect() -> Dict[str, Any]:
    """What this machine has: ``{"gpus": int, "tpu": bool, "mps": bool}``. Never initialises CUDA
    (``torch.cuda.device_count()`` is only asked when ``torch.cuda.is_available()``); TPU means
    torch-xla is installed and ``PJRT_DEVICE=TPU``, a ``TPU_*`` variable or ``/dev/accel*`` exists."""
    from .. import devices  # imports torch; kept out of module import time

    env = os.environ
    tpu_hint = env.get("PJRT_DEVICE", "").upper() == "TPU" or any(k.startswith("TPU_") for k in env)
    tpu = importlib.util.find_spec("torch_xla") is not None and (tpu_hint or bool(glob.glob("/dev/accel*")))
    return {"gpus": devices.cuda_device_count(), "tpu": tpu, "mps": devices.mps_available()}


def _detected_device(detected: Dict[str, Any]) -> str:
    if detected.get("gpus", 0) > 0:
        return "gpu"
    if detected.get("tpu"):
        return "tpu"
    return "mps" if detected.get("mps") else "cpu"


def suggested_config(detected: Optional[Dict[str, Any]] = None) -> Config:
    """The configuration for this machine alone: the detected device (GPU > TPU > MPS > CPU), one
    process per GPU (torch-xla decides on a TPU, else 1), no mixed precision. ``anyaccel config
    --default`` writes this."""
    detected = detect() if detected is None else detected
    device = _detected_device(detected)
    processes = {"gpu": detected.get("gpus"), "tpu": None}.get(device, 1)
    return Config(device=device, num_processes=processes)


class _Cancelled(Exception):
    pass


def _ask(question: Any) -> Any:
    try:
        return question.unsafe_ask()
    except (KeyboardInterrupt, EOFError):
        raise _Cancelled from None


def _select(message: str, choices: Sequence[Tuple[str, str]], default: str) -> str:
    import questionary

    options = [questionary.Choice(title, value=value) for value, title in choices]
    return _ask(questionary.select(message, choices=options, default=default))


def _text(message: str, default: str, parse: Callable[[str], Any]) -> Any:
    """Ask for text; ``parse`` turns it into the value or raises ValueError/ConfigError with the reason."""
    import questionary

    def validate(text: str) -> Any:
        try:
            parse(text)
        except ConfigError as exc:
            return f"Allowed: {field_allowed(exc.key)}."
        except ValueError as exc:
            return str(exc)
        return True

    # Checked when Enter is pressed; the question stays with the reason shown below it.
    return parse(_ask(questionary.text(message, default=default, validate=validate, validate_while_typing=False)))


def _number(message: str, default: int, low: int, high: Optional[int] = None) -> int:
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError("Please type a whole number.") from None
        if value < low or (high is not None and value > high):
            allowed = f"from {low} to {high}" if high is not None else f">= {low}"
            raise ValueError(f"Please type a number {allowed}.")
        return value

    return _text(message, str(default), parse)


def _guess_ip() -> str:
    """This machine's address on its default route (no packet is sent), or ''."""
    from ..network import source_address

    return source_address("10.254.254.254") or ""


def run_wizard(defaults: Optional[Config] = None, detected: Optional[Dict[str, Any]] = None) -> Optional[Config]:
    """Ask the questions in the terminal and return the new :class:`Config`, or None when the user
    cancels (Ctrl-C, Ctrl-D, or "no" at the final confirmation). Answers default to ``defaults``
    (e.g. the existing file) or else to :func:`suggested_config`; typed numbers are checked inline."""
    detected = detect() if detected is None else detected
    base = defaults or suggested_config(detected)
    try:
        return _questions(base, detected)
    except _Cancelled:
        return None


def _questions(base: Config, detected: Dict[str, Any]) -> Optional[Config]:
    import questionary

    gpus = int(detected.get("gpus", 0))
    where = _select(
        "Where will the training run?",
        [("this_machine", "On this machine only"), ("several_machines", "On several machines (this is one of them)")],
        base.compute_environment,
    )
    devices = [
        ("gpu", f"GPU(s), CUDA ({f'{gpus} detected' if gpus else 'none detected here'})"),
        ("cpu", "CPU"),
        ("tpu", f"TPU via torch-xla ({'detected' if detected.get('tpu') else 'not detected here'})"),
        ("mps", f"Apple MPS, one process ({'detected' if detected.get('mps') else 'not detected here'})"),
        ("auto", "Decide at launch: GPUs if visible, else MPS, else CPU"),
    ]
    if where == "several_machines":  # MPS runs a single process
        devices = [d for d in devices if d[0] != "mps"]
    device_default = base.device if base.device in dict(devices) else _detected_device(dict(detected, mps=False))
    device = _select("Which device should each process use?", devices, device_default)
    values: Dict[str, Any] = dict(base.to_dict(), compute_environment=where, device=device)

    if where == "several_machines":
        n = values["num_machines"] = _number("How many machines in total?", max(2, base.num_machines), 2)
        rank_default = base.machine_rank if base.machine_rank < n else 0
        rank = values["machine_rank"] = _number(
            f"Rank of this machine (0 = the main machine, up to {n - 1})?", rank_default, 0, n - 1
        )
        ip_default = base.main_process_ip or (_guess_ip() if rank == 0 else "")
        values["main_process_ip"] = _text("IP address or host name of the main machine (rank 0)?", ip_default, _ip)
        values["main_process_port"] = _number("Port on the main machine?", base.main_process_port or 29500, 1, 65535)
    else:
        values.update(num_machines=1, machine_rank=0, main_process_ip=None)

    if device == "gpu" and gpus > 0:
        values["gpu_ids"] = _text(
            f"Which GPUs on this machine (all, or ids from 0 to {gpus - 1} such as 0,1)?",
            base.gpu_ids,
            lambda text: _gpu_ids(text, gpus),
        )

    per_machine = _processes_per_machine(base, values, gpus)
    if device in ("auto", "tpu"):
        values["num_processes"] = None  # decided at launch: one per visible GPU (else 1), or by torch-xla
    elif device == "mps":
        values["num_processes"] = 1
    else:
        hint = "one per GPU" if device == "gpu" else "1, or more to try distributed code"
        what = "on each machine" if where == "several_machines" else "in total"
        per_machine = _number(f"How many processes {what} ({hint})?", per_machine, 1)
        values["num_processes"] = per_machine * values["num_machines"]

    precisions = mixed_precision_choices(device)
    labels = {"no": "no (full fp32)", "bf16": "bf16", "fp16": "fp16 (slow on CPU)" if device == "cpu" else "fp16"}
    values["mixed_precision"] = _select(
        "Mixed precision?",
        [(p, labels[p]) for p in precisions],
        base.mixed_precision if base.mixed_precision in precisions else "no",
    )

    values.update(_sharding_questions(base, values))
    values["dynamo_backend"] = _select(
        "Compile the model with torch.compile?",
        [("no", "no"), ("inductor", "yes, inductor (first steps are slower while it compiles)")],
        base.dynamo_backend if base.dynamo_backend in ("no", "inductor") else "no",
    )

    cfg = Config.from_dict(values)
    print("\nThe configuration:")
    for key, value in cfg.to_dict().items():
        if key != "config_version":
            print(f"  {key}: {'null' if value is None else value}")
    return cfg if _ask(questionary.confirm("Save it?", default=True)) else None


def _several_processes(values: Dict[str, Any]) -> bool:
    return values.get("num_processes") is None or values["num_processes"] > 1 or values.get("num_machines", 1) > 1


def strategy_choices() -> List[Tuple[str, str]]:
    """``(name, title)`` of the strategies offered for a multi-process job: every selectable one
    in the strategy registry that spreads training over processes (entry points included), in
    registration order. Local."""
    choices = []
    for name in selectable_names():
        entry = strategy_entry(name)
        if entry is not None and entry.spans_processes:
            choices.append((name, entry.summary or name))
    return choices


def _sharding_questions(base: Config, values: Dict[str, Any]) -> Dict[str, Any]:
    """How the model is wrapped: asked only when the job may have several processes."""
    if not _several_processes(values) or values["device"] in ("tpu", "mps"):
        return {"strategy": "auto", "fsdp_config": None, "parallelism_config": None}
    choices = strategy_choices()
    auto = default_for_processes(2)  # what `auto` picks for several processes
    strategy = _select("How should each process hold the model?", choices,
                       base.strategy if base.strategy in dict(choices) else auto)
    if strategy == ParallelismConfig.strategy:
        return {"strategy": strategy, "fsdp_config": None, "parallelism_config": _parallelism_questions(base, values)}
    if strategy != FSDPOptions.strategy:  # the follow-up questions fill fsdp_config
        # the default stays `auto` unless the file named it
        return {"strategy": "auto" if strategy == auto and base.strategy != auto else strategy, "fsdp_config": None,
                "parallelism_config": None}
    old = dict(base.fsdp_config or {})
    names = _text("Module classes to shard one by one (comma-separated, e.g. TransformerEncoderLayer; empty: "
                  "shard the whole model as one unit)?", str(old.get("transformer_cls_names_to_wrap", "")),
                  lambda text: text.strip())
    config: Dict[str, Any] = {}
    if names:
        config.update(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=names)
    if _select("Recompute activations in backward (activation checkpointing: less memory, ~30% more compute)?",
               [("no", "no"), ("yes", "yes")], "yes" if old.get("activation_checkpointing") else "no") == "yes":
        config["activation_checkpointing"] = True
    if values["device"] in ("gpu", "auto") and _select(
            "Keep the shards in host memory (CPU offload: for models that still do not fit)?",
            [("no", "no"), ("yes", "yes")], "yes" if old.get("cpu_offload") else "no") == "yes":
        config["cpu_offload"] = True
    return {"strategy": FSDPOptions.strategy, "fsdp_config": config, "parallelism_config": None}


def _parallelism_questions(base: Config, values: Dict[str, Any]) -> Dict[str, int]:
    """The N-D sizes (``parallelism_config``, Accelerate's keys): tensor-parallel size and
    replicas, each checked to divide the processes left; the FSDP shard size is what remains.
    Without a known number of processes (decided at launch) the shard size is asked too and the
    product is checked by ``anyaccel launch``."""
    old = parallelism_sizes(base) or {}
    total = values.get("num_processes")

    def size(message: str, key: str, left: Optional[int]) -> int:
        default = old.get(key, 1)

        def parse(text: str) -> int:
            try:
                value = int(text.strip())
            except ValueError:
                raise ValueError("Please type a whole number.") from None
            if value < 1 or (left is not None and left % value):
                raise ValueError(f"Please type a number >= 1 that divides {left} (the processes left)."
                                 if left is not None else "Please type a number >= 1.")
            return value

        return _text(message, str(default if left is None or left % default == 0 else 1), parse)

    divides = f"; divides {total}" if total else ""
    tp = size(f"Tensor-parallel size (processes that split each layer, within a machine{divides})?", "tp_size", total)
    left = None if total is None else total // tp
    replicas = size("Model replicas (dp_replicate_size: full copies, e.g. one per machine; 1: shard over all)?",
                    "dp_replicate_size", left)
    if left is None:
        shard = size("FSDP shard size (processes each replica is sharded over)?", "dp_shard_size", None)
    else:
        shard = left // replicas
        print(f"  dp_shard_size = {shard} (the processes left: {total} / tp_size {tp} / replicas {replicas})")
    return {"parallelism_config_dp_replicate_size": replicas, "parallelism_config_dp_shard_size": shard,
            "parallelism_config_tp_size": tp}


def _ip(text: str) -> str:
    if not text.strip() or len(text.split()) > 1:
        raise ValueError("Please type one host name or IP address: the machine with rank 0.")
    return check_value("main_process_ip", text)


def _gpu_ids(text: str, gpus: int) -> str:
    ids = check_value("gpu_ids", text.strip() or "all")
    if ids != "all" and max(int(i) for i in ids.split(",")) >= gpus:
        raise ValueError(f"This machine has GPU ids 0 to {gpus - 1}.")
    return ids


def _processes_per_machine(base: Config, values: Dict[str, Any], gpus: int) -> int:
    """Default for the processes question: the existing value while device and GPU ids are
    unchanged, else one per selected GPU (or 1)."""
    device, ids = values["device"], values["gpu_ids"]
    if base.num_processes is not None and (base.device, base.gpu_ids) == (device, ids):
        return max(1, base.num_processes // base.num_machines)
    if device == "gpu" and gpus > 0:
        return gpus if ids == "all" else len(ids.split(","))
    return 1
