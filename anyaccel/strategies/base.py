"""The Strategy interface: how a model is wrapped across processes.

One subclass per way of wrapping — a file each (``single.py``, ``ddp.py``, ``xla.py``) or a package
(``fsdp/``, ``deepspeed/``, the N-D family ``nd/``) — chosen once per ``Accelerator`` by
:func:`anyaccel.strategies.create_strategy`. The ``Accelerator`` asks its
strategy to prepare models and optimizers, for the gradient-sync context of accumulation
micro-steps, for what happens before an optimizer step and before clipping, and for the model and
optimizer state that checkpoints store.

Where things happen in :meth:`Strategy.prepare_model`: move the model with the backend, then wrap
it. A compile step belongs between the two (PyTorch's advice: compile the inner module, then wrap
it with DDP/FSDP), so that ``unwrap`` and state dicts see the user's module underneath.

Options, mesh and capabilities: a strategy takes one frozen options object (its ``options_type``,
e.g. :class:`~.options.DDPOptions`; None: the defaults), holds the job's
:class:`~.mesh.ProcessMesh` (:attr:`Strategy.process_mesh`: every rank question is its), and
answers, through methods rather than tests of its name in the façade, what Accelerate reports for
it (:attr:`Strategy.distributed_type`), whether its state dicts are collective
(:attr:`Strategy.collective_state_dict`) and the loss of one global batch
(:meth:`Strategy.causal_lm_loss`). What only some strategies can do (pipeline stages, sequence
slices, an engine's backward, uneven inputs, a forced gradient sync) are the small interfaces of
:mod:`.capabilities`, which the façade asks for with ``isinstance``.

State in checkpoints: :meth:`Strategy.model_state_dict` returns the *full* state dict with the
user's key names (no ``module.`` or ``_orig_mod.`` prefixes). ``checkpoint_format`` names how
``save_state`` stores models and optimizers: ``"full"`` (the main process writes one file per
model and optimizer) is implemented by :mod:`anyaccel.checkpoint.training_state`; a sharded
strategy (FSDP2 through torch.distributed.checkpoint) implements :meth:`save_sharded` /
:meth:`load_sharded` instead.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Dict, Iterable, List, Optional, Sequence, Type

import torch

from ..environment import DistributedType
from . import compile as compiling
from .mesh import ProcessMesh

if TYPE_CHECKING:  # imported where used: `from anyaccel import Accelerator` does not load it
    from .loss import SequenceGroup

__all__ = ["Strategy", "unwrap_module", "refuse_split_experts"]

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
    #: the job's processes on named dimensions (:class:`~.mesh.ProcessMesh`), made in the
    #: constructor by :meth:`make_process_mesh`: every question about ranks is asked of it
    process_mesh: ProcessMesh

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
        self.process_mesh = self.make_process_mesh()

    def make_process_mesh(self) -> ProcessMesh:
        """The job's mesh (pure: no group is built until asked). Default: every process a replica
        on one data-parallel dimension (``dp_replicate``); sharding strategies shard over
        ``dp_shard``, the N-D family lays out its :class:`~.nd.options.ParallelismConfig`. Local."""
        return ProcessMesh.flat(self.env.world_size, self.env.rank, getattr(self.backend, "device_type", "cpu"))

    # ---- what it is, and what it can do --------------------------------------------------------
    @property
    def distributed_type(self) -> DistributedType:
        """What Accelerate reports for this job (``accelerator.distributed_type``): the
        environment's (``NO``, ``MULTI_CPU``, ``MULTI_GPU``, ``XLA``) unless the strategy is one
        Accelerate names itself (FSDP). Local."""
        kind: DistributedType = self.env.distributed_type
        return kind

    def data_parallel(self) -> "tuple[int, int]":
        """``(rank, size)`` among the processes that see different batches: the mesh's ``batch``
        (:attr:`process_mesh`; loaders shard by it). Local."""
        mesh = self.process_mesh
        return mesh.rank_in("batch"), mesh.size("batch")

    # ---- the process group ------------------------------------------------------------------------
    def process_group_backend(self, backend: Optional[str]) -> Optional[str]:
        """The torch.distributed backend the group is created with (the environment's, by default)."""
        return backend

    def setup_process_group(self) -> None:
        """Called once the group is joined (or when there is none to join). Local."""

    # ---- models -----------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module, device_placement: bool, evaluation_mode: bool) -> torch.nn.Module:
        """Move ``model`` to the device (when ``device_placement``) and wrap it for training
        across processes (unless ``evaluation_mode`` or it has nothing to train). Collective for
        strategies whose wrapping communicates (DDP broadcasts rank 0's weights)."""
        if device_placement:
            model = self.backend.move_model(model)
        model = self.compile(model)
        if evaluation_mode or not any(p.requires_grad for p in model.parameters()):
            return model
        refuse_split_experts(model)
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

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The training wrapper around a model already on its device (default: none)."""
        return model

    def without_compile(self, module: torch.nn.Module) -> torch.nn.Module:
        """A shallow copy of ``module`` that is not compiled and shares every parameter and buffer
        (``Accelerator.unwrap_model(keep_torch_compile=False)``; see
        :func:`~anyaccel.strategies.compile.without_compile`). Local."""
        return compiling.without_compile(module)

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

    # ---- the loss of one global batch ---------------------------------------------------------------
    def causal_lm_loss(self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Next-token cross entropy as one process computes it on the global batch
        (:func:`~.loss.causal_lm_loss` over :meth:`token_group`). Collective over the loss group."""
        from . import loss

        return loss.causal_lm_loss(logits, labels, self.token_group(), ignore_index)

    def global_token_mean(self, loss_sum: torch.Tensor, num_tokens: Any) -> torch.Tensor:
        """``loss_sum`` over ``num_tokens``, both added over the processes of one global batch
        (:func:`~.loss.global_token_mean`). Collective over the loss group."""
        from . import loss

        return loss.global_token_mean(loss_sum, num_tokens, self.token_group())

    def token_group(self) -> SequenceGroup:
        """Where this process's tokens count: no sequence slices; the mesh's ``loss`` group (every
        process here) and the ``gradients`` size gradients are averaged over. Sequence-parallel
        strategies return their ``sp`` group too. Local (the job's group must exist for a loss
        over several processes)."""
        from .loss import SequenceGroup

        mesh = self.process_mesh
        if mesh.size("loss") > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            return SequenceGroup(group=None, size=1, rank=0, loss_group=mesh.group("loss"),
                                 loss_size=mesh.size("gradients"))
        return SequenceGroup(group=None, size=1, rank=0)

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
        from . import dcp  # the sharded format every strategy reads

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


def refuse_split_experts(model: torch.nn.Module) -> None:
    """A ``ValueError`` when ``model`` (to be trained) holds experts already split over several ep
    ranks by ``anyaccel.strategies.nd.expert.shard_experts``: a strategy would average the
    gradients of *different* experts over the ep ranks (DDP, FSDP over every process) or
    overwrite each rank's experts with rank 0's (the nd strategy's broadcast), silently. The nd
    strategy splits them itself from the unsplit model under ``ParallelismConfig(ep_size=N)``.
    Local (every rank has the same answer: each split the same modules)."""
    split = [name for name, m in model.named_modules()
             if getattr(getattr(m, "expert_group", None), "size", 1) > 1 and hasattr(m, "num_global_experts")]
    if split:
        group: Any = model.get_submodule(split[0]).expert_group
        size = group.size
        raise ValueError(f"prepare(): {split[:3]} of {type(model).__name__} {'is' if len(split) == 1 else 'are'} "
                         f"already split over {size} ep ranks (shard_experts); no strategy may wrap a split model "
                         "(it would mix the gradients of different experts). Pass the unsplit model with "
                         f"Accelerator(parallelism_config=ParallelismConfig(ep_size={size}, ...)): the nd strategy "
                         "splits the experts and reduces their gradients itself")
