"""The job's processes on named dimensions: :class:`ProcessMesh`, the one object that knows the mesh.

torchtitan's ``ParallelDims`` idea in anyaccel's names: one object holds the sizes (checked once,
against the number of processes, with an error that names every number), answers every question
about ranks from them — pure arithmetic, testable without processes — and builds each device mesh
and process group once, named by **what uses it**. Nothing else in anyaccel computes a rank from
sizes or calls ``init_device_mesh``: the ``Accelerator``'s ``*_rank`` properties, the loader's
shard, ``gather_for_metrics``' share, the loss and clip-norm reductions, the pipeline's stage
placement and the sharding strategies' meshes all ask this object (``strategy.process_mesh``).

Dimensions (:data:`DIMS`), outermost first: pipeline stages and replicas across machines, tensor
parallel within one; a process's global rank is its coordinates in that order (row-major, ``tp``
fastest). A job without N-D parallelism has a flat mesh (:meth:`ProcessMesh.flat`): every process
on one data-parallel dimension (``dp_replicate`` for DDP's replicas, ``dp_shard`` for FSDP's shards).

What uses which processes (:data:`USES`; a dimension's own name is a use of that dimension)::

    batch      dp_replicate x dp_shard            the loader: processes that read different batches
    loss       dp_replicate x dp_shard x cp x sp   the loss all-reduce: tokens of one global batch
    gradients  dp_replicate x dp_shard x cp x sp   gradient reduction: same parameters, gradients averaged
    sharding   (dp_replicate, dp_shard x cp x sp)  FSDP2's mesh: replicas x shards (HSDP when both > 1)
    stage      every dimension but pp              the processes holding one pipeline stage
    tp, sp, pp, cp                                 tensor, sequence, pipeline, context parallel groups

Adding a dimension (expert parallel next): a name in :data:`DIMS` (or, as torchtitan does for
``ep``, a factor of ``dp_shard`` with its own rows), its rows in :data:`USES` (``ep``: the experts'
all-to-all; ``expert_sharding``: the data-parallel processes ep does not use, over which the experts
are FSDP-sharded), a property below with its docstring line, the option row of its size, and the
strategy that uses it — nothing else changes (docs/extending/strategies.md). A replica dimension
managed by a fault-tolerance library (torchft's replica groups) plugs in where the device mesh is
built: :attr:`ProcessMesh.build` takes its ``init_device_mesh`` in place of torch's.

Pure until a device mesh or group is asked for; building one is collective (every rank builds the
same meshes in the same order), and each is built at most once per mesh.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

__all__ = ["DIMS", "USES", "ProcessMesh", "resolve_sizes"]

#: the mesh dimensions, outermost first (pipeline stages and replicas across machines, tensor
#: parallel within one; sequence parallel beside context parallel)
DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "sp", "tp")

_DATA = ("dp_replicate", "dp_shard")
_TOKENS = ("dp_replicate", "dp_shard", "cp", "sp")
#: each group of processes by what uses it: the dimensions it spans, outermost first (the
#: properties of :class:`ProcessMesh` of the same names say who uses each)
USES: Dict[str, Tuple[str, ...]] = {
    "batch": _DATA,
    "loss": _TOKENS,
    "gradients": _TOKENS,
    "sharding": _TOKENS,
    "stage": tuple(d for d in DIMS if d != "pp"),
    # "ep" / "expert_sharding": expert parallel's rows go here (issue 39)
}


def resolve_sizes(sizes: Mapping[str, int], world_size: int, owner: str = "ProcessMesh") -> Dict[str, int]:
    """Every dimension's size (missing ones 1) for a job of ``world_size`` processes: all sizes 1
    with several processes means ``dp_replicate=world_size`` (Accelerate's rule: plain data
    parallelism); otherwise the product must be ``world_size``, else a ``ValueError`` naming each
    size, the product, the job's size and what to change. ``owner`` names the object in messages.
    Pure and local."""
    unknown = [d for d in sizes if d not in DIMS]
    if unknown:
        raise ValueError(f"{owner}: unknown mesh dimension(s) {unknown}; known: {', '.join(DIMS)}")
    full = {d: sizes.get(d, 1) for d in DIMS}
    for dim, size in full.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{owner}({dim}_size={size!r}): must be an integer >= 1")
    total = math.prod(full.values())
    if total == 1 and world_size > 1:
        return dict(full, dp_replicate=world_size)
    if total != world_size:
        shown = " x ".join(f"{d}_size={s}" for d, s in full.items())
        others = total // full["dp_shard"]
        hint = f"dp_shard_size={world_size // others} with the others as they are, or " \
            if world_size % others == 0 else ""
        raise ValueError(f"{owner}: {shown} = {total} processes, but this job has {world_size}; make the product of "
                         f"the sizes equal the number of processes ({hint}launch with --num_processes {total})")
    return full


class ProcessMesh:
    """This job's processes laid out on :data:`DIMS`, and this process's place in it.

    ``sizes``: ``{dimension: size}`` (missing dimensions 1), checked against ``world_size`` by
    :func:`resolve_sizes`; ``rank``: this process's global rank; ``device_type``: what the device
    meshes are built on (the backend's, never guessed by torch); ``keep``: the dimensions the
    device mesh has even at size 1 (``dp_shard``: FSDP2 always gets a mesh to shard over).

    Pure answers (no process group needed): :meth:`size`, :meth:`rank_in`, :meth:`ranks`,
    :meth:`coordinate`, :attr:`keeps_metrics_share`, :meth:`stage_ranks`. Built on first use
    (collective then): :attr:`device_mesh` and the sub-meshes named by their use (:attr:`batch`,
    :attr:`loss`, :attr:`gradients`, :attr:`sharding`, :attr:`stage`, :attr:`tp`, :attr:`sp`,
    :attr:`pp`), and :meth:`group` (a use's process group)."""

    #: what builds the device mesh: ``fn(device_type, shape, mesh_dim_names=...)``; None: torch's
    #: ``init_device_mesh`` (a fault-tolerance library replaces it for its replica dimension)
    build: Optional[Callable[..., Any]] = None

    def __init__(self, sizes: Mapping[str, int], rank: int, device_type: str = "cpu", *,
                 world_size: Optional[int] = None, keep: Sequence[str] = ("dp_shard",), owner: str = "ProcessMesh"):
        world = math.prod(sizes.values()) if world_size is None else world_size
        self.sizes: Dict[str, int] = resolve_sizes(sizes, world, owner)
        self.world_size = math.prod(self.sizes.values())
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"{owner}: rank {rank!r} is outside a job of {self.world_size} processes")
        unknown = [d for d in keep if d not in DIMS]
        if unknown:
            raise ValueError(f"{owner}: keep={list(keep)} names unknown dimension(s) {unknown}; known: {', '.join(DIMS)}")
        self.rank, self.device_type, self.keep = rank, device_type, tuple(keep)
        self._strides = {d: math.prod(self.sizes[i] for i in DIMS[DIMS.index(d) + 1:]) for d in DIMS}
        self._device_mesh: Any = None
        self._built: Dict[Tuple[str, ...], Any] = {}  # sub-meshes made by flattening, by the dimensions joined

    @classmethod
    def flat(cls, world_size: int, rank: int, device_type: str = "cpu", dim: str = "dp_replicate") -> "ProcessMesh":
        """Every process on one data-parallel dimension ``dim``: a job without N-D parallelism
        (``dp_replicate``: full copies, DDP's; ``dp_shard``: FSDP's shards). Pure."""
        return cls({dim: world_size}, rank, device_type, world_size=world_size, keep=(dim,))

    def __repr__(self) -> str:
        shown = ", ".join(f"{d}={s}" for d, s in self.sizes.items() if s > 1) or "one process"
        return f"ProcessMesh({shown}; rank {self.rank})"

    # ---- pure answers -----------------------------------------------------------------------------
    def dims(self, use: str) -> Tuple[str, ...]:
        """The dimensions ``use`` (a name in :data:`USES`, or a dimension) spans, outermost first. Pure."""
        if use in USES:
            return USES[use]
        if use in DIMS:
            return (use,)
        raise ValueError(f"unknown mesh dimension or use {use!r}; dimensions: {', '.join(DIMS)}; uses: "
                         f"{', '.join(USES)}")

    def size(self, use: str) -> int:
        """How many processes one group of ``use`` holds (1 where its dimensions are all 1). Pure."""
        return math.prod(self.sizes[d] for d in self.dims(use))

    def coordinate(self, dim: str) -> int:
        """This process's coordinate along dimension ``dim`` (0 where its size is 1). Pure."""
        if dim not in DIMS:
            raise ValueError(f"unknown mesh dimension {dim!r}; known: {', '.join(DIMS)}")
        return (self.rank // self._strides[dim]) % self.sizes[dim]

    def rank_in(self, use: str) -> int:
        """This process's rank within its group of ``use`` (its coordinates along the use's
        dimensions, outermost first; for a dimension, its coordinate). Pure."""
        index = 0
        for dim in self.dims(use):
            index = index * self.sizes[dim] + self.coordinate(dim)
        return index

    def ranks(self, use: str) -> Tuple[int, ...]:
        """The global ranks of this process's group of ``use``, in group-rank order. Pure."""
        dims = self.dims(use)
        found = [self.rank - sum(self.coordinate(d) * self._strides[d] for d in dims)]
        for dim in dims:
            found = [r + i * self._strides[dim] for r in found for i in range(self.sizes[dim])]
        return tuple(found)

    @property
    def keeps_metrics_share(self) -> bool:
        """Whether this process's inputs to ``gather_for_metrics`` (and ``reduce`` over the
        data-parallel processes) count: one process per batch does, coordinate 0 on every
        dimension whose processes share a batch (``pp``: pipeline rank 0, which ``pipeline_step``
        gives the loss and outputs; ``cp``, ``sp``, ``tp``). Pure."""
        return all(self.coordinate(d) == 0 for d in DIMS if d not in USES["batch"])

    def stage_ranks(self, stages_per_rank: int, v_shape: bool = False) -> Tuple[int, ...]:
        """The pipeline rank holding each of ``pp * stages_per_rank`` stages: looped (stage ``i``
        on ``i % pp``) or, with ``v_shape``, in a V (rank ``r`` holds ``r`` and ``2*pp-1-r``). Pure."""
        pp = self.sizes["pp"]
        stages = pp * stages_per_rank
        if v_shape:
            return tuple(i if i < pp else stages - 1 - i for i in range(stages))
        return tuple(i % pp for i in range(stages))

    # ---- device meshes, built once (collective the first time) ------------------------------------
    @property
    def device_mesh(self) -> Any:
        """The job's named ``DeviceMesh`` (``accelerator.torch_device_mesh``): the dimensions
        above size 1 and those in ``keep``, outermost first. The one ``init_device_mesh`` call
        of anyaccel. Collective the first time (every rank creates the groups)."""
        if self._device_mesh is None:
            build = self.build if self.build is not None else _torch_init_device_mesh()
            names = self._present(DIMS)
            self._device_mesh = build(self.device_type, tuple(self.sizes[d] for d in names), mesh_dim_names=names)
        return self._device_mesh

    @property
    def batch(self) -> Any:
        """The loader's processes: those that read different batches (each shards an epoch by
        ``rank_in("batch")`` of ``size("batch")``, which needs no group). Collective the first time."""
        return self.get("batch")

    @property
    def loss(self) -> Any:
        """The loss all-reduce: the processes whose tokens make one global batch
        (``causal_lm_loss``, ``global_token_mean``). Collective the first time."""
        return self.get("loss")

    @property
    def gradients(self) -> Any:
        """Gradient reduction: the processes that hold the same parameters and average their
        gradients (the factor of ``global_token_mean``'s gradient). Collective the first time."""
        return self.get("gradients")

    @property
    def sharding(self) -> Any:
        """FSDP2's mesh: ``(dp_replicate, dp_shard x cp x sp)``, 2-D for HSDP (replicas of
        shards), else the shard dimension alone (``sp``/``cp`` ranks hold the same parameters and
        see other tokens, so they shard the state further: torchtitan's ``dp_shard_cp``).
        Collective the first time."""
        shard = self._present(("dp_shard", "cp", "sp"))
        replicas = self._present(("dp_replicate",))
        if len(shard) <= 1:
            return self._slice(replicas + shard)
        if not replicas:
            return self._flat(shard)
        key = ("sharding",)
        if key not in self._built:  # all flattened, then cut in two: (dp_replicate, the shard dims joined)
            self._built[key] = self._flat(replicas + shard)._unflatten(
                0, (self.sizes["dp_replicate"], math.prod(self.sizes[d] for d in shard)),
                ("dp_replicate", "_".join(shard)))
        return self._built[key]

    @property
    def stage(self) -> Any:
        """The processes holding one pipeline stage (every dimension but ``pp``): the gradient
        norm counts a stage's copies over them. Collective the first time."""
        return self.get("stage")

    @property
    def tp(self) -> Any:
        """Tensor parallel: the processes that split each planned layer. Collective the first time."""
        return self.get("tp")

    @property
    def sp(self) -> Any:
        """Sequence parallel: the processes that hold slices of one sequence and exchange heads
        around attention. Collective the first time."""
        return self.get("sp")

    @property
    def pp(self) -> Any:
        """Pipeline parallel: the processes that hold the stages of one model and send
        activations between them. Collective the first time."""
        return self.get("pp")

    def get(self, use: str) -> Any:
        """The sub-mesh of ``use`` (a name in :data:`USES` or a dimension): its dimensions above
        size 1, one dimension or several flattened into one (a kept dimension of size 1 when it
        has none above 1; else None). Collective the first time."""
        if use == "sharding":
            return self.sharding
        dims = tuple(d for d in self.dims(use) if self.sizes[d] > 1) or self._present(self.dims(use))[:1]
        return self._slice(dims) if len(dims) <= 1 else self._flat(dims)

    def group(self, use: str) -> Any:
        """The process group of ``use``: None for a group of one, the job's default group when it
        spans every process (no new group is made), else the sub-mesh's. Collective the first
        time."""
        size = self.size(use)
        if size == 1:
            return None
        if size == self.world_size:
            import torch.distributed as dist

            return dist.group.WORLD
        return self.get(use).get_group()

    def forget(self) -> None:
        """Drop the device meshes built so far (a strategy's teardown); the sizes stay. Local."""
        self._device_mesh = None
        self._built.clear()

    def _present(self, dims: Sequence[str]) -> Tuple[str, ...]:
        return tuple(d for d in dims if self.sizes[d] > 1 or d in self.keep)

    def _slice(self, dims: Tuple[str, ...]) -> Any:
        mesh = self.device_mesh
        if not dims:
            return None
        if dims == tuple(mesh.mesh_dim_names or ()):
            return mesh
        return mesh[dims[0]] if len(dims) == 1 else mesh[dims]

    def _flat(self, dims: Tuple[str, ...]) -> Any:
        """``dims`` of the device mesh flattened into one dimension (made once)."""
        if dims not in self._built:
            self._built[dims] = self.device_mesh[dims]._flatten("_".join(dims))
        return self._built[dims]


def _torch_init_device_mesh() -> Callable[..., Any]:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh
