"""FSDP2 (``torch.distributed.fsdp.fully_shard``): each process holds 1/N of every parameter, its
gradient and its optimizer state; parameters are all-gathered one wrapped block at a time.

Runs wherever torch.distributed does — on CPUs with gloo too (Accelerate and Lightning Fabric
refuse FSDP on CPU). The device mesh is the job's :class:`~anyaccel.strategies.mesh.ProcessMesh`'s
(built on the backend's device type: a CPU mesh on CPUs, a CUDA mesh on GPUs, never guessed by
torch).

Composed rather than inherited: *how* a module is sharded is :class:`~.sharding.FSDPSharding`,
made with FSDP options and a mesh provider (FSDP2's ``fully_shard(module, *, mesh=...)`` is the
model: the mesh is a parameter); *over which processes* is the strategy's :attr:`mesh`. Here:

* :class:`ShardedStrategy` — what every strategy whose parameters become DTensors shares (this
  one and the ``nd`` strategy, :mod:`anyaccel.strategies.nd`; both shard over their
  :class:`~anyaccel.strategies.mesh.ProcessMesh`'s ``sharding`` sub-mesh): the group of one for a one-process job, optimizers built before
  ``prepare`` remapped by name onto the new parameters (``prepare_optimizer``, in any ``prepare``
  order), accumulation micro-steps without reduce-scatter (``set_requires_gradient_sync(False)``),
  collective full state dicts gathered to rank 0 (the names of a tied parameter holding one
  tensor), and sharded checkpoints through torch.distributed.checkpoint
  (:mod:`anyaccel.strategies.dcp`) unless ``checkpoint_format="full"``. Full checkpoints written by
  DDP load here and sharded ones load under DDP or in one process, so checkpoints move between
  strategies and process counts.
* :class:`FSDPStrategy` — the ``fsdp`` strategy: a :class:`ShardedStrategy` whose mesh is every
  process on ``dp_shard`` (1-D). ``wrap`` (collective) refuses a model the user already wrapped (DDP or
  ``fully_shard``), makes every rank start from rank 0's weights (``sync_module_states``; a model
  built on meta is instead sharded first and each process fills only its shards), then shards.
  ``clip_grad_norm_`` is the global norm over the sharded gradients (a plain tensor, the same on
  every rank).
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar, Dict, Iterable, List, Optional, Sequence

import torch

from ...environment import DistributedType
from ...errors import CheckpointError
from .. import dcp
from . import ties
from .. import compile as compiling
from ..base import Strategy
from ..mesh import ProcessMesh
from .options import FSDPOptions
from .sharding import FSDPSharding, _fsdp

__all__ = ["FSDPStrategy", "ShardedStrategy"]


class ShardedStrategy(Strategy):
    """What strategies whose parameters become DTensors share (FSDP, N-D): see the module
    docstring. A subclass calls :meth:`_use_sharding` in its ``__init__`` with its FSDP options
    (the sharding shards over :attr:`mesh`, its process mesh's ``sharding``), and sets
    :attr:`solo_warning` to what a one-process job is told (None: nothing). State dicts are
    collective; uneven inputs cannot be joined (every rank must run the same all-gathers)."""

    collective_state_dict = True
    #: the warning a one-process job gets when it makes its group of one (None: none)
    solo_warning: ClassVar[Optional[str]] = None
    sharding: FSDPSharding

    def make_process_mesh(self) -> ProcessMesh:
        """Every process on ``dp_shard``: parameters sharded over the whole job. Local."""
        return ProcessMesh.flat(self.env.world_size, self.env.rank, getattr(self.backend, "device_type", "cpu"),
                                dim="dp_shard")

    @property
    def mesh(self) -> Any:
        """The mesh FSDP2 shards over: the process mesh's ``sharding`` (the whole job here; 2-D
        replicas x shards for HSDP). Built on first use (collective)."""
        return self.process_mesh.sharding

    def _use_sharding(self, options: FSDPOptions) -> None:
        """Shard with ``options`` over :attr:`mesh` (asked for when the first module is sharded);
        set up what wrapping records. Local."""
        self.sharding = FSDPSharding(options, lambda: self.mesh, device=self.backend.device,
                                     mixed_precision=self.mixed_precision, compile_block=self.compile_block,
                                     is_main_process=self.env.is_main_process)
        self.checkpoint_format = options.checkpoint_format
        self._renamed: Dict[int, torch.nn.Parameter] = {}  # id(parameter before sharding) -> its sharded parameter
        self._models: List[torch.nn.Module] = []  # what wrap() sharded, to find an optimizer's model

    def mixed_precision_policy(self) -> Any:
        """The ``MixedPrecisionPolicy`` the sharding uses (:func:`~.sharding.resolve_mixed_precision_policy`). Local."""
        return self.sharding.mixed_precision_policy

    def compile_block(self, block: torch.nn.Module) -> None:
        """Compile in place a block that FSDP2 makes a unit of its own (its hooks break the root's
        graph at the block's call: compiled on its own, the block's forward is still compiled —
        torchtitan's order, compile per block then shard). No check of its own: the model's
        first-call check counts the blocks' graphs. Nothing when compile is off or the block was
        compiled by the user. Local."""
        if self.dynamo is not None and self.dynamo.enabled and not compiling.compiled_by_user(block):
            compiling.compile_in_place(block, self.dynamo.compile_kwargs(), watch=False)

    # ---- the process group ------------------------------------------------------------------------
    def setup_process_group(self) -> None:
        """One process: the mesh still needs a group; make a group of one (the code paths and the
        checkpoint format are then those of an N-process run), warning :attr:`solo_warning`. Local."""
        import torch.distributed as dist

        if self.env.world_size == 1 and not dist.is_initialized():
            if self.solo_warning:
                warnings.warn(self.solo_warning, stacklevel=4)
            # backend None: torch's defaults for every device type (cpu:gloo, cuda:nccl), which also
            # serves CPU offload on a GPU.
            dist.init_process_group(self.env.backend, store=dist.HashStore(), rank=0, world_size=1)
            self._own_group = True  # made here (the nd strategy's teardown leaves it again)

    # ---- wrapping -------------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module, device_placement: bool, evaluation_mode: bool) -> torch.nn.Module:
        """A model to train is not moved to the device first: ``fully_shard`` moves each block as it
        shards it, so the whole model never has to fit on one GPU (only in each process's host
        memory; the nd strategy's ``wrap`` places what it does not shard). Evaluation-only models
        are placed as with every strategy. Collective."""
        if evaluation_mode or not any(p.requires_grad for p in model.parameters()):
            return super().prepare_model(model, device_placement, evaluation_mode)
        return self.wrap(self.compile(model))

    def _track(self, model: torch.nn.Module, inner: torch.nn.Module, names: Dict[int, str]) -> None:
        """Remember the prepared model and which new parameter replaced each old one (by name), so
        optimizers made before ``prepare`` are pointed at them. Local."""
        now = dict(inner.named_parameters())
        self._renamed.update({pid: now[name] for pid, name in names.items() if name in now})
        self._models.append(model)

    # ---- the training step ------------------------------------------------------------------------
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, models: List[torch.nn.Module]) -> torch.optim.Optimizer:
        """Point ``optimizer`` at the sharded parameters (by name) when it was built on the model
        before sharding. Refuses an optimizer that already has state (it was stepped on the
        unsharded parameters): build or load it after ``prepare``."""
        if not self._renamed:
            return optimizer
        stale = any(id(p) in self._renamed for group in optimizer.param_groups for p in group["params"])
        if not stale:
            return optimizer
        if optimizer.state:
            raise ValueError("this optimizer already holds state for the unsharded parameters (it was stepped, or its "
                             "state was loaded, before prepare); create it before training, pass it to prepare() with "
                             "the model, and load checkpoints with accelerator.load_state() after prepare")
        for group in optimizer.param_groups:
            group["params"] = [self._renamed.get(id(p), p) for p in group["params"]]
        return optimizer

    def sync_context(self, models: Sequence[torch.nn.Module], sync: bool) -> Any:
        if sync:
            return super().sync_context(models, sync)
        fsdp = _fsdp()
        sharded = [m for m in (self.unwrap(m) for m in models) if isinstance(m, fsdp.FSDPModule)]
        return _no_gradient_sync(sharded)

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    # ---- state ----------------------------------------------------------------------------------
    def model_state_dict(self, model: torch.nn.Module) -> Dict[str, Any]:
        """The full state dict on rank 0 (CPU tensors), ``{}`` elsewhere; the names of a tied
        parameter hold one tensor (stored once, as an unsharded model's state dict has them).
        Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        inner = self.unwrap(model)
        state = get_model_state_dict(inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return ties.share_tied_entries(inner, state)

    def _from_rank0(self) -> bool:
        """Whether full states are read by rank 0 alone and broadcast (:attr:`loads_full_state_on_rank0`
        in a multi-process job). Local."""
        return self.loads_full_state_on_rank0 and self.env.world_size > 1

    def load_model_state_dict(self, model: torch.nn.Module, state: Dict[str, Any], strict: bool = True) -> Any:
        """Load a full state dict into the sharded model: held by every rank, or (:meth:`_from_rank0`)
        by rank 0 alone, which broadcasts it while each rank keeps its shards (the others pass
        ``{}``). Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        options = StateDictOptions(full_state_dict=True, strict=strict, broadcast_from_rank0=self._from_rank0())
        return set_model_state_dict(self.unwrap(model), state, options=options)

    def optimizer_state_dict(self, optimizer: Any) -> Dict[str, Any]:
        """The full optimizer state on rank 0 in torch's own layout (parameters numbered in
        param-group order, as DDP saves it), ``{}`` elsewhere. Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        inner = getattr(optimizer, "optimizer", optimizer)
        if not inner.state:  # never stepped: torch's helper would initialise it with a hidden step
            return inner.state_dict()
        model, names = self._owner(inner)
        state = get_optimizer_state_dict(model, inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not state:
            return {}
        index = {name: i for i, name in enumerate(names)}
        groups = [dict(g, params=[index[n] for n in g["params"]]) for g in state["param_groups"]]
        return {"state": {index[n]: v for n, v in state["state"].items()}, "param_groups": groups}

    def load_optimizer_state_dict(self, optimizer: Any, state: Dict[str, Any]) -> None:
        """Load torch's own optimizer layout (numbered parameters, e.g. saved by DDP), held by every
        rank or (:meth:`_from_rank0`) by rank 0 alone, which checks it, tells the others what it
        found (one small broadcast: a problem is raised on every rank, never on rank 0 alone while
        the others wait) and broadcasts it. Which model holds the optimizer's parameters is found
        on every rank (local, the same answer everywhere). Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        inner = getattr(optimizer, "optimizer", optimizer)
        try:  # every rank: the same owner, or the same error (e.g. one optimizer over two models)
            model, names = self._owner(inner)
            owner_problem = None
        except CheckpointError:
            model, names = None, []
            owner_problem = ("FSDP2 loads an optimizer's state into the one prepared model that holds its parameters, "
                             "but this optimizer's parameters are spread over several prepared models (one optimizer "
                             "over two models); under FSDP use one optimizer per model, or load this checkpoint with "
                             "the DDP strategy")
        problem, by_name, hyper_only = None, {}, None
        if state and not state.get("state"):  # saved before its first step: only hyper-parameters (small)
            hyper_only = state
        elif state and owner_problem is None:  # every rank, or rank 0 alone
            try:
                by_name = _by_name(state, inner, names)
            except Exception as exc:  # raised on every rank below, not on this one alone
                problem = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        if self._from_rank0():
            from ... import ops

            problem, hyper_only = ops.broadcast_object_list([(problem, hyper_only)], from_process=0)[0]
            if problem and not self.env.is_main_process:
                problem = f"{problem} (found by process 0)"
        if hyper_only is not None:  # loaded by every rank as it is
            inner.load_state_dict(hyper_only)
            return
        if owner_problem or problem:
            raise CheckpointError(owner_problem or problem)
        set_optimizer_state_dict(model, inner, by_name, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=self._from_rank0()))

    def _owner(self, optimizer: torch.optim.Optimizer):
        """The sharded module holding ``optimizer``'s parameters, and their names in param-group order."""
        models = [self.unwrap(m) for m in self._models]
        model = models[dcp.optimizer_owner(optimizer, models)]
        name_of = {id(p): n for n, p in model.named_parameters()}
        return model, [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]

    def save_sharded(self, directory: str, models: List[torch.nn.Module], optimizers: List[Any],
                     process_group: Any = None, asynchronous: bool = False) -> Any:
        return dcp.save_sharded(directory, [self.unwrap(m) for m in models],
                                [getattr(o, "optimizer", o) for o in optimizers], process_group, asynchronous)

    def teardown(self) -> None:
        self._renamed.clear()
        self._models.clear()
        self.process_mesh.forget()


class FSDPStrategy(ShardedStrategy):
    """FSDP2 over the job's processes, configured by :class:`~.options.FSDPOptions` (Accelerate's
    :class:`~anyaccel.plugins.FullyShardedDataParallelPlugin` and the config file's
    ``fsdp_config`` convert into them): a :class:`ShardedStrategy` whose sharding mesh is every
    process. Reported as ``DistributedType.FSDP``."""

    name = "fsdp"
    options_type = FSDPOptions
    options: FSDPOptions
    loads_full_state_on_rank0 = True  # as Accelerate's FSDP2: rank 0 reads a full checkpoint and broadcasts it
    solo_warning = ("strategy='fsdp' with one process: there is nothing to shard; the model is wrapped by FSDP over a "
                    "group of one process, so the code paths and checkpoints are those of a multi-process run (launch "
                    "with --num_processes N to shard)")

    def __init__(self, env: Any, backend: Any, options: Optional[FSDPOptions] = None, mixed_precision: str = "no",
                 dynamo: Any = None):
        super().__init__(env, backend, options, mixed_precision, dynamo)
        if self.options.cpu_offload and backend.device_type == "cpu":
            raise ValueError("FSDP cpu_offload=True (FullyShardedDataParallelPlugin, fsdp_config) moves sharded "
                             "parameters from a GPU to host memory; this job runs on the CPU, where they already are. "
                             "Leave cpu_offload off.")
        self._use_sharding(self.options)

    @property
    def distributed_type(self) -> DistributedType:
        return DistributedType.FSDP

    # ---- the process group ------------------------------------------------------------------------
    def process_group_backend(self, backend: Optional[str]) -> Optional[str]:
        """CPU offload on GPUs keeps sharded tensors on the host: the group needs gloo for them."""
        if self.options.cpu_offload and backend == "nccl":
            return f"{self.backend.device_type}:nccl,cpu:gloo"
        return backend

    # ---- wrapping -------------------------------------------------------------------------------
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        fsdp = _fsdp()
        inner = self.unwrap(model)
        sharded_already = any(isinstance(m, fsdp.FSDPModule) for m in inner.modules()) or any(
            type(p).__name__ == "DTensor" for p in inner.parameters())
        if isinstance(model, DistributedDataParallel) or sharded_already:
            kind = "DistributedDataParallel" if isinstance(model, DistributedDataParallel) else "fully_shard"
            raise ValueError(f"this model is already wrapped by {kind}; pass the plain nn.Module to prepare() and "
                             "anyaccel shards it (strategy='fsdp')")
        names = {id(p): n for n, p in inner.named_parameters()}
        from ...big_modeling import sharded_load  # a meta model: shard first, then fill the shards

        on_meta = sharded_load.has_meta(inner)
        if self.options.sync_module_states and not on_meta:
            _broadcast_from_rank0(inner, self.backend.device)
        self.sharding.shard(inner, self.sharding.checkpointed_blocks(inner), on_meta)
        self._track(model, inner, names)
        return model  # a model compiled by the user stays compiled; its inner module is sharded in place



def _broadcast_from_rank0(module: torch.nn.Module, device: torch.device) -> None:
    """Every rank's parameters and buffers become rank 0's (collective). Tensors still in host
    memory go through ``device`` one at a time where the group has no CPU part (NCCL alone)."""
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return
    host_via_device = dist.get_backend() == "nccl"
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            if host_via_device and tensor.device.type == "cpu":
                buf = tensor.data.to(device)
                dist.broadcast(buf, src=0)
                tensor.data.copy_(buf)
            else:
                dist.broadcast(tensor.data, src=0)


class _no_gradient_sync:
    """Accumulation micro-step: FSDP keeps unsharded gradients locally (no reduce-scatter)."""

    __slots__ = ("_modules",)

    def __init__(self, modules: List[Any]):
        self._modules = modules

    def __enter__(self) -> "_no_gradient_sync":
        for module in self._modules:
            module.set_requires_gradient_sync(False)
        return self

    def __exit__(self, *exc: Any) -> None:
        for module in self._modules:
            module.set_requires_gradient_sync(True)


def _by_name(state: Dict[str, Any], optimizer: torch.optim.Optimizer, names: List[str]) -> Dict[str, Any]:
    """torch's optimizer layout (numbered parameters) with parameter names, as
    ``set_optimizer_state_dict`` takes it; checked against ``optimizer``'s groups first, so that
    torch's own splitting (on rank 0 alone when it broadcasts) cannot fail. Raises
    :class:`CheckpointError` naming the difference. Local."""
    groups = state["param_groups"]
    saved = sum(len(g["params"]) for g in groups)
    if saved != len(names):
        raise CheckpointError(f"the saved optimizer state has {saved} parameters, this optimizer {len(names)}")
    sizes, ours = [len(g["params"]) for g in groups], [len(g["params"]) for g in optimizer.param_groups]
    if sizes != ours:
        raise CheckpointError(f"the saved optimizer state has parameter groups of {sizes} parameters, this optimizer "
                              f"{ours}: build the optimizer with the same groups as the run that saved it")
    return {"state": {names[int(i)]: v for i, v in state["state"].items()},
            "param_groups": [dict(g, params=[names[int(i)] for i in g["params"]]) for g in groups]}
