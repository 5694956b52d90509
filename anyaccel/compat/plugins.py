"""Options for sharded training and compilation, under Accelerate's names.

``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(...))`` and
``Accelerator(dynamo_plugin=TorchDynamoPlugin(...))`` take them; the config file's ``fsdp_config``
and ``dynamo_backend`` keys and ``anyaccel launch --fsdp_* / --dynamo_backend`` flags build the same
objects (:func:`fsdp_plugin_from_dict`). Local values; validated when built, so a bad value is an
error naming the field before anything starts.

anyaccel implements FSDP2 (``torch.distributed.fsdp.fully_shard``); the FSDP strategy's own
options are :class:`~anyaccel.strategies.fsdp.options.FSDPOptions`, into which this plugin converts
Accelerate's format. Fields that only FSDP1 had
(``backward_prefetch``, ``forward_prefetch``, ``limit_all_gathers``, ``use_orig_params``) are
accepted from Accelerate configs but have no FSDP2 equivalent: setting one warns, naming it.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from .. import optionspec
from ..strategies.fsdp.options import FSDP_WRAP_POLICIES, FSDPOptions

if TYPE_CHECKING:  # the module imports torch; this one is read by the launcher, which must not
    from ..strategies.compile import CompileOptions

__all__ = ["FullyShardedDataParallelPlugin", "TorchDynamoPlugin", "fsdp_plugin_from_dict", "fsdp1_keys", "FSDP_CONFIG_KEYS"]

# Accelerate's state_dict_type names -> FSDPOptions.checkpoint_format
_STATE_DICT_TYPES = {"SHARDED_STATE_DICT": "sharded", "FULL_STATE_DICT": "full"}
#: the ``state_dict_type`` names (the ``--fsdp_state_dict_type`` flag's choices, through the option table)
FSDP_STATE_DICT_TYPES = tuple(_STATE_DICT_TYPES)
_WRAP_ALIASES = {"transformer": "transformer_based_wrap", "size": "size_based_wrap", "none": "no_wrap",
                 "transformer_auto_wrap_policy": "transformer_based_wrap", "size_based_auto_wrap_policy": "size_based_wrap",
                 "no_wrap_policy": "no_wrap"}
# Accelerate / FSDP1 sharding strategies in FSDP2 terms: reshard_after_forward.
_SHARDING_STRATEGIES = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "1": True, "2": False}
_FSDP1_ONLY = ("backward_prefetch", "forward_prefetch", "limit_all_gathers", "use_orig_params")


@dataclasses.dataclass
class FullyShardedDataParallelPlugin:
    """How FSDP2 shards a model, in Accelerate's format (``Accelerator(strategy="fsdp")`` uses the
    defaults). It only converts: :meth:`to_options` gives the strategy's
    :class:`~anyaccel.strategies.fsdp.options.FSDPOptions`, which check the values.

    Args:
        fsdp_version: 2 (FSDP1 is not implemented; ``1`` is an error that says so).
        reshard_after_forward: free the gathered parameters after the forward (``True``, least
            memory) or keep them for the backward (``False``, less communication). Accelerate's
            ``sharding_strategy`` ``"FULL_SHARD"``/``"SHARD_GRAD_OP"`` map to ``True``/``False``.
        auto_wrap_policy: which submodules become their own FSDP unit (all-gathered one at a time):
            ``"transformer_based_wrap"`` (classes named in ``transformer_cls_names_to_wrap``, else
            the model's ``_no_split_modules``), ``"size_based_wrap"`` (modules with at least
            ``min_num_params`` parameters), ``"no_wrap"`` (only the root), or a callable
            ``module -> bool``. Default: class names if given, else size if ``min_num_params``
            is given, else ``_no_split_modules`` if the model has them, else the root only.
        transformer_cls_names_to_wrap: class names, e.g. ``["TransformerEncoderLayer"]``.
        min_num_params: the size threshold of ``"size_based_wrap"``.
        mixed_precision_policy: ``None`` derives it from the accelerator's ``mixed_precision``
            (parameters in bf16/fp16 for compute, gradients reduced in fp32), or a
            ``torch.distributed.fsdp.MixedPrecisionPolicy``, or a dict of its fields.
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory (GPU
            training only; the process group then gets a gloo part for the CPU tensors, set by
            anyaccel).
        activation_checkpointing: recompute the activations of each wrapped block in backward.
        state_dict_type: how ``save_state`` stores models and optimizers: ``"SHARDED_STATE_DICT"``
            (each rank writes its shard, torch.distributed.checkpoint; loadable by any number of
            processes) or ``"FULL_STATE_DICT"`` (rank 0 writes full files, as DDP does). Default:
            the kind of ``state_dict_config`` if one is given, else ``"SHARDED_STATE_DICT"``.
        state_dict_config, optim_state_dict_config: Accelerate's (torch's FSDP1 classes
            ``FullStateDictConfig``/``ShardedStateDictConfig`` and ``FullOptimStateDictConfig``/
            ``ShardedOptimStateDictConfig``, or a dict of their fields). Their class chooses the
            format (``Full*`` is ``"FULL_STATE_DICT"``, ``Sharded*`` ``"SHARDED_STATE_DICT"``); one
            that contradicts ``state_dict_type`` or the other config is an error, as is
            ``Local*`` (FSDP2 has no local state dict). ``offload_to_cpu`` and ``rank0_only`` are
            kept on the objects; what FSDP2 does with them in anyaccel: a full checkpoint is
            gathered into rank 0's host memory and written by rank 0 alone (what Accelerate forces
            for FSDP2 saves in a multi-process job, whatever the values), and read by every rank
            when loaded; a sharded one is written by each rank from where its shard lives. So
            the values change no file and no loaded weight (see the Accelerate guide).
        sync_module_states: make every rank start from rank 0's weights before sharding (as
            DDP does), so models initialised without a common seed still agree.
    """

    fsdp_version: int = 2
    reshard_after_forward: Union[bool, int, str] = True
    auto_wrap_policy: Union[None, str, Callable[[Any], bool]] = None
    transformer_cls_names_to_wrap: Optional[Sequence[str]] = None
    min_num_params: Optional[int] = None
    mixed_precision_policy: Any = None
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    state_dict_type: Optional[str] = None
    sync_module_states: bool = True
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    sharding_strategy: Optional[str] = None
    backward_prefetch: Any = None
    forward_prefetch: Any = None
    limit_all_gathers: Any = None
    use_orig_params: Any = None

    def __post_init__(self) -> None:
        """Accelerate's spellings made canonical in place (``"FULL_SHARD"``, ``"true"``, policy
        aliases, comma-separated class names, enum members), then checked by building the
        :class:`~anyaccel.strategies.fsdp.options.FSDPOptions` (errors name the field)."""
        if int(self.fsdp_version) != 2:
            raise ValueError(f"fsdp_version={self.fsdp_version!r}: anyaccel implements FSDP2 (fully_shard) only; "
                             "use fsdp_version=2 (the model, optimizer and training loop stay the same)")
        if self.sharding_strategy is not None:
            key = str(getattr(self.sharding_strategy, "name", self.sharding_strategy)).upper()
            if key not in _SHARDING_STRATEGIES:
                raise ValueError(f"sharding_strategy={self.sharding_strategy!r} has no FSDP2 equivalent in anyaccel; "
                                 "use FULL_SHARD (reshard_after_forward=True) or SHARD_GRAD_OP (False)")
            self.reshard_after_forward = _SHARDING_STRATEGIES[key]
        if isinstance(self.reshard_after_forward, str):
            text = self.reshard_after_forward.strip().upper()
            if text in _SHARDING_STRATEGIES:
                self.reshard_after_forward = _SHARDING_STRATEGIES[text]
            elif text.lower() in ("true", "false"):
                self.reshard_after_forward = text.lower() == "true"
            else:
                raise ValueError(f"reshard_after_forward={self.reshard_after_forward!r}; use True, False, an int, "
                                 "FULL_SHARD or SHARD_GRAD_OP")
        elif self.reshard_after_forward in (0, 1) and not isinstance(self.reshard_after_forward, bool):
            self.reshard_after_forward = bool(self.reshard_after_forward)
        if isinstance(self.auto_wrap_policy, str):
            policy = self.auto_wrap_policy.strip().lower().replace("-", "_")
            policy = _WRAP_ALIASES.get(policy, policy)
            if policy in FSDP_WRAP_POLICIES:  # anything else is refused by FSDPOptions, as it was given
                self.auto_wrap_policy = policy
        if isinstance(self.transformer_cls_names_to_wrap, str):
            self.transformer_cls_names_to_wrap = [n.strip() for n in self.transformer_cls_names_to_wrap.split(",") if n.strip()]
        if isinstance(self.min_num_params, str) and self.min_num_params.strip().isdigit():
            self.min_num_params = int(self.min_num_params)
        for name in ("cpu_offload", "activation_checkpointing", "sync_module_states"):
            setattr(self, name, _flag(name, getattr(self, name)))
        self.state_dict_type = _state_dict_type(self.state_dict_type, self.state_dict_config,
                                                self.optim_state_dict_config)
        for name in _FSDP1_ONLY:
            if getattr(self, name) not in (None, False):
                warnings.warn(f"FullyShardedDataParallelPlugin({name}={getattr(self, name)!r}) is an FSDP1 setting "
                              "with no FSDP2 equivalent; it has no effect", stacklevel=3)
        self.to_options()

    @classmethod
    def from_options(cls, options: FSDPOptions) -> "FullyShardedDataParallelPlugin":
        """The plugin an FSDP strategy configured by ``options`` amounts to (``accelerator.state.
        fsdp_plugin`` under ``Accelerator(strategy="fsdp")`` without a plugin: Accelerate always
        has one under FSDP). Local."""
        formats = {v: k for k, v in _STATE_DICT_TYPES.items()}
        return cls(reshard_after_forward=options.reshard_after_forward, auto_wrap_policy=options.auto_wrap_policy,
                   transformer_cls_names_to_wrap=list(options.transformer_cls_names_to_wrap) or None,
                   min_num_params=options.min_num_params, mixed_precision_policy=options.mixed_precision_policy,
                   cpu_offload=options.cpu_offload, activation_checkpointing=options.activation_checkpointing,
                   state_dict_type=formats[options.checkpoint_format], sync_module_states=options.sync_module_states)

    def set_state_dict_type(self, state_dict_type: Any = None) -> None:
        """Accelerate's: how the accelerator's next ``save_state`` / ``load_state`` store models and
        optimizers, e.g. ``"FULL_STATE_DICT"`` before the final save of a run that checkpointed
        sharded (``accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")``, as
        transformers' Trainer does). A ``StateDictType`` member, its name in any case, or FSDP1's
        number; ``None`` keeps the type (Accelerate would then read ``FSDP_STATE_DICT_TYPE``, which
        anyaccel's launcher turns into this field already). ``state_dict_config`` /
        ``optim_state_dict_config`` objects of the other kind are dropped, as they would contradict
        it. Local: call it on every rank, as Accelerate's scripts do."""
        if state_dict_type is None:
            return
        kind = _state_dict_type(state_dict_type)
        for name in ("state_dict_config", "optim_state_dict_config"):
            config = getattr(self, name)
            if config is not None and not isinstance(config, Mapping) and _CONFIG_KINDS.get(type(config).__name__) != kind:
                setattr(self, name, None)
        self.state_dict_type = kind

    def to_options(self) -> FSDPOptions:
        """These settings as the FSDP strategy's :class:`~anyaccel.strategies.fsdp.options.FSDPOptions`
        (read again on each call, so attributes changed after construction count). Local."""
        return FSDPOptions(
            reshard_after_forward=self.reshard_after_forward, auto_wrap_policy=self.auto_wrap_policy,
            transformer_cls_names_to_wrap=tuple(self.transformer_cls_names_to_wrap or ()),
            min_num_params=self.min_num_params, mixed_precision_policy=self.mixed_precision_policy,
            cpu_offload=self.cpu_offload, activation_checkpointing=self.activation_checkpointing,
            checkpoint_format=_STATE_DICT_TYPES[self.state_dict_type], sync_module_states=self.sync_module_states)


# torch's FSDP1 state-dict config classes (Accelerate's state_dict_config / optim_state_dict_config),
# by name, so that this module needs no torch: their kind is the checkpoint format they imply
_CONFIG_KINDS = {"FullStateDictConfig": "FULL_STATE_DICT", "FullOptimStateDictConfig": "FULL_STATE_DICT",
                 "ShardedStateDictConfig": "SHARDED_STATE_DICT", "ShardedOptimStateDictConfig": "SHARDED_STATE_DICT",
                 "LocalStateDictConfig": "LOCAL_STATE_DICT", "LocalOptimStateDictConfig": "LOCAL_STATE_DICT"}
_CONFIG_FIELDS = ("offload_to_cpu", "rank0_only", "_use_dtensor")


def _state_dict_type(given: Any, *configs: Any) -> str:
    """``state_dict_type`` made canonical (a ``StateDictType`` member, any case, or FSDP1's
    numbers 1/3), or, when None, the format the config objects imply; a contradiction names both."""
    kinds = []
    for name, config in zip(("state_dict_config", "optim_state_dict_config"), configs):
        if config is None:
            continue
        if isinstance(config, Mapping):
            unknown = [k for k in config if k not in _CONFIG_FIELDS]
            if unknown:
                raise ValueError(f"{name}={dict(config)!r}: unknown field(s) {unknown}; known: offload_to_cpu, "
                                 "rank0_only")
            continue  # a dict says nothing about the kind
        kind = _CONFIG_KINDS.get(type(config).__name__)
        if kind is None:
            raise ValueError(f"{name}={config!r}: pass torch.distributed.fsdp's FullStateDictConfig / "
                             "ShardedStateDictConfig (FullOptimStateDictConfig / ShardedOptimStateDictConfig for "
                             "the optimizer), a dict of their fields, or None")
        if kind == "LOCAL_STATE_DICT":
            raise ValueError(f"{name}={type(config).__name__}(...): FSDP2 has no local state dict; use "
                             f"{'FullStateDictConfig or ShardedStateDictConfig' if name == 'state_dict_config' else 'FullOptimStateDictConfig or ShardedOptimStateDictConfig'}")
        kinds.append((name, type(config).__name__, kind))
    if given is not None:
        text = str(getattr(given, "name", given)).strip().upper()
        text = {"1": "FULL_STATE_DICT", "3": "SHARDED_STATE_DICT"}.get(text, text)
        if text not in _STATE_DICT_TYPES:
            raise ValueError(f"state_dict_type={given!r}; choose {' or '.join(_STATE_DICT_TYPES)}")
        kinds.insert(0, ("state_dict_type", repr(text), text))
    if len({k for _, _, k in kinds}) > 1:
        described = ", ".join(f"{name}={what}" for name, what, _ in kinds)
        raise ValueError(f"FullyShardedDataParallelPlugin: {described} ask for different checkpoint formats; anyaccel "
                         "saves models and optimizers in one format: make them agree (Full* configs with "
                         "FULL_STATE_DICT, Sharded* configs with SHARDED_STATE_DICT)")
    return kinds[0][2] if kinds else "SHARDED_STATE_DICT"


def _flag(name: str, value: Any) -> Any:
    """``"true"``/``"false"`` (Accelerate's environment variables) as bools; None as False."""
    if value is None:
        return False
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    return value  # a bool, or something FSDPOptions refuses with the field's name


# Keys of the config file's fsdp_config (Accelerate's ``fsdp_``-prefixed names are accepted too).
FSDP_CONFIG_KEYS = ("fsdp_version", "reshard_after_forward", "auto_wrap_policy", "transformer_cls_names_to_wrap",
                    "min_num_params", "cpu_offload", "activation_checkpointing", "state_dict_type",
                    "sync_module_states", "sharding_strategy")
# Settings Accelerate writes into every FSDP config that mean nothing for FSDP2 (dropped, and listed).
FSDP1_CONFIG_KEYS = ("backward_prefetch", "forward_prefetch", "use_orig_params", "cpu_ram_efficient_loading",
                     "limit_all_gathers")


def fsdp_plugin_from_dict(values: Mapping[str, Any], source: str = "fsdp_config") -> FullyShardedDataParallelPlugin:
    """Build the plugin from a config file's ``fsdp_config``. Accelerate's ``fsdp_*`` names are
    accepted (``fsdp_offload_params`` is ``cpu_offload``, ``fsdp_transformer_layer_cls_to_wrap`` is
    ``transformer_cls_names_to_wrap``); its FSDP1-only settings
    (:data:`FSDP1_CONFIG_KEYS`) are dropped — :func:`fsdp1_keys` lists them for a note. Raises
    ``ValueError`` naming an unknown key and ``source``."""
    kwargs: Dict[str, Any] = {}
    for key, value in values.items():
        name = _canonical(key)
        if name in FSDP1_CONFIG_KEYS:
            continue
        if name not in FSDP_CONFIG_KEYS:
            raise ValueError(f"{source}: unknown FSDP setting {key!r}; known: {', '.join(FSDP_CONFIG_KEYS)}")
        kwargs[name] = value
    return FullyShardedDataParallelPlugin(**kwargs)


def fsdp1_keys(values: Mapping[str, Any]) -> List[str]:
    """The keys of ``values`` that :func:`fsdp_plugin_from_dict` drops (FSDP1-only settings)."""
    return [key for key in values if _canonical(key) in FSDP1_CONFIG_KEYS]


_ALIASES = {"offload_params": "cpu_offload", "transformer_layer_cls_to_wrap": "transformer_cls_names_to_wrap"}


def _canonical(key: str) -> str:
    name = key[len("fsdp_"):] if key.startswith("fsdp_") and key != "fsdp_version" else key
    return _ALIASES.get(name, name)


@dataclasses.dataclass
class TorchDynamoPlugin:
    """``torch.compile`` options (Accelerate's names): ``backend`` (``"inductor"``, ...; ``"no"``
    disables), ``mode`` (``"default"``, ``"reduce-overhead"``, ``"max-autotune"``), ``fullgraph``,
    ``dynamic``, ``options`` (backend options dict), ``disable``."""

    backend: Optional[str] = None
    mode: Optional[str] = None
    fullgraph: Optional[bool] = None
    dynamic: Optional[bool] = None
    options: Optional[Dict[str, Any]] = None
    disable: bool = False

    def __post_init__(self) -> None:
        if self.backend is not None:
            self.backend = str(getattr(self.backend, "value", self.backend)).lower()
        if self.mode is not None:  # the dynamo_mode option's choices and words
            self.mode = optionspec.check(optionspec.option("dynamo_mode"), self.mode, "TorchDynamoPlugin(mode=...)")

    def to_options(self) -> CompileOptions:
        """These settings as the strategies' :class:`~anyaccel.strategies.compile.CompileOptions`
        (read again on each call, so attributes changed after construction count). Local."""
        from ..strategies.compile import CompileOptions

        return CompileOptions(backend=self.backend, mode=self.mode, fullgraph=self.fullgraph, dynamic=self.dynamic,
                              options=self.options, disable=bool(self.disable))

    @property
    def enabled(self) -> bool:
        """True when models are compiled (the rule is :attr:`CompileOptions.enabled`). Local."""
        return self.to_options().enabled

    def compile_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments for ``torch.compile`` / ``nn.Module.compile`` (unset ones left out). Local."""
        return self.to_options().compile_kwargs()
