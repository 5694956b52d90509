"""The interactive ``anyaccel config`` questions (questionary prompts) and hardware detection.

Pressing Enter at every prompt gives :func:`suggested_config` for this machine (or keeps the
existing file's values when one is passed as ``defaults``).
"""

from __future__ import annotations

import glob
import importlib.util
import os
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from .. import optionspec
from ..strategies import default_for_processes, selectable_names, strategy_entry
from ..strategies.deepspeed.config import DeepSpeedOptions
from ..strategies.fsdp.options import FSDPOptions
from ..strategies.nd.options import ParallelismConfig
from .schema import Config, ConfigError, check_value, field_allowed, mixed_precision_choices, parallelism_sizes

if TYPE_CHECKING:
    from ..environment.devices import DeviceFacts

__all__ = ["detect", "suggested_config", "run_wizard", "strategy_choices"]


def detect() -> Dict[str, int]:
    """What this machine has: ``{config device name: devices visible}`` for every device of the
    registry (:func:`anyaccel.backends.config_device_names`), e.g. ``{"cpu": 1, "mps": 0, "gpu": 2,
    "tpu": 0}``, from each device's probe (which never initialises CUDA). A device that its own
    launcher selects (TPU: ``DeviceFacts.selected_by``) counts 1 when torch-xla is installed and
    ``PJRT_DEVICE=TPU``, a ``TPU_*`` variable or ``/dev/accel*`` exists. Local."""
    from ..backends import config_device_names  # imports torch; kept out of module import time

    env = os.environ
    tpu_hint = env.get("PJRT_DEVICE", "").upper() == "TPU" or any(k.startswith("TPU_") for k in env)
    tpu = importlib.util.find_spec("torch_xla") is not None and (tpu_hint or bool(glob.glob("/dev/accel*")))
    counts = {}
    for name in config_device_names():
        facts = _device(name)
        counts[name] = facts.count() if facts.selected_by is None else int(tpu)
    return counts


def _facts(name: str) -> "Optional[DeviceFacts]":
    """The :class:`~anyaccel.devices.DeviceFacts` of config device ``name`` (None for ``auto``)."""
    from ..backends import config_device

    return config_device(name)


def _device(name: str) -> "DeviceFacts":
    """The facts of ``name``, a device of the registry (not ``auto``)."""
    facts = _facts(name)
    if facts is None:
        raise ValueError(f"device {name!r} is not a device of the registry here")
    return facts


def _detected_device(detected: Dict[str, Any]) -> str:
    """The device to suggest: a detected device counted here (the most preferred: GPU before MPS),
    else one its own launcher selects (TPU), else the CPU (the least preferred, always there)."""
    from ..backends import config_device_names

    names = config_device_names()  # the CPU first, the most preferred last
    found = [n for n in names[1:] if detected.get(n)]
    found.sort(key=lambda n: (_device(n).selected_by is not None, -_device(n).preference))
    return found[0] if found else names[0]


def _one_process(device: str) -> bool:
    """A device without a communication backend (Apple MPS) runs one process."""
    facts = _facts(device)
    return facts is not None and facts.communication is None


def _owns_processes(device: str) -> bool:
    """The device's runtime starts the processes itself (TPU: torch-xla decides how many)."""
    facts = _facts(device)
    return facts is not None and facts.owns_processes


def suggested_config(detected: Optional[Dict[str, Any]] = None) -> Config:
    """The configuration for this machine alone: the detected device (GPU > MPS > TPU > CPU), one
    process per device used by index (GPU; torch-xla decides on a TPU, else 1), no mixed precision.
    ``anyaccel config --default`` writes this."""
    detected = detect() if detected is None else detected
    device = _detected_device(detected)
    facts = _device(device)
    processes = None if facts.owns_processes else detected.get(device) if facts.indexed else 1
    return Config(device=device, num_processes=processes)


def _device_title(name: str, detected: Dict[str, Any]) -> str:
    """The wizard's line for config device ``name``: ``"GPU(s), CUDA (4 detected)"``, ``"CPU"``, ..."""
    from ..backends import config_device_names

    facts = _device(name)
    parts = [facts.label + ("(s)" if facts.indexed else "")]
    if facts.indexed or facts.selected_by is not None:
        parts.append(facts.device_type.upper())
    if facts.communication is None:
        parts.append("one process")
    title = ", ".join(parts)
    if name == config_device_names()[0]:  # the CPU: always there
        return title
    n = int(detected.get(name) or 0)
    if facts.indexed:
        return f"{title} ({f'{n} detected' if n else 'none detected here'})"
    return f"{title} ({'detected' if n else 'not detected here'})"


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
        except ConfigError as exc:  # a key's own words, else the row's message
            return f"Allowed: {field_allowed(exc.key)}." if exc.key in Config().to_dict() else exc.message
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
    from ..environment.network import source_address

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
    """Every question in order: where and on which device, the machines, the GPUs and processes,
    mixed precision, how the model is held, compilation; then the summary and "Save it?"."""
    import questionary

    values = _where_questions(base, detected)
    values.update(_process_questions(base, values, int(detected.get("gpu", 0))))
    device = values["device"]
    precisions = mixed_precision_choices(device)
    labels = {"no": "no (full fp32)", "bf16": "bf16", "fp16": "fp16 (slow on CPU)" if device == "cpu" else "fp16",
              "fp8": "fp8 (emulated on CPU: for testing)" if device == "cpu" else "fp8 (linear layers; H100-class GPUs)"}
    values["mixed_precision"] = _select(
        "Mixed precision?",
        [(p, labels.get(p, p)) for p in precisions],
        base.mixed_precision if base.mixed_precision in precisions else "no",
    )
    values["fp8_config"] = _fp8_questions(base, values) if values["mixed_precision"] == "fp8" else None

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


def _where_questions(base: Config, detected: Dict[str, Any]) -> Dict[str, Any]:
    """This machine or several, the device, and for several machines which one this is and how to
    reach the main one."""
    where = _select(
        "Where will the training run?",
        [("this_machine", "On this machine only"), ("several_machines", "On several machines (this is one of them)")],
        base.compute_environment,
    )
    from ..backends import config_device_names

    devices = [(name, _device_title(name, detected)) for name in reversed(config_device_names())]
    devices.append(("auto", "Decide at launch: GPUs if visible, else MPS, else CPU"))
    if where == "several_machines":  # a device without a communication backend (MPS) runs a single process
        devices = [d for d in devices if not _one_process(d[0])]
    device_default = base.device if base.device in dict(devices) else \
        _detected_device({k: v for k, v in detected.items() if not _one_process(k)})
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
    return values


def _process_questions(base: Config, values: Dict[str, Any], gpus: int) -> Dict[str, Any]:
    """Which GPUs (with GPUs) and how many processes (unless the device decides)."""
    device, out = values["device"], {}
    if device == "gpu" and gpus > 0:
        out["gpu_ids"] = _text(
            f"Which GPUs on this machine (all, or ids from 0 to {gpus - 1} such as 0,1)?",
            base.gpu_ids,
            lambda text: _gpu_ids(text, gpus),
        )
    per_machine = _processes_per_machine(base, {**values, **out}, gpus)
    if device == "auto" or _owns_processes(device):
        out["num_processes"] = None  # decided at launch: one per visible GPU (else 1), or by torch-xla
    elif _one_process(device):
        out["num_processes"] = 1
    else:
        facts = _device(device)
        hint = f"one per {facts.label}" if facts.indexed else "1, or more to try distributed code"
        what = "on each machine" if values["compute_environment"] == "several_machines" else "in total"
        per_machine = _number(f"How many processes {what} ({hint})?", per_machine, 1)
        out["num_processes"] = per_machine * values["num_machines"]
    return out


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
    none = {"fsdp_config": None, "parallelism_config": None, "deepspeed_config": None}
    if not _several_processes(values) or _owns_processes(values["device"]) or _one_process(values["device"]):
        return {"strategy": "auto", **none}
    choices = strategy_choices()
    auto = default_for_processes(2)  # what `auto` picks for several processes
    strategy = _select("How should each process hold the model?", choices,
                       base.strategy if base.strategy in dict(choices) else auto)
    if strategy == ParallelismConfig.strategy:
        return {"strategy": strategy, **none, "parallelism_config": _parallelism_questions(base, values)}
    if strategy == DeepSpeedOptions.strategy:
        return {"strategy": strategy, **none, "deepspeed_config": _deepspeed_questions(base, values)}
    if strategy != FSDPOptions.strategy:  # the follow-up questions fill fsdp_config
        # the default stays `auto` unless the file named it
        return {"strategy": "auto" if strategy == auto and base.strategy != auto else strategy, **none}
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
    return {"strategy": FSDPOptions.strategy, **none, "fsdp_config": config}


def _fp8_questions(base: Config, values: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The fp8 settings (``fp8_config``, Accelerate's keys and anyaccel's ``recipe``): the library
    (asked only where Transformer Engine is installed and the device may be a GPU), then torchao's
    recipe. The questions are the option table's rows; values left at their default are not
    written (None when all are)."""
    rows = {row.name: row for row in optionspec.section_rows("fp8_config")}
    old = dict(base.fp8_config or {})
    config: Dict[str, Any] = {}
    if values["device"] in ("gpu", "auto") and importlib.util.find_spec("transformer_engine") is not None:
        config["backend"] = _field_answer(rows["fp8_backend"], str(old.get("backend", "AO")).upper())
    if config.get("backend", "AO") == "AO":
        config["recipe"] = _field_answer(rows["fp8_recipe"], old.get("recipe", "tensorwise"))
    config = {k: v for k, v in config.items() if (k, v) not in (("backend", "AO"), ("recipe", "tensorwise"))}
    return config or None


def _deepspeed_questions(base: Config, values: Dict[str, Any]) -> Dict[str, Any]:
    """The DeepSpeed settings (``deepspeed_config``, Accelerate's keys): the ZeRO stage, then, on a
    device that has host memory apart (GPUs), where optimizer state (stages 1-3) and parameters
    (stage 3) live. The questions are the option table's rows; values left at their default are
    not written."""
    rows = {row.name: row for row in optionspec.section_rows("deepspeed_config")}
    old = dict(base.deepspeed_config or {})
    stages = [("0", "0: no sharding (DeepSpeed's engine, a full copy per process)"),
              ("1", "1: optimizer state sharded"), ("2", "2: optimizer state and gradients sharded (default)"),
              ("3", "3: parameters too (for models that do not fit one device)")]
    stage = int(_select(rows["zero_stage"].question or "zero_stage", stages, str(old.get("zero_stage", 2))))
    config: Dict[str, Any] = {"zero_stage": stage}
    if values["device"] in ("gpu", "auto"):  # on the CPU, host memory is where everything already is
        for name, stages_allowed in (("offload_optimizer_device", (1, 2, 3)), ("offload_param_device", (3,))):
            if stage in stages_allowed:
                config[name] = _field_answer(rows[name], old.get(name, "none"))
    return {k: v for k, v in config.items() if v != "none"}


def _parallelism_questions(base: Config, values: Dict[str, Any]) -> Dict[str, Any]:
    """The N-D sizes (``parallelism_config``, Accelerate's keys): one question per size row of the
    option table that has one (:func:`anyaccel.optionspec.section_rows`, in table order), each
    answer checked to divide the processes left; the last size takes what remains. Without a
    known number of processes (decided at launch) every size is asked and the product is checked
    by ``anyaccel launch``. A size added to the table with a question is asked here, unchanged.
    Then the other fields with a question (a pipeline schedule, ...), each only when the size of
    its dimension (``pp_schedule``: ``pp_size``) is above 1."""
    old = parallelism_sizes(base) or {}
    total = values.get("num_processes")
    rows = [row for row in optionspec.section_rows("parallelism_config") if row.question and row.key]
    asked = [row for row in rows if row.name.endswith("_size")]
    left, sizes = total, {}
    for i, row in enumerate(asked):
        if i == len(asked) - 1 and left is not None:  # the last one: what remains
            done = " / ".join(f"{r.name} {sizes[r.key]}" for r in asked[:-1])
            print(f"  {row.name} = {left} (the processes left: {total} / {done})")
            sizes[row.key] = left
            break
        question = row.question or row.name
        if left is not None:
            question = f"{question[:-2]}; divides {left})?" if question.endswith(")?") else f"{question} (divides {left})"
        sizes[row.key] = _size_answer(question, old.get(row.name, 1), left)
        left = None if left is None else left // sizes[row.key]
    size_of = {row.name[:-len("_size")]: sizes[row.key] for row in asked}
    for row in rows:  # the other fields: their choices, or their row's check
        if row not in asked and size_of.get(row.name.split("_")[0], 2) > 1:
            answer = _field_answer(row, old.get(row.name))
            if answer is not None:
                sizes[row.key] = answer
    return sizes


def _field_answer(row: optionspec.Option, default: Any) -> Any:
    """Ask a field of the option table: a choice among its values, else text its row checks."""
    choices = optionspec.choices_of(row)
    if choices is not None:
        options = [(str(c), str(c)) for c in choices]
        return _select(row.question or row.name, options, str(default) if default in choices else options[0][0])

    def parse(text: str) -> Any:
        return optionspec.parse_text(row, text)

    return _text(row.question or row.name, "" if default is None else str(default), parse)


def _size_answer(message: str, default: int, left: Optional[int]) -> int:
    """Ask one size; it must be >= 1 and divide ``left`` (the processes not yet given out)."""

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
