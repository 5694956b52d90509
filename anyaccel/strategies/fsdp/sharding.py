"""FSDP2 sharding over a mesh it is given: :class:`FSDPSharding`.

FSDP2's own ``fully_shard(module, *, mesh=...)`` takes the mesh as a parameter; so does this: a
sharding is made from :class:`~.options.FSDPOptions` and a *mesh provider* (a callable returning
the ``DeviceMesh``, called when the first module is sharded, so the mesh is built — collectively —
only by jobs that shard). The strategy that owns the mesh decides over which processes; the sharding
decides how a module is cut. The same code serves a 1-D group (the ``fsdp`` strategy,
:mod:`anyaccel.strategies.fsdp`), an HSDP mesh and a TP x FSDP sub-mesh (the ``nd`` strategy passes
its mesh's ``sharding`` sub-mesh, :mod:`anyaccel.strategies.nd`; both from the job's
:class:`~anyaccel.strategies.mesh.ProcessMesh`).

What :meth:`FSDPSharding.shard` does, in order: the blocks that become units of their own
(``auto_wrap_policy``, without those that would split a tied parameter:
:mod:`.ties`), activation checkpointing on them when asked, each block compiled
(when compile is on) and ``fully_shard``-ed, then the root, with the mixed-precision policy
(resolved and checked once, when the sharding is made: :func:`resolve_mixed_precision_policy`) and
the offload policy; ties checked; then a meta model's shards filled
(:mod:`anyaccel.big_modeling.sharded_load`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence

import torch

from . import ties
from .options import FSDPOptions

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["FSDPSharding", "MeshProvider", "resolve_mixed_precision_policy"]

#: what a sharding is given instead of a mesh: a function returning it (called when the first
#: module is sharded, so a mesh is built — collectively — only by jobs that shard something)
MeshProvider = Callable[[], "DeviceMesh"]


def _fsdp() -> Any:
    """``torch.distributed.fsdp``, imported when first needed."""
    from torch.distributed import fsdp

    return fsdp


def resolve_mixed_precision_policy(policy: Any, mixed_precision: str) -> Any:
    """The one check and resolution of ``FSDPOptions.mixed_precision_policy``: a
    ``MixedPrecisionPolicy`` as it is; a mapping of its fields with dtype names resolved
    (``ValueError`` for a name that is not a torch dtype); ``None``: parameters gathered in the
    accelerator's ``mixed_precision`` dtype for compute, gradients reduced in fp32 (shards stay
    fp32). Field names were checked when the options were built (:class:`~.options.FSDPOptions`,
    no torch there). Local."""
    from ...precision import autocast_dtype

    fsdp = _fsdp()
    if isinstance(policy, fsdp.MixedPrecisionPolicy):
        return policy
    if isinstance(policy, Mapping):
        return fsdp.MixedPrecisionPolicy(**{k: _dtype(k, v) for k, v in policy.items()})
    compute = autocast_dtype(mixed_precision)
    return fsdp.MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if compute else None)


class FSDPSharding:
    """FSDP2 as :class:`~.options.FSDPOptions` describe it, over the mesh ``mesh()`` returns.

    ``device``: where a meta model's shards are allocated. ``mixed_precision``: the accelerator's
    setting (used when the options give no policy). ``compile_block``: called on each block before
    it is sharded (the strategy's :meth:`~.base.Strategy.compile_block`). ``is_main_process``: warn
    once per job, not once per rank. Nothing communicates until :meth:`shard`."""

    def __init__(self, options: FSDPOptions, mesh: MeshProvider, *, device: Any, mixed_precision: str = "no",
                 compile_block: Optional[Callable[[torch.nn.Module], None]] = None, is_main_process: bool = True):
        self.options = options
        self._mesh = mesh
        self.device = device
        self.mixed_precision_policy = resolve_mixed_precision_policy(options.mixed_precision_policy, mixed_precision)
        self._compile_block = compile_block
        self._is_main_process = is_main_process

    @property
    def mesh(self) -> "DeviceMesh":
        """The mesh parameters are sharded over (the provider's; collective the first time when the
        provider builds it)."""
        return self._mesh()

    def checkpointed_blocks(self, root: torch.nn.Module, sharded: bool = True) -> List[torch.nn.Module]:
        """The blocks sharded on their own (the wrap policy, without the units that would split a
        tied parameter when ``sharded``: :func:`~.ties.units_keeping_ties`), with activation
        checkpointing put on them (on the whole model when there are none) when the options ask
        for it. ``sharded=False``: the blocks only carry activation checkpointing (the ``nd``
        strategy without data parallelism), so the policy's units stay as they are. Local."""
        blocks = self.blocks(root)
        if sharded:
            blocks = ties.units_keeping_ties(root, blocks, warn=self._is_main_process)
        if self.options.activation_checkpointing:
            for block in blocks or [root]:
                _checkpoint_forward(block)
        return blocks

    def shard(self, root: torch.nn.Module, blocks: Sequence[torch.nn.Module], on_meta: bool = False) -> None:
        """FSDP2 on each block (compiled first when compile is on: the block's hooks would break the
        root's graph) and on the root, over :attr:`mesh`; then a meta model's shards are filled.
        A tied parameter that came out as two is an error naming both. Collective."""
        from ...big_modeling import sharded_load

        fsdp = _fsdp()
        tied = ties.find_ties(root)
        kwargs = self.shard_kwargs()
        for block in blocks:
            if self._compile_block is not None:
                self._compile_block(block)
            fsdp.fully_shard(block, **kwargs)
        # The root's parameters (embeddings, head) are the first ones backward needs: freeing them
        # after the forward would only gather them again at once (one more all-gather per step).
        # FSDP2's own default for the root (None: keep them) unless the user asked for False or n.
        # Not when the root is the only unit (no blocks): it would then hold the whole model
        # unsharded after every forward, evaluation included.
        if blocks and kwargs["reshard_after_forward"] is True:
            kwargs = dict(kwargs, reshard_after_forward=None)
        fsdp.fully_shard(root, **kwargs)
        ties.check_kept(tied, "FSDP2 (fully_shard)")
        if on_meta:
            sharded_load.materialize(root, self.device)

    def shard_kwargs(self) -> Dict[str, Any]:
        """``fully_shard``'s keyword arguments: the mesh, resharding, the mixed-precision and
        offload policies. Collective the first time (the mesh may be built)."""
        fsdp = _fsdp()
        kwargs: Dict[str, Any] = {"mesh": self.mesh, "reshard_after_forward": self.options.reshard_after_forward,
                                  "mp_policy": self.mixed_precision_policy}
        if self.options.cpu_offload:
            kwargs["offload_policy"] = fsdp.CPUOffloadPolicy()
        return kwargs

    def blocks(self, root: torch.nn.Module) -> List[torch.nn.Module]:
        """The submodules the policy makes units of their own (children before parents). Local."""
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


def _checkpoint_forward(module: torch.nn.Module) -> None:
    """Recompute ``module``'s activations in backward (non-reentrant ``torch.utils.checkpoint``),
    keeping its parameter names (no wrapper module in between)."""
    from torch.utils.checkpoint import checkpoint

    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed
