"""FSDP2 (``torch.distributed.fsdp.fully_shard``): each process holds 1/N of every parameter, its
gradient and its optimizer state; parameters are all-gathered one wrapped block at a time.

Runs wherever torch.distributed does — on CPUs with gloo too (Accelerate and Lightning Fabric
refuse FSDP on CPU). The device mesh is built from the Environment (a CPU mesh on CPUs, a CUDA mesh
on GPUs), never guessed by torch.

What the strategy does, in the order of a training script:

* ``wrap`` (collective): refuses a model the user already wrapped (DDP or ``fully_shard``), makes
  every rank start from rank 0's weights (``sync_module_states``; a model built on meta is instead
  sharded first and each process fills only its shards: :mod:`anyaccel.big_modeling.sharded_load`), picks the blocks to shard on
  their own (``auto_wrap_policy``), adds activation checkpointing to them when asked, then calls
  ``fully_shard`` on each block and on the root with the mixed-precision and offload policies.
  Parameters become new DTensor objects, so optimizers built on the old ones are remapped by name
  (``prepare_optimizer``), in any ``prepare`` order.
* accumulation micro-steps: ``set_requires_gradient_sync(False)`` (no reduce-scatter), restored on
  the sync step.
* ``clip_grad_norm_``: the global norm over the sharded gradients (a plain tensor, the same on
  every rank).
* state: full state dicts are gathered to rank 0 (collective); ``save_state`` writes shards through
  torch.distributed.checkpoint (:mod:`anyaccel.strategies.dcp`) unless
  ``state_dict_type="FULL_STATE_DICT"``; full checkpoints written by DDP load here and sharded ones
  load under DDP or in one process, so checkpoints move between strategies and process counts.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence

import torch

from ..environment import DistributedType
from ..errors import CheckpointError
from . import dcp
from .base import Strategy
from .options import FSDPOptions

__all__ = ["FSDPStrategy"]


def _fsdp():
    from torch.distributed import fsdp

    return fsdp


class FSDPStrategy(Strategy):
    """FSDP2 over the job's processes, configured by :class:`~.options.FSDPOptions` (Accelerate's
    :class:`~anyaccel.plugins.FullyShardedDataParallelPlugin` and the config file's
    ``fsdp_config`` convert into them). Reported as ``DistributedType.FSDP``; state dicts are
    collective; uneven inputs cannot be joined (every rank must run the same all-gathers)."""

    name = "fsdp"
    collective_state_dict = True
    options_type = FSDPOptions
    options: FSDPOptions

    def __init__(self, env: Any, backend: Any, options: Optional[FSDPOptions] = None, mixed_precision: str = "no",
                 dynamo: Any = None):
        super().__init__(env, backend, options, mixed_precision, dynamo)
        self.checkpoint_format = self.options.checkpoint_format
        if isinstance(self.options.mixed_precision_policy, Mapping):  # dtype names: an error now, not at prepare
            for field, value in self.options.mixed_precision_policy.items():
                _dtype(field, value)
        if self.options.cpu_offload and backend.device_type == "cpu":
            raise ValueError("FSDP cpu_offload=True (FullyShardedDataParallelPlugin, fsdp_config) moves sharded "
                             "parameters from a GPU to host memory; this job runs on the CPU, where they already are. "
                             "Leave cpu_offload off.")
        self._mesh = None
        self._renamed: Dict[int, torch.nn.Parameter] = {}  # id(parameter before sharding) -> its sharded parameter
        self._models: List[torch.nn.Module] = []  # what wrap() sharded, to find an optimizer's model

    @property
    def distributed_type(self) -> DistributedType:
        return DistributedType.FSDP

    # ---- the process group and the mesh ----------------------------------------------------------
    def process_group_backend(self, backend: Optional[str]) -> Optional[str]:
        """CPU offload on GPUs keeps sharded tensors on the host: the group needs gloo for them."""
        if self.options.cpu_offload and backend == "nccl":
            return f"{self.backend.device_type}:nccl,cpu:gloo"
        return backend

    def setup_process_group(self) -> None:
        """One process: FSDP still needs a group; make a group of one (nothing is sharded, but the
        code paths and the checkpoint format are the ones of an N-process run)."""
        import torch.distributed as dist

        if self.env.world_size == 1 and not dist.is_initialized():
            warnings.warn("strategy='fsdp' with one process: there is nothing to shard; the model is wrapped by "
                          "FSDP over a group of one process, so the code paths and checkpoints are those of a "
                          "multi-process run (launch with --num_processes N to shard)", stacklevel=4)
            # backend None: torch's defaults for every device type (cpu:gloo, cuda:nccl), which also
            # serves CPU offload on a GPU.
            dist.init_process_group(self.env.backend, store=dist.HashStore(), rank=0, world_size=1)

    @property
    def mesh(self) -> Any:
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.backend.device_type, (self.env.world_size,))
        return self._mesh

    # ---- wrapping -------------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module, device_placement: bool, evaluation_mode: bool) -> torch.nn.Module:
        """A model to train is not moved to the device first: ``fully_shard`` moves each block as it
        shards it, so the whole model never has to fit on one GPU (only in each process's host
        memory). Evaluation-only models are placed as with every strategy. Collective."""
        if evaluation_mode or not any(p.requires_grad for p in model.parameters()):
            return super().prepare_model(model, device_placement, evaluation_mode)
        return self.wrap(self.compile(model))

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
        from ..big_modeling import sharded_load  # a meta model: shard first, then fill the shards

        on_meta = sharded_load.has_meta(inner)
        if self.options.sync_module_states and not on_meta:
            _broadcast_from_rank0(inner, self.backend.device)
        self._shard(inner, self._checkpointed_blocks(inner), on_meta)
        self._track(model, inner, names)
        return model  # a model compiled by the user stays compiled; its inner module is sharded in place

    # ---- the steps of wrap, shared with the N-D strategy (strategies/nd.py) -------------------------
    def _checkpointed_blocks(self, inner: torch.nn.Module) -> List[torch.nn.Module]:
        """The blocks sharded on their own (the wrap policy), with activation checkpointing put on
        them (on the whole model when there are none) when the options ask for it. Local."""
        blocks = self._blocks(inner)
        if self.options.activation_checkpointing:
            for block in blocks or [inner]:
                _checkpoint_forward(block)
        return blocks

    def _shard(self, inner: torch.nn.Module, blocks: List[torch.nn.Module], on_meta: bool) -> None:
        """FSDP2 on each block (compiled first when compile is on: the block's hooks would break the
        root's graph) and on the root, over :attr:`mesh`; then a meta model's shards are filled.
        Collective."""
        from ..big_modeling import sharded_load

        fsdp = _fsdp()
        kwargs = self._shard_kwargs()
        for block in blocks:
            self.compile_block(block)
            fsdp.fully_shard(block, **kwargs)
        # The root's parameters (embeddings, head) are the first ones backward needs: freeing them
        # after the forward would only gather them again at once (one more all-gather per step).
        # FSDP2's own default for the root (None: keep them) unless the user asked for False or n.
        # Not when the root is the only unit (no blocks): it would then hold the whole model
        # unsharded after every forward, evaluation included.
        if blocks and kwargs["reshard_after_forward"] is True:
            kwargs = dict(kwargs, reshard_after_forward=None)
        fsdp.fully_shard(inner, **kwargs)
        if on_meta:
            sharded_load.materialize(inner, self.backend.device)

    def _track(self, model: torch.nn.Module, inner: torch.nn.Module, names: Dict[int, str]) -> None:
        """Remember the prepared model and which new parameter replaced each old one (by name), so
        optimizers made before ``prepare`` are pointed at them. Local."""
        now = dict(inner.named_parameters())
        self._renamed.update({pid: now[name] for pid, name in names.items() if name in now})
        self._models.append(model)

    def _shard_kwargs(self) -> Dict[str, Any]:
        fsdp = _fsdp()
        kwargs: Dict[str, Any] = {"mesh": self.mesh, "reshard_after_forward": self.options.reshard_after_forward,
                                  "mp_policy": self.mixed_precision_policy()}
        if self.options.cpu_offload:
            kwargs["offload_policy"] = fsdp.CPUOffloadPolicy()
        return kwargs

    def mixed_precision_policy(self) -> Any:
        """How the accelerator's precision maps onto FSDP2: the options' ``MixedPrecisionPolicy``
        (a mapping of its fields: dtype names resolved), else parameters gathered in the
        ``mixed_precision`` dtype for compute, gradients reduced in fp32 (shards stay fp32). Local."""
        from ..precision import autocast_dtype

        fsdp = _fsdp()
        policy = self.options.mixed_precision_policy
        if isinstance(policy, fsdp.MixedPrecisionPolicy):
            return policy
        if isinstance(policy, Mapping):
            return fsdp.MixedPrecisionPolicy(**{k: _dtype(k, v) for k, v in policy.items()})
        compute = autocast_dtype(self.mixed_precision)
        return fsdp.MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if compute else None)

    def _blocks(self, root: torch.nn.Module) -> List[torch.nn.Module]:
        """The submodules sharded as their own unit (children before parents), by the policy."""
        options = self.options
        policy = options.wrap_policy()
        if policy in ("no_wrap",):
            return []
        if policy == "callable":
            test: Callable[[torch.nn.Module], bool] = options.auto_wrap_policy  # type: ignore[assignment]
        elif policy == "size_based_wrap":
            threshold = options.min_num_params or 100_000_000
            test = functools.partial(_big_enough, threshold=threshold)
        else:
            wanted = list(options.transformer_cls_names_to_wrap or getattr(root, "_no_split_modules", None) or [])
            if not wanted:
                if policy == "transformer_based_wrap":
                    raise ValueError("auto_wrap_policy='transformer_based_wrap' needs transformer_cls_names_to_wrap "
                                     "(the model has no _no_split_modules to take them from)")
                return []  # default: the root only
            present = {type(m).__name__ for m in root.modules()}
            missing = [n for n in wanted if n not in present]
            if missing:
                raise ValueError(f"transformer_cls_names_to_wrap names {missing}, which the model does not contain; "
                                 f"its module classes are: {', '.join(sorted(present))}")
            test = lambda m: type(m).__name__ in wanted  # noqa: E731
        # Containers without a forward of their own (ModuleList, ModuleDict) cannot be units.
        return [m for m in _post_order(root)
                if m is not root and type(m).forward is not torch.nn.Module.forward and test(m)]

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
        """The full state dict on rank 0 (CPU tensors), ``{}`` elsewhere. Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_model_state_dict(self, model: torch.nn.Module, state: Dict[str, Any], strict: bool = True) -> Any:
        """Load a full state dict (every rank holds it) into the sharded model. Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        return set_model_state_dict(self.unwrap(model), state, options=StateDictOptions(full_state_dict=True,
                                                                                         strict=strict))

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
        """Load torch's own optimizer layout (numbered parameters, e.g. saved by DDP). Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        inner = getattr(optimizer, "optimizer", optimizer)
        if not state.get("state"):  # saved before its first step: only hyper-parameters to restore
            inner.load_state_dict(state)
            return
        model, names = self._owner(inner)
        if len(names) != sum(len(g["params"]) for g in state["param_groups"]):
            raise CheckpointError(f"the saved optimizer state has {sum(len(g['params']) for g in state['param_groups'])} "
                                  f"parameters, this optimizer {len(names)}")
        by_name = {"state": {names[int(i)]: v for i, v in state["state"].items()},
                   "param_groups": [dict(g, params=[names[int(i)] for i in g["params"]]) for g in state["param_groups"]]}
        set_optimizer_state_dict(model, inner, by_name, options=StateDictOptions(full_state_dict=True))

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
        self._mesh = None


def _dtype(field: str, value: Any) -> Any:
    """A dtype given by name (``"bfloat16"``) as torch's; bools and dtypes as they are."""
    if not isinstance(value, str):
        return value
    dtype = getattr(torch, value, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"mixed_precision_policy {field}={value!r} is not a torch dtype; use e.g. 'bfloat16', "
                         "'float16' or 'float32'")
    return dtype


def _post_order(module: torch.nn.Module) -> Iterable[torch.nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def _big_enough(module: torch.nn.Module, threshold: int) -> bool:
    return sum(p.numel() for p in module.parameters()) >= threshold


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


def _checkpoint_forward(module: torch.nn.Module) -> None:
    """Recompute ``module``'s activations in backward (non-reentrant ``torch.utils.checkpoint``),
    keeping its parameter names (no wrapper module in between)."""
    from torch.utils.checkpoint import checkpoint

    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


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
