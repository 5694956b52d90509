"""The Strategy interface: how a model is wrapped across processes.

One subclass per way of wrapping, one file each (``single.py``, ``ddp.py``, ``xla.py``), chosen once
per ``Accelerator`` by :func:`anyaccel.strategies.create_strategy`. The ``Accelerator`` asks its
strategy to prepare models and optimizers, for the gradient-sync context of accumulation
micro-steps, for what happens before an optimizer step and before clipping, and for the model and
optimizer state that checkpoints store.

Where things happen in :meth:`Strategy.prepare_model`: move the model with the backend, then wrap
it. A compile step belongs between the two (PyTorch's advice: compile the inner module, then wrap
it with DDP/FSDP), so that ``unwrap`` and state dicts see the user's module underneath.

Options and capabilities: a strategy takes one frozen options object (its ``options_type``, e.g.
:class:`~.options.DDPOptions`; None: the defaults) and answers, through methods rather than tests
of its name in the façade, what Accelerate reports for it (:attr:`Strategy.distributed_type`),
whether ranks may run different numbers of batches (:meth:`Strategy.join_uneven_inputs`), how
a gradient sync is forced in one backward (:meth:`Strategy.sync_in_backward`) and whether its
state dicts are collective (:attr:`Strategy.collective_state_dict`).

State in checkpoints: :meth:`Strategy.model_state_dict` returns the *full* state dict with the
user's key names (no ``module.`` or ``_orig_mod.`` prefixes). ``checkpoint_format`` names how
``save_state`` stores models and optimizers: ``"full"`` (the main process writes one file per
model and optimizer) is implemented by :mod:`anyaccel.checkpoint.training_state`; a sharded
strategy (FSDP2 through torch.distributed.checkpoint) implements :meth:`save_sharded` /
:meth:`load_sharded` instead.
"""

from __future__ import annotations

import contextlib
from typing import (TYPE_CHECKING, Any, Callable, ClassVar, ContextManager, Dict, Iterable, List, Optional, Protocol,
                    Sequence, Type)

import torch

from ..environment import DistributedType
from . import compile as compiling

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Strategy", "MeshStrategy"]

_NULL = contextlib.nullcontext()


class Strategy:
    """Default behaviour: one process, the model used as it is. Subclasses override."""

    #: the name users pass (``Accelerator(strategy=...)``) and checkpoints record
    name: ClassVar[str] = ""
    #: how ``save_state`` stores models and optimizers ("full", or "sharded")
    checkpoint_format: str = "full"
    #: True when state dicts are gathered across processes (every rank must ask for them)
    collective_state_dict: ClassVar[bool] = False
    #: True when a full checkpoint is read by rank 0 alone and broadcast into the model and
    #: optimizer (Accelerate's rank0_only loading under FSDP2): in a multi-process job the other
    #: ranks pass ``{}`` to ``load_model_state_dict`` / ``load_optimizer_state_dict``
    loads_full_state_on_rank0: ClassVar[bool] = False
    #: the class of this strategy's options (a frozen dataclass); None: it takes none
    options_type: ClassVar[Optional[type]] = None
    #: True when the strategy's engine scales the fp16 loss itself (DeepSpeed): no torch GradScaler
    owns_loss_scaling: ClassVar[bool] = False

    def __init__(self, env: Any, backend: Any, options: Any = None, mixed_precision: str = "no",
                 dynamo: Optional[compiling.CompileOptions] = None):
        """``options``: an instance of :attr:`options_type` (None: its defaults). ``mixed_precision``:
        the accelerator's setting. ``dynamo``: the :class:`~.compile.CompileOptions` when models are
        compiled (None: they are not). Raises ``TypeError`` for options of another kind."""
        self.env = env
        self.backend = backend
        self.options = _checked_options(type(self), options)
        self.mixed_precision = mixed_precision
        self.dynamo = dynamo

    # ---- what it is, and what it can do --------------------------------------------------------
    @property
    def distributed_type(self) -> DistributedType:
        """What Accelerate reports for this job (``accelerator.distributed_type``): the
        environment's (``NO``, ``MULTI_CPU``, ``MULTI_GPU``, ``XLA``) unless the strategy is one
        Accelerate names itself (FSDP). Local."""
        kind: DistributedType = self.env.distributed_type
        return kind

    def join_uneven_inputs(self, joinables: Sequence[Any]) -> Optional[ContextManager[Any]]:
        """A context in which ranks may run different numbers of batches (ranks that run out keep
        answering the others' collectives), over ``joinables``; None when this strategy cannot
        (the ``Accelerator`` then warns and runs the block as it is). Collective: every rank
        enters it."""
        return None

    def sync_in_backward(self, model: torch.nn.Module) -> ContextManager[Any]:
        """A context in which ``model``'s backward synchronises gradients even after forwards
        that skipped it (accumulation micro-steps); a null context where gradients are never
        held back (default). Collective inside: every rank uses it for the same backward."""
        return _NULL

    def data_parallel(self) -> "tuple[int, int]":
        """``(rank, size)`` among the processes that see different batches: loaders shard by it.
        Default: every process (``(env.rank, env.world_size)``); the ``nd`` strategy's TP ranks
        share one. Local."""
        return self.env.rank, self.env.world_size

    def pipeline_for(self, model: torch.nn.Module) -> Any:
        """The pipeline schedule that runs ``model`` when this strategy cut it into stages
        (``Accelerator.pipeline_step`` steps through it), else None (default: never). Local."""
        return None
    def sequence_slice(self) -> "tuple[int, int, Optional[int]]":
        """``(rank, size, length)``: which of ``size`` slices of every sequence this process keeps
        from the batches of a prepared loader, and the sequence length every batch must have (None:
        any). Default ``(0, 1, None)``: whole sequences. Local."""
        return 0, 1, None

    def sequence_group(self) -> Any:
        """Sequence parallelism for this job (:class:`~.sequence.SequenceGroup`): the ``sp`` group
        and the processes whose tokens make one global batch. Default: no ``sp`` (size 1), every
        process's tokens counted, gradients averaged over all of them (DDP, FSDP). Local here;
        the ``nd`` strategy's builds groups the first time (collective)."""
        from .sequence import SequenceGroup

        world = self.env.world_size
        if world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            return SequenceGroup(group=None, size=1, rank=0, loss_group=torch.distributed.group.WORLD, loss_size=world)
        return SequenceGroup(group=None, size=1, rank=0)

    def keeps_metrics_share(self) -> bool:
        """Whether this process's inputs to ``gather_for_metrics`` count (False on all but one
        process of a group that sees the same batch). Local."""
        return True

    # ---- the process group ------------------------------------------------------------------------
    def process_group_backend(self, backend: Optional[str]) -> Optional[str]:
        """The torch.distributed backend the group is created with (the environment's, by default)."""
        return backend

    def setup_process_group(self) -> None:
        """Called once the group is joined (or when there is none to join). Local."""

    # ---- models -----------------------------------------------------------------------------
    def begin_prepare(self, objects: Sequence[Any], *, gradient_accumulation_steps: int, split_batches: bool) -> None:
        """Called once per ``prepare()`` call with every object given, before any is prepared: a
        strategy that builds its engine from several of them together (DeepSpeed: model, optimizer,
        scheduler, the loaders' batch size) records them here. Default: nothing. Local."""

    def prepare_model(self, model: torch.nn.Module, device_placement: bool, evaluation_mode: bool) -> torch.nn.Module:
        """Move ``model`` to the device (when ``device_placement``) and wrap it for training
        across processes (unless ``evaluation_mode`` or it has nothing to train). Collective for
        strategies whose wrapping communicates (DDP broadcasts rank 0's weights)."""
        if device_placement:
            model = self.backend.move_model(model)
        model = self.compile(model)
        if evaluation_mode or not any(p.requires_grad for p in model.parameters()):
            return model
        return self.wrap(model)

    def compile(self, model: torch.nn.Module) -> torch.nn.Module:
        """Compile the user's module in place when compile is on (same object, same parameter
        names; :mod:`anyaccel.strategies.compile` says which frame Dynamo compiles and why), before
        any wrapper is put around it: PyTorch's advice for DDP and FSDP2. A model the user compiled
        already (``torch.compile(model)``, ``model.compile()``) is left compiled as it is — except
        ``model.compile()`` on a torch.nn container, which compiles nothing and is compiled again
        with this accelerator's options. Either way the model's first call warns once if Dynamo
        compiled nothing for it. Local."""
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            return model  # wrapped by the user already: the strategy's wrap() says what it does with it
        dynamo = self.dynamo if self.dynamo is not None and self.dynamo.enabled else None
        reason = compiling.user_compile_reason(model)
        if compiling.compiled_by_user(model) and not (dynamo is not None and reason):
            return compiling.watch_first_call(model, reason=reason)
        if dynamo is None:
            return model
        return compiling.compile_in_place(model, dynamo.compile_kwargs())

    def compile_block(self, block: torch.nn.Module) -> None:
        """Compile in place a block that a wrapper makes a unit of its own (an FSDP2 block, whose
        hooks break the root's graph at the block's call: compiled on its own, the block's forward
        is still compiled — torchtitan's order, compile per block then shard). No check of its own:
        the model's first-call check counts the blocks' graphs. Nothing when compile is off or the
        block was compiled by the user. Local."""
        if self.dynamo is not None and self.dynamo.enabled and not compiling.compiled_by_user(block):
            compiling.compile_in_place(block, self.dynamo.compile_kwargs(), watch=False)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The training wrapper around a model already on its device (default: none)."""
        return model

    def unwrap(self, model: torch.nn.Module, keep_torch_compile: bool = False) -> torch.nn.Module:
        """The user's module inside whatever wrappers were put around it (DDP; ``torch.compile``'s
        wrapper too, unless ``keep_torch_compile``). A module compiled in place comes back as it is,
        compiled (state dicts, checkpoints); ``Accelerator.unwrap_model(keep_torch_compile=False)``
        makes the uncompiled copy (:func:`~anyaccel.strategies.compile.without_compile`). Local."""
        return unwrap_module(model, keep_torch_compile=keep_torch_compile)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """The LR scheduler to wrap (a strategy whose engine owns the scheduler returns what stands
        for it). Default: unchanged. Local."""
        return scheduler

    # ---- the training step ------------------------------------------------------------------
    def backward_function(self) -> Optional[Callable[..., None]]:
        """``fn(loss, sync, **kwargs)`` that runs the backward of a loss (already divided for
        accumulation) where an engine must run it (DeepSpeed); ``sync``: this micro-step ends an
        accumulation group. None (default): ``loss.backward()``. Asked once per ``Accelerator``."""
        return None

    def sync_context(self, models: Sequence[torch.nn.Module], sync: bool) -> Any:
        """The context for one accumulation micro-step: a null context when gradients ``sync``,
        else one that keeps gradients local to the process (no communication in backward)."""
        return _NULL

    def before_optimizer_step(self) -> Optional[Callable[[torch.optim.Optimizer], None]]:
        """A function the prepared optimizer calls with the wrapped optimizer just before each real
        step (None: nothing to do). Collective when it communicates."""
        return None

    def before_clipping(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Make gradients final before they are clipped (where the step would otherwise reduce
        them later). Collective when it communicates."""

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients' global norm; return that norm (the same on every process)."""
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.nn.Parameter], clip_value: float) -> None:
        """Clamp every gradient to ``[-clip_value, clip_value]``."""
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, models: List[torch.nn.Module]) -> torch.optim.Optimizer:
        """The optimizer to wrap, given the models prepared so far (a sharding strategy rebuilds
        its param groups on the sharded parameters). Default: unchanged."""
        return optimizer

    # ---- state ------------------------------------------------------------------------------
    def model_state_dict(self, model: torch.nn.Module) -> Dict[str, Any]:
        """The full state dict of the user's module (no wrapper prefixes). Called on every
        process (collective for sharded strategies; then only the main process's is complete)."""
        return self.unwrap(model).state_dict()

    def load_model_state_dict(self, model: torch.nn.Module, state: Dict[str, Any], strict: bool = True) -> Any:
        """Load a full state dict into ``model``. Called on every process."""
        return self.unwrap(model).load_state_dict(state, strict=strict)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        """The optimizer's state dict in the form ``load_optimizer_state_dict`` takes back."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: Dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def save_sharded(self, directory: str, models: List[torch.nn.Module], optimizers: List[Any],
                     process_group: Any = None, asynchronous: bool = False) -> Any:
        """Write models and optimizers as shards (``checkpoint_format == "sharded"``) under
        ``directory/sharded/``; every process writes its own part and returns ``{relative file
        name: size}`` for the manifest. Collective (on ``process_group``, default the job's). With
        ``asynchronous``, returns after staging a host copy a function that waits for the write
        and returns that listing (:func:`anyaccel.strategies.dcp.save_sharded`)."""
        raise NotImplementedError(f"the {self.name!r} strategy stores full states")

    def load_sharded(self, directory: str, manifest: Dict[str, Any], models: List[torch.nn.Module], optimizers: List[Any],
                     strict: bool = True) -> None:
        """Read a sharded checkpoint (written by FSDP2, with any number of processes) into this
        job's models and optimizers, resharding as needed. Collective when a group exists."""
        from . import dcp

        dcp.load_sharded(directory, [self.unwrap(m) for m in models], [getattr(o, "optimizer", o) for o in optimizers],
                         strict=strict)

    def teardown(self) -> None:
        """Release what the strategy holds before the process group goes away. Local."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _checked_options(cls: Type[Strategy], options: Any) -> Any:
    wanted = cls.options_type
    if wanted is None:
        if options is not None:
            raise TypeError(f"the {cls.name!r} strategy takes no options; got {type(options).__name__}")
        return None
    if options is None:
        return wanted()
    if not isinstance(options, wanted):
        raise TypeError(f"the {cls.name!r} strategy takes {wanted.__name__}; got {type(options).__name__}")
    return options


def unwrap_module(model: torch.nn.Module, keep_torch_compile: bool = False) -> torch.nn.Module:
    """The user's module inside DDP and (unless ``keep_torch_compile``) ``torch.compile``
    wrappers. Local."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if keep_torch_compile and not isinstance(model, DistributedDataParallel):
            return model
        inner = _inner_module(model)
        if inner is None:
            return model
        model = inner


def _inner_module(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The module directly inside a wrapper: DDP's ``module``, ``torch.compile``'s ``_orig_mod``."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        inner: torch.nn.Module = model.module
        return inner
    return compiling.orig_module(model)


class MeshStrategy(Protocol):
    """What a strategy over one named device mesh (the ``nd`` strategy) answers besides
    :class:`Strategy`: ``Accelerator.torch_device_mesh`` and the ``*_rank`` properties read these.
    A strategy has a mesh when it has a ``parallelism_config``. Local, except that the first read
    of :attr:`device_mesh` may build the mesh (collective)."""

    parallelism_config: Any

    @property
    def device_mesh(self) -> "DeviceMesh":
        """The job's named mesh; built on first use (collective then)."""
        ...

    def rank_in(self, dim: str) -> int:
        """This process's coordinate along mesh dimension ``dim`` (0 where its size is 1). Local."""
        ...
