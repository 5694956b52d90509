"""``anyaccel.utils.deepspeed``: Accelerate's DeepSpeed names, working (the ``deepspeed`` strategy).

* :class:`DeepSpeedPlugin` — Accelerate's fields and defaults; ``Accelerator(deepspeed_plugin=...)``
  takes it and trains through a real DeepSpeed engine (ZeRO 0-3), on CPUs too.
  :meth:`DeepSpeedPlugin.to_options` gives the strategy's
  :class:`~anyaccel.strategies.deepspeed.config.DeepSpeedOptions`.
* :class:`DummyOptim` / :class:`DummyScheduler` — stand-ins for an optimizer and a scheduler
  defined in the DeepSpeed config (``"optimizer"`` / ``"scheduler"`` sections), as in Accelerate.
* :class:`HfDeepSpeedConfig` — a config dict with Accelerate's query methods.

Unlike Accelerate's, :class:`DeepSpeedPlugin` reads no ``ACCELERATE_DEEPSPEED_*`` variables: a field
left at None takes Accelerate's default. The launcher's settings (``anyaccel launch --zero_stage``,
a config file's ``deepspeed_config``) reach a plain ``Accelerator()`` through those variables, read
once into its ``WorkerSettings``, which :func:`deepspeed_plugin_from_settings` turns into the plugin. Importing this module does not import DeepSpeed; building an engine
does, and says ``pip install anyaccel[deepspeed]`` when it is missing. Local values; nothing here
communicates.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from ...strategies.deepspeed.config import DeepSpeedOptions, OFFLOAD_DEVICES, get_value, read_config, set_value
from ._refuse import refused_names

__all__ = ["DeepSpeedPlugin", "deepspeed_plugin_from_settings", "DummyOptim", "DummyScheduler", "HfDeepSpeedConfig", "DeepSpeedEngineWrapper",
           "DeepSpeedOptimizerWrapper", "DeepSpeedSchedulerWrapper", "get_active_deepspeed_plugin",
           "map_pytorch_optim_to_deepspeed"]

# plugin field -> the DeepSpeed config key it sets (Accelerate's mapping)
_FIELD_KEYS = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}


class HfDeepSpeedConfig:
    """A DeepSpeed config (a dict, a JSON file path or JSON text) with Accelerate's query methods:
    :meth:`get_value` (``"zero_optimization.stage"``), :meth:`is_zero3`, :meth:`is_offload`. Local."""

    def __init__(self, config_file_or_dict: Any):
        self.config: Dict[str, Any] = read_config(config_file_or_dict, what="config_file_or_dict")

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        return get_value(self.config, ds_key_long, default)

    def is_true(self, ds_key_long: str) -> bool:
        value = self.get_value(ds_key_long)
        return False if value is None else bool(value)

    def is_false(self, ds_key_long: str) -> bool:
        value = self.get_value(ds_key_long)
        return False if value is None else not bool(value)

    def is_zero2(self) -> bool:
        return self.get_value("zero_optimization.stage", -1) == 2

    def is_zero3(self) -> bool:
        return self.get_value("zero_optimization.stage", -1) == 3

    def is_offload(self) -> bool:
        devices = {self.get_value("zero_optimization.offload_optimizer.device"),
                   self.get_value("zero_optimization.offload_param.device")}
        return (self.is_zero2() or self.is_zero3()) and bool(devices & {"cpu", "nvme"})


@dataclasses.dataclass
class DeepSpeedPlugin:
    """DeepSpeed options in Accelerate's format: ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(...))``
    (or ``strategy="deepspeed"`` for the defaults) trains through a DeepSpeed engine.

    Args:
        hf_ds_config: a DeepSpeed config (dict, JSON file path or JSON text). Given, it is the
            config, and the fields below fill only its ``"auto"`` values (then are read back from it);
            not given, the config is built from the fields.
        gradient_accumulation_steps: ``None``/``"auto"``: the ``Accelerator``'s.
        gradient_clipping: a number clips every step at it (DeepSpeed's own clipping); ``None``/
            ``"auto"``: clipping happens where the script calls ``accelerator.clip_grad_norm_``
            (Accelerate clips at 1.0 then; see docs/guides/deepspeed.md).
        zero_stage: 0, 1, 2 or 3 (default 2, Accelerate's).
        is_train_batch_min: with several DataLoaders in one ``prepare``, the micro-batch size is the
            smallest batch size (True) or the largest.
        offload_optimizer_device / offload_param_device: ``"none"`` (default), ``"cpu"`` or ``"nvme"``
            (optimizer: stages 1-3; parameters: stage 3).
        offload_optimizer_nvme_path / offload_param_nvme_path: where ``"nvme"`` offload writes.
        zero3_init_flag: build models made after the ``Accelerator`` under ``deepspeed.zero.Init``
            (transformers' ``from_pretrained``/``from_config``): partitioned as they are built. Default:
            True for stage 3.
        zero3_save_16bit_model: ``get_state_dict``/``save_model`` under ZeRO-3 give the 16-bit weights
            the engine computes with (default False: the fp32 master weights).
        transformer_moe_cls_names: comma-separated mixture-of-experts block classes (ZeRO-3 leaves).
        enable_msamp / msamp_opt_level: MS-AMP fp8 is not available in anyaccel (True is an error).
    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: Any = None
    gradient_clipping: Any = None
    zero_stage: Optional[int] = None
    is_train_batch_min: bool = True
    offload_optimizer_device: Optional[str] = None
    offload_param_device: Optional[str] = None
    offload_optimizer_nvme_path: Optional[str] = None
    offload_param_nvme_path: Optional[str] = None
    zero3_init_flag: Optional[bool] = None
    zero3_save_16bit_model: Optional[bool] = None
    transformer_moe_cls_names: Optional[str] = None
    enable_msamp: Optional[bool] = None
    msamp_opt_level: Optional[str] = None

    def __post_init__(self) -> None:
        """Accelerate's defaults for fields left at None, the config built (or the given one's
        ``"auto"`` values filled from the fields), then checked by building the options (errors
        name the field or config key). Longer than 60 lines: it is Accelerate's
        ``DeepSpeedPlugin.__post_init__`` field by field, kept in its order so the two can be read
        side by side."""
        # the fields as given (None: not given), for the launcher's settings to fill the rest later
        # (:func:`with_launcher_settings`), as Accelerate's plugin fills them from its variables
        self._given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
        if self.enable_msamp:
            raise ValueError("DeepSpeedPlugin(enable_msamp=True): anyaccel has no MS-AMP fp8 training; use "
                             "mixed_precision='bf16' (or 'fp16')")
        if self.gradient_accumulation_steps is None:
            self.gradient_accumulation_steps = "auto"
        if self.gradient_clipping is None:
            self.gradient_clipping = "auto"
        for name in ("offload_optimizer_device", "offload_param_device"):
            value = getattr(self, name)
            value = "none" if value is None else str(value).lower()
            if value not in OFFLOAD_DEVICES:
                raise ValueError(f"DeepSpeedPlugin({name}={getattr(self, name)!r}): choose one of "
                                 f"{', '.join(OFFLOAD_DEVICES)}")
            setattr(self, name, value)
        if self.offload_optimizer_nvme_path is None:
            self.offload_optimizer_nvme_path = "none"
        if self.offload_param_nvme_path is None:
            self.offload_param_nvme_path = "none"
        given = self.hf_ds_config is not None and not (isinstance(self.hf_ds_config, str) and self.hf_ds_config == "none")
        if given:
            config = HfDeepSpeedConfig(self.hf_ds_config).config
            if "zero_optimization" not in config:
                raise ValueError("hf_ds_config has no zero_optimization section; add one, e.g. "
                                 "\"zero_optimization\": {\"stage\": 2}")
            config.setdefault("gradient_accumulation_steps", 1)
            if self.zero_stage is None:
                self.zero_stage = config["zero_optimization"].get("stage", 2)
            if self.zero3_save_16bit_model is None:
                self.zero3_save_16bit_model = False
            for field, key in _FIELD_KEYS.items():  # fields fill the config's "auto" values only
                if get_value(config, key) == "auto":
                    set_value(config, key, getattr(self, field))
            for field, key in _FIELD_KEYS.items():  # and are read back from the config
                value = get_value(config, key)
                if value is not None and value != "auto":
                    setattr(self, field, value)
        else:
            if self.zero_stage is None:
                self.zero_stage = 2
            if self.zero3_save_16bit_model is None:
                self.zero3_save_16bit_model = False
            config = {
                "train_batch_size": "auto",
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "zero_optimization": {
                    "stage": self.zero_stage,
                    "offload_optimizer": {"device": self.offload_optimizer_device},
                    "offload_param": {"device": self.offload_param_device},
                    "stage3_gather_16bit_weights_on_model_save": self.zero3_save_16bit_model,
                },
                "gradient_clipping": self.gradient_clipping,
            }
            for section, path in (("offload_optimizer", self.offload_optimizer_nvme_path),
                                  ("offload_param", self.offload_param_nvme_path)):
                if config["zero_optimization"][section]["device"] == "nvme":
                    config["zero_optimization"][section]["nvme_path"] = path
            self.hf_ds_config = HfDeepSpeedConfig(config)
        if not isinstance(self.hf_ds_config, HfDeepSpeedConfig):
            self.hf_ds_config = HfDeepSpeedConfig(config)
        self.hf_ds_config.config = config
        stage3 = get_value(config, "zero_optimization.stage") == 3
        if self.zero3_init_flag is None:
            self.zero3_init_flag = stage3
        elif self.zero3_init_flag and not stage3:
            warnings.warn("DeepSpeedPlugin(zero3_init_flag=True) applies to ZeRO stage 3 only; this config has stage "
                          f"{get_value(config, 'zero_optimization.stage')}, so models are built whole", stacklevel=3)
            self.zero3_init_flag = False
        self.to_options()

    @property
    def deepspeed_config(self) -> Dict[str, Any]:
        """The DeepSpeed config (Accelerate's attribute; ``"auto"`` values are filled at ``prepare``)."""
        config: Dict[str, Any] = self.hf_ds_config.config
        return config

    def is_auto(self, ds_key_long: str) -> bool:
        return self.hf_ds_config.get_value(ds_key_long) == "auto"

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        return self.hf_ds_config.get_value(ds_key_long, default)

    def is_zero3_init_enabled(self) -> bool:
        return bool(self.zero3_init_flag)

    def to_options(self) -> DeepSpeedOptions:
        """These settings as the strategy's :class:`DeepSpeedOptions` (read again on each call).
        Local."""
        return DeepSpeedOptions(config=self.hf_ds_config.config, zero3_init_flag=bool(self.zero3_init_flag),
                                is_train_batch_min=bool(self.is_train_batch_min),
                                transformer_moe_cls_names=self.transformer_moe_cls_names or ())


#: option names of the ``deepspeed_config`` rows (:mod:`anyaccel.optionspec`) that are named
#: otherwise on the plugin
_SETTING_FIELDS = {"deepspeed_config_file": "hf_ds_config", "deepspeed_moe_layer_cls_names": "transformer_moe_cls_names"}
_LAUNCHER_ONLY = ("deepspeed_multinode_launcher",)  # how machines start: nothing for the plugin


def deepspeed_plugin_from_settings(settings: Dict[str, Any], source: str = "deepspeed_config") -> DeepSpeedPlugin:
    """The :class:`DeepSpeedPlugin` of the launcher's DeepSpeed settings (the option table's
    ``deepspeed_config`` rows by name: ``zero_stage``, ``deepspeed_config_file``, ...; each already
    checked by its row); settings not given take the plugin's own defaults, as Accelerate's
    ``DeepSpeedPlugin()`` does under ``accelerate launch --use_deepspeed``. With a
    ``deepspeed_config_file``, a setting fills the file's ``"auto"`` (or missing) value; one the file
    sets to another value is a ``ValueError`` naming both (instead of one of them being ignored).
    The launcher calls it to check the settings before any process starts; every worker's
    ``Accelerator()`` to build its plugin. ``source`` starts the messages (empty: the caller
    names the place). Local."""
    prefix = f"{source}: " if source else ""
    kwargs = {_SETTING_FIELDS.get(name, name): value for name, value in settings.items()
              if value is not None and name not in _LAUNCHER_ONLY}
    try:
        return DeepSpeedPlugin(**_with_config_file(kwargs))
    except ValueError as exc:
        raise ValueError(f"{prefix}{exc}") from None


def with_launcher_settings(plugin: DeepSpeedPlugin, settings: Dict[str, Any]) -> Tuple[DeepSpeedPlugin, List[str]]:
    """``plugin`` (``Accelerator(deepspeed_plugin=...)``) with the fields its script left ``None``
    taken from the launcher's DeepSpeed settings, as Accelerate's ``DeepSpeedPlugin`` reads
    ``ACCELERATE_DEEPSPEED_*`` for them: ``DeepSpeedPlugin(gradient_clipping=1.0)`` under
    ``--zero_stage 3`` trains at stage 3 with either library. Returns (the plugin — a new one when
    something was filled, ``plugin`` otherwise —, the settings not used because the script set
    them). Local."""
    given: Dict[str, Any] = dict(getattr(plugin, "_given", {}))
    fill: Dict[str, Any] = {}
    unused: List[str] = []
    for name, value in settings.items():
        if value is None or name in _LAUNCHER_ONLY:
            continue
        field = _SETTING_FIELDS.get(name, name)
        if field in given:
            unused.append(name)
        else:
            fill[field] = value
    if not fill:
        return plugin, unused
    return DeepSpeedPlugin(**given, **fill), unused


def _with_config_file(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``kwargs`` with ``hf_ds_config`` (a file's path) read, the settings beside it written into
    its ``"auto"`` or missing values; a value the file sets otherwise is a ``ValueError``."""
    path = kwargs.get("hf_ds_config")
    if path is None:
        return kwargs
    config = read_config(path, what="deepspeed_config_file")
    for field, key in _FIELD_KEYS.items():
        value = kwargs.get(field)
        if value is None:
            continue
        in_file = get_value(config, key)
        if in_file not in (None, "auto") and in_file != value:
            raise ValueError(f"{field} is {value!r} but the DeepSpeed config file {path} sets {key} to {in_file!r}; "
                             "set it in one place (or write \"auto\" in the file)")
        set_value(config, key, value)
    return dict(kwargs, hf_ds_config=config)


class DummyOptim(torch.optim.Optimizer):
    """The optimizer defined in the DeepSpeed config's ``"optimizer"`` section, standing in the
    training script (Accelerate's ``DummyOptim``): ``prepare(model, DummyOptim(model.parameters(),
    lr=...), ...)`` returns the optimizer DeepSpeed built; ``lr`` and ``weight_decay`` fill that
    section's ``"auto"`` values. It cannot step by itself: under another strategy its ``step``
    raises, saying so."""

    def __init__(self, params: Iterable[Any], lr: float = 0.001, weight_decay: float = 0, **kwargs: Any):
        # Deliberately no super().__init__: nothing is optimized here (DeepSpeed builds the optimizer).
        self.params = list(params)
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs
        self.defaults = {"lr": lr, "weight_decay": weight_decay, **kwargs}
        self.state: Dict[Any, Any] = {}
        groups = self.params if self.params and isinstance(self.params[0], dict) else [{"params": self.params}]
        self.param_groups = [dict(self.defaults, **g) for g in groups]

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        raise RuntimeError("DummyOptim stands for the optimizer of a DeepSpeed config and cannot step by itself: prepare "
                           "it with Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...)) whose config has an "
                           "\"optimizer\" section, or use a torch optimizer")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.step()

    def state_dict(self) -> Dict[str, Any]:
        return {"state": {}, "param_groups": []}

    def __repr__(self) -> str:
        return f"DummyOptim(lr={self.lr}, weight_decay={self.weight_decay})"


class DummyScheduler(torch.optim.lr_scheduler.LRScheduler):
    """The scheduler defined in the DeepSpeed config's ``"scheduler"`` section (Accelerate's
    ``DummyScheduler``): ``total_num_steps`` and ``warmup_num_steps`` fill that section's ``"auto"``
    values; ``lr_scheduler_callable(optimizer)`` builds a scheduler instead when the config has
    none. DeepSpeed steps it with the optimizer; it cannot step by itself."""

    def __init__(self, optimizer: Any, total_num_steps: Optional[int] = None, warmup_num_steps: int = 0,
                 lr_scheduler_callable: Optional[Callable[[Any], Any]] = None, **kwargs: Any):
        # Deliberately no super().__init__: DeepSpeed builds and steps the scheduler.
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs

    def step(self, epoch: Optional[int] = None) -> None:
        raise RuntimeError("DummyScheduler stands for the scheduler of a DeepSpeed config and cannot step by itself: "
                           "prepare it with a DeepSpeed Accelerator together with its DummyOptim")

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def __repr__(self) -> str:
        return f"DummyScheduler(total_num_steps={self.total_num_steps}, warmup_num_steps={self.warmup_num_steps})"


def get_active_deepspeed_plugin(state: Any) -> Any:
    """The :class:`DeepSpeedPlugin` of ``state`` (an ``AcceleratorState``); ``ValueError`` when its
    accelerator does not use DeepSpeed (Accelerate's rule). Local."""
    plugin = getattr(state, "deepspeed_plugin", None)
    if plugin is None:
        raise ValueError("this Accelerator does not use DeepSpeed: create it with "
                         "Accelerator(deepspeed_plugin=DeepSpeedPlugin(...)) or strategy='deepspeed'")
    return plugin


def map_pytorch_optim_to_deepspeed(optimizer: torch.optim.Optimizer) -> Any:
    """DeepSpeed's CPU optimizer for a torch optimizer (``DeepSpeedCPUAdam``, ``adamw_mode`` for
    ``AdamW``; ``DeepSpeedCPUAdagrad`` for ``Adagrad``) over the same param groups, with the same
    ``lr`` and ``weight_decay`` (Accelerate's function: optimizer offload needs DeepSpeed's CPU
    optimizers, which JIT-compile on first use). Local."""
    from ...strategies.deepspeed import cpu_optimizer_for

    return cpu_optimizer_for(optimizer)


# Accelerate's internal wrappers: in anyaccel the strategy drives the engine behind the usual
# AcceleratedOptimizer / AcceleratedScheduler, so these have no use of their own.
globals().update(refused_names("deepspeed_internal", ["DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper",
                                                      "DeepSpeedSchedulerWrapper"]))
