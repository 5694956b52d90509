"""The DeepSpeed strategy's options and its config's ``"auto"`` values, without importing DeepSpeed.

:class:`DeepSpeedOptions` is what the ``deepspeed`` strategy takes (Accelerate's
:class:`~anyaccel.utils.deepspeed.DeepSpeedPlugin` converts into it): the DeepSpeed config as the
user wrote it (``"auto"`` values left in), plus the settings that are not part of that config
(``zero3_init_flag``, ``is_train_batch_min``). It is checked once when made, so a bad stage or
offload device is an error before any process starts, and the launcher can check it without torch.

At ``prepare()`` the strategy fills the ``"auto"`` values from the objects prepared, with
Accelerate's rules (:func:`filled_config`): the micro-batch size from the DataLoaders, the
accumulation steps from the ``Accelerator``, ``train_batch_size`` as their product with the number
of processes, the bucket sizes from ``model.config.hidden_size``, a ``DummyOptim``'s learning rate
and weight decay, a ``DummyScheduler``'s warm-up. One rule differs, on purpose:
``gradient_clipping: "auto"`` becomes 0 (no clipping) instead of Accelerate's 1.0, because anyaccel
clips when the script calls ``accelerator.clip_grad_norm_`` (with the ``max_norm`` it gives), as
without DeepSpeed; Accelerate clips at 1.0 even in a script that never asks for it.

Everything here is local and pure; nothing communicates.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple

from ..options import StrategyOptions, _check_bool

__all__ = ["DeepSpeedOptions", "ZERO_STAGES", "OFFLOAD_DEVICES", "read_config", "get_value", "set_value",
           "auto_keys", "filled_config", "PreparedObjects", "precision_sections"]

ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
_AUTO = "auto"
# keys whose "auto" Accelerate derives from model.config.hidden_size (h): h*h, 0.9*h*h, 10*h
_HIDDEN_SIZE_KEYS = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                     "zero_optimization.stage3_param_persistence_threshold")


def read_config(source: Any, what: str = "hf_ds_config") -> Dict[str, Any]:
    """A DeepSpeed config as a new dict: ``source`` is a dict, a path to a JSON file, or JSON text
    (an object with a ``config`` dict, such as Accelerate's ``HfDeepSpeedConfig``, is accepted too).
    Raises ``ValueError`` naming ``what`` and the value."""
    config = getattr(source, "config", source)
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, (str, os.PathLike)):
        text = os.fspath(config)
        if os.path.isfile(text):
            try:
                with open(text, "r", encoding="utf-8") as fh:
                    loaded = json.load(fh)
            except (OSError, ValueError) as exc:
                raise ValueError(f"{what}={text!r}: cannot read it as a JSON DeepSpeed config: {exc}") from exc
        else:
            try:
                loaded = json.loads(text)
            except ValueError:
                raise ValueError(f"{what}={text!r} is neither an existing file nor JSON text; give a dict, the path of "
                                 "a DeepSpeed config JSON file, or its text") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"{what}={text!r}: a DeepSpeed config is a JSON object, this is a {type(loaded).__name__}")
        return loaded
    raise ValueError(f"{what} must be a dict, a JSON file path or JSON text; got {type(source).__name__}")


def get_value(config: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """``config["a"]["b"]`` for ``key="a.b"`` (``default`` where a level is missing)."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def set_value(config: Dict[str, Any], key: str, value: Any) -> None:
    """Set ``config["a"]["b"] = value`` for ``key="a.b"``, making missing levels."""
    *parents, last = key.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def auto_keys(config: Mapping[str, Any], prefix: str = "") -> List[str]:
    """Every dotted key whose value is ``"auto"``."""
    found = []
    for key, value in config.items():
        if isinstance(value, Mapping):
            found += auto_keys(value, f"{prefix}{key}.")
        elif value == _AUTO:
            found.append(prefix + key)
    return found


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepSpeedOptions(StrategyOptions):
    """How the ``deepspeed`` strategy builds its engine.

    Args:
        config: the DeepSpeed config (``zero_optimization``, ``bf16``, ``optimizer``, ...), with
            ``"auto"`` where the value should come from what is prepared. Must have a
            ``zero_optimization`` section with a ``stage`` in 0..3 (or ``"auto"``: 2, as Accelerate).
        zero3_init_flag: models built after the ``Accelerator`` (transformers' ``from_pretrained`` /
            ``from_config``) are built under ``deepspeed.zero.Init``: partitioned as they are made,
            never whole in one process. ZeRO-3 only.
        is_train_batch_min: with several DataLoaders in one ``prepare`` call, the micro-batch size
            is the smallest of their batch sizes (True) or the largest (False).
        transformer_moe_cls_names: class names of mixture-of-experts blocks that ZeRO-3 must treat
            as leaves (DeepSpeed's ``set_z3_leaf_modules``).
    """

    strategy: ClassVar[str] = "deepspeed"

    config: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {"zero_optimization": {"stage": 2}})
    zero3_init_flag: bool = False
    is_train_batch_min: bool = True
    transformer_moe_cls_names: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.config, Mapping):
            raise ValueError(f"DeepSpeedOptions(config={self.config!r}): must be a dict (the DeepSpeed config)")
        config = copy.deepcopy(dict(self.config))
        zero = config.get("zero_optimization")
        if not isinstance(zero, Mapping):
            raise ValueError("the DeepSpeed config has no zero_optimization section; add one, e.g. "
                             "\"zero_optimization\": {\"stage\": 2} (stages 0-3)")
        if zero.get("stage", 0) == _AUTO:
            config["zero_optimization"]["stage"] = 2
        stage = config["zero_optimization"].get("stage", 0)
        if isinstance(stage, bool) or stage not in ZERO_STAGES:
            raise ValueError(f"zero_optimization.stage={stage!r}: choose one of {', '.join(map(str, ZERO_STAGES))}")
        for section, allowed in (("offload_optimizer", (1, 2, 3)), ("offload_param", (3,))):
            device = get_value(config, f"zero_optimization.{section}.device", "none")
            if device is None:
                device = "none"
            if device not in OFFLOAD_DEVICES:
                raise ValueError(f"zero_optimization.{section}.device={device!r}: choose one of "
                                 f"{', '.join(OFFLOAD_DEVICES)}")
            if device != "none" and stage not in allowed:
                raise ValueError(f"zero_optimization.{section}.device={device!r} needs ZeRO stage "
                                 f"{' or '.join(map(str, allowed))}; this config has stage {stage}")
        object.__setattr__(self, "config", config)
        for name in ("zero3_init_flag", "is_train_batch_min"):
            _check_bool("DeepSpeedOptions", name, getattr(self, name))
        if self.zero3_init_flag and stage != 3:
            raise ValueError(f"DeepSpeedOptions(zero3_init_flag=True) builds models partitioned, which is ZeRO stage 3; "
                             f"this config has stage {stage}: set stage 3 or drop zero3_init_flag")
        names = self.transformer_moe_cls_names
        if isinstance(names, str):
            names = tuple(n.strip() for n in names.split(",") if n.strip())
        object.__setattr__(self, "transformer_moe_cls_names", tuple(names or ()))

    @property
    def zero_stage(self) -> int:
        stage: int = self.config["zero_optimization"].get("stage", 0)
        return stage

    def config_dict(self) -> Dict[str, Any]:
        """A new copy of the config (``"auto"`` values still in). Local."""
        return copy.deepcopy(dict(self.config))


def precision_sections(config: Dict[str, Any], mixed_precision: str) -> None:
    """Make the config's ``fp16``/``bf16`` sections say what the ``Accelerator``'s
    ``mixed_precision`` says (Accelerate's ``set_mixed_precision``): the chosen one enabled (an
    ``"auto"`` ``enabled`` filled), the other disabled. Raises ``ValueError`` when the config enables
    the other one explicitly. In place; local."""
    wanted = {"fp16": mixed_precision == "fp16", "bf16": mixed_precision == "bf16"}
    for name, on in wanted.items():
        other = "bf16" if name == "fp16" else "fp16"
        enabled = get_value(config, f"{other}.enabled")
        if on and enabled is True:
            raise ValueError(f"mixed_precision={mixed_precision!r} but the DeepSpeed config enables {other}; "
                             f"make them agree (set \"{other}\": {{\"enabled\": \"auto\"}} to follow mixed_precision)")
    for name, on in wanted.items():
        section = config.setdefault(name, {})
        if not isinstance(section, dict):
            raise ValueError(f"the DeepSpeed config's {name} section must be an object, not {section!r}")
        if section.get("enabled", _AUTO) == _AUTO or on:
            section["enabled"] = on
    if mixed_precision == "fp16":
        config["fp16"].setdefault("auto_cast", True)  # fp32 inputs cast to half in the engine's forward


@dataclasses.dataclass
class PreparedObjects:
    """What one ``prepare()`` call gave that the ``"auto"`` values come from."""

    num_processes: int
    gradient_accumulation_steps: int
    batch_sizes: Sequence[Optional[int]] = ()
    split_batches: bool = False
    hidden_size: Optional[int] = None
    optimizer_lr: Optional[float] = None  # a DummyOptim's
    optimizer_weight_decay: Optional[float] = None
    scheduler_warmup_steps: Optional[int] = None  # a DummyScheduler's
    scheduler_total_steps: Optional[int] = None
    scheduler_max_lr: Optional[float] = None


def filled_config(options: DeepSpeedOptions, prepared: PreparedObjects, mixed_precision: str) -> Dict[str, Any]:
    """The DeepSpeed config with every ``"auto"`` value filled from ``prepared`` (see the module
    docstring for the rules). Raises ``ValueError`` naming a key that stays ``"auto"`` and what
    would fill it. Local."""
    config = options.config_dict()
    precision_sections(config, mixed_precision)
    sizes = [b for b in prepared.batch_sizes if b is not None]
    if prepared.split_batches:
        sizes = [b // prepared.num_processes for b in sizes]
    micro = (min(sizes) if options.is_train_batch_min else max(sizes)) if sizes else 1
    gas = prepared.gradient_accumulation_steps
    values: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    }
    explicit_micro = config.get("train_micro_batch_size_per_gpu", _AUTO)
    if explicit_micro != _AUTO:
        micro = explicit_micro
    explicit_gas = config.get("gradient_accumulation_steps", _AUTO)
    if explicit_gas != _AUTO:
        gas = explicit_gas
    values["train_batch_size"] = micro * gas * prepared.num_processes
    if prepared.hidden_size:
        h = prepared.hidden_size
        values.update({_HIDDEN_SIZE_KEYS[0]: h * h, _HIDDEN_SIZE_KEYS[1]: int(0.9 * h * h),
                       _HIDDEN_SIZE_KEYS[2]: 10 * h})
    if prepared.optimizer_lr is not None:
        values["optimizer.params.lr"] = prepared.optimizer_lr
        values["optimizer.params.weight_decay"] = prepared.optimizer_weight_decay
    if prepared.scheduler_warmup_steps is not None:
        values["scheduler.params.warmup_min_lr"] = 0
        values["scheduler.params.warmup_max_lr"] = prepared.scheduler_max_lr
        values["scheduler.params.warmup_num_steps"] = max(1, prepared.scheduler_warmup_steps)
        if prepared.scheduler_total_steps is not None:
            total = prepared.scheduler_total_steps
            values["scheduler.params.total_num_steps"] = (total if prepared.split_batches
                                                          else math.ceil(total / prepared.num_processes))
    for key in auto_keys(config):
        if key not in values:
            hint = ("a model whose config has hidden_size (or replace \"auto\" with a number)"
                    if key in _HIDDEN_SIZE_KEYS else "replace \"auto\" with a value")
            raise ValueError(f"the DeepSpeed config's {key} is \"auto\" and nothing prepared fills it: {hint}")
        set_value(config, key, values[key])
    # DeepSpeed checks train_batch_size = micro * accumulation * processes; keep it consistent
    # with the filled values when the config left it out.
    config.setdefault("train_micro_batch_size_per_gpu", micro)
    config.setdefault("gradient_accumulation_steps", gas)
    if "train_batch_size" not in config:
        config["train_batch_size"] = config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] \
            * prepared.num_processes
    config.setdefault("steps_per_print", 2**62)  # DeepSpeed's progress lines off, as Accelerate does
    return config
