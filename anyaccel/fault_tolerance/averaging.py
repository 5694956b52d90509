"""The gradient average over the replica groups, overlapped with ``backward``: :class:`BucketedAverage`.

The parameters of the prepared models are cut, once, into buckets of one dtype and device, in
reverse order of registration (roughly the order ``backward`` produces their gradients), sized by
DDP's rule: a bucket is closed once it holds at least its limit, :data:`FIRST_BUCKET_BYTES` (1 MiB)
for the first and :data:`BUCKET_BYTES` (25 MiB) for the others. The small first bucket is what lets
the average overlap ``backward`` in a model of a few MB: it closes on the last layers' gradients and
starts while the first layers' are computed (one 25 MiB bucket would hold the whole model and start
only when ``backward`` ends). During an armed ``backward`` (a gradient-sync step of
``accelerator.backward``) a hook on each parameter marks its gradient ready; when every gradient
of the next bucket is ready, the bucket is flattened and all-reduced on torchft's gradient group
(:func:`.reduce.start_average`: sum over the quorum's groups, divided by their number) while
``backward`` goes on. Under FSDP2 the buckets are cut at its units instead (:func:`fsdp_units`;
a unit of more than 25 MiB closes a bucket once it holds 25 MiB and goes on in the next; the
first one not small), in the order ``backward`` finishes the units (blocks last-first, the root's
embedding and head together last): a unit's gradients are set together after its
reduce-scatter, so a 1 MiB first bucket would only add an all-reduce, where HSDP issues one per
unit. A bucket whose gradients already lie side by side in one storage (FSDP2's: the views of
one reduce-scatter output) is all-reduced in place, without the flat copy and the copy back.
Buckets are started **in bucket order only** (a bucket that completes early waits for the
ones before it), so every group issues the same all-reduces in the same order. After ``backward``,
:meth:`BucketedAverage.finish` starts what is left, waits for every bucket and copies the averages back.

**A parameter without a gradient** in this group (unused by its forward, and no gradient left
from accumulation micro-steps) is sent as zeros, so that every group's buckets keep their sizes;
:attr:`BucketedAverage.zeroed` names them after :meth:`BucketedAverage.finish`. What happens next
follows DDP's ``find_unused_parameters`` (``DistributedDataParallelKwargs``, read whatever splits the
model inside a group):

- **off** (DDP's default): nothing more is sent. A parameter some group has a gradient for receives
  the average (the others counting as zeros), and one no group has a gradient for receives zeros
  (the caller says so: DDP would stop here). A ``backward`` that raised (below) is known to its own
  group only.
- **on**: which parameters had a gradient travels in one small all-reduce started right after the
  **last bucket**'s, one flag per parameter and one more (below), ``len(parameters) + 1``
  elements, the same in every group whatever its data. As DDP with the option, one **no group**
  has a gradient for keeps ``.grad is None`` (an optimizer then leaves it alone, as a one-process
  step would). The flags are final when the last bucket starts: it starts last, during
  ``backward`` only once every gradient before it is ready, otherwise in
  :meth:`BucketedAverage.finish`. (Appending them to the last bucket would force its flat copy
  every step, where FSDP2's gradients are otherwise averaged in place; on its own, the all-reduce
  is one more wait a step: ``benchmarks/README.md``.)

**A failed ``backward``** (:meth:`BucketedAverage.finish` with ``abort=True``, on the process
whose ``backward`` raised, in a group of one process: in a group of several the process ends
instead, :meth:`~anyaccel.fault_tolerance.replica.Replica.abandon`): the buckets not started yet are started anyway, whatever they hold,
so that every group issues this step's all-reduces and the next step's line up;
:attr:`BucketedAverage.aborted` is then set here (the caller votes the step down) and, with the
flags (their last element) when they had not left yet, in every group, so that no group commits
the step. Without them (or raised after they left) the other groups commit it: their average
holds the failed group's gradients as they stood (every one computed, finished or not yet sent,
and for a parameter ``backward`` had not reached, zeros, or what accumulation micro-steps left in
it), and the failed group, one step behind, heals from a peer at its next quorum. Every group
must use the same ``find_unused_parameters``: the flags' all-reduce is one more per step.

Inside a replica group of several processes each rank averages what it holds with the same
rank of the other groups (torchft's gradient group joins rank ``r`` of every group): a full
gradient under DDP or one process, its local shard under FSDP2, tensor, sequence or expert
parallelism (:func:`.shards.local_part`). **Under DDP** every bucket starts after ``backward``
(:func:`synced_after_backward`; ``after_backward``): DDP's reducer averages the group's gradients in
buckets of its own, and ``.grad`` holds that average only when ``backward`` ends (copied back
then, or, with ``gradient_as_bucket_view``, written in place as DDP's all-reduce lands), so a
parameter's hook sees this rank's gradient alone. A bucket started there, and its average copied
back, would replace the group's average with this rank's own, and the ranks of the group would
drift apart (what happened before 2026-11-30). The price is no overlap between ``backward`` and
the average over the groups, for DDP inside groups of several processes only. FSDP2 (torch
2.13) runs the per-parameter hooks after each unit's reduce-scatter, when it sets the unit's
sharded gradients: the unit's buckets start then, during
``backward`` (with the root as the only unit, at its end, where HSDP's own all-reduce would run).
:attr:`BucketedAverage.started_early`, :attr:`BucketedAverage.early_bytes` and
:attr:`BucketedAverage.copied_bytes` say, for the last step, how many buckets (and bytes of
gradients) started during ``backward`` and how many bytes were copied to flatten.

One ``backward`` per optimizer step is averaged (as DDP: a gradient that changes after its bucket
left would be lost; accumulation micro-steps are not armed: their gradients, accumulated in
``.grad``, are averaged once with the sync step's, a parameter with a micro-step gradient only
included). As DDP's reducer, a parameter is
ready once per ``backward`` (a parameter tied between prepared models, listed twice, is averaged
once), and a second accumulation into a gradient whose bucket already left (a module shared by
several reentrant activation-checkpoint segments) raises :class:`~anyaccel.errors.FaultToleranceError`
instead of averaging only its first part. Local, but the all-reduces are
collective over the replica groups of the step's quorum.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..errors import FaultToleranceError
from .shards import local_part

__all__ = ["BucketedAverage", "BUCKET_BYTES", "FIRST_BUCKET_BYTES", "buckets_of", "fsdp_units", "side_by_side",
           "synced_after_backward"]

#: the first bucket (the last layers' gradients) is closed once it holds this many bytes: DDP's
#: ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``
FIRST_BUCKET_BYTES = 1024 * 1024
#: every later bucket is closed once it holds this many bytes: DDP's ``bucket_cap_mb=25``
BUCKET_BYTES = 25 * 1024 * 1024


def buckets_of(tensors: List[torch.Tensor], units: Optional[List[int]] = None) -> List[List[int]]:
    """Indices of ``tensors`` grouped into buckets, DDP's rule: consecutive tensors of one dtype and
    device, a bucket closed as soon as it holds at least :data:`FIRST_BUCKET_BYTES` (the first) or
    :data:`BUCKET_BYTES` (the others); a change of dtype or device closes it too. ``units``: per
    tensor, the FSDP2 unit whose reduce-scatter produces its gradient (:func:`fsdp_units`); then a
    change of unit closes a bucket too, and the first one is not small (a unit's gradients are
    ready all at once: a small first bucket would add an all-reduce and hide nothing). Local, pure."""
    buckets: List[List[int]] = []
    first_limit = FIRST_BUCKET_BYTES if units is None else BUCKET_BYTES
    size, open_bucket = 0, False
    for i, t in enumerate(tensors):
        kind = (t.dtype, t.device)
        if open_bucket:
            head = buckets[-1][0]
            if kind != (tensors[head].dtype, tensors[head].device) or (units is not None and units[i] != units[head]):
                open_bucket = False
        if not open_bucket:
            buckets.append([])
            size, open_bucket = 0, True
        buckets[-1].append(i)
        size += t.numel() * t.element_size()
        if size >= (first_limit if len(buckets) == 1 else BUCKET_BYTES):
            open_bucket = False
    return buckets


def fsdp_units(models: List[torch.nn.Module]) -> Dict[int, int]:
    """``id(parameter)`` -> the FSDP2 unit (a ``fully_shard``-ed module of ``models``) whose
    reduce-scatter produces its gradient, for every parameter FSDP2 manages (a nested unit's
    parameters are its own, not its parent's); empty without FSDP2. Units are numbered in the
    order ``backward`` finishes them: children before their parent (the root, which owns the
    embedding and the head, last), siblings last-registered first. Local, pure."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # (torch without distributed)
        return {}
    units: Dict[int, int] = {}
    count = 0

    def visit(module: torch.nn.Module) -> None:
        nonlocal count
        for child in reversed(list(module.children())):
            visit(child)
        if isinstance(module, FSDPModule):
            for p in module.parameters():
                units.setdefault(id(p), count)  # (a nested unit's parameters are numbered already)
            count += 1

    for model in reversed(models):
        visit(model)
    return units


def synced_after_backward(models: List[torch.nn.Module]) -> bool:
    """Whether a prepared model is wrapped in DDP (compiled or not), whose reducer has the group's
    averaged gradients in ``.grad`` only when ``backward`` ends: the average over the groups must
    then start from ``.grad`` after ``backward`` (module docstring). Called by
    :meth:`~anyaccel.fault_tolerance.replica.Replica.watch` with the prepared models. Local, pure."""
    from torch.nn.parallel import DistributedDataParallel

    return any(isinstance(m, DistributedDataParallel) for model in models for m in model.modules())


def side_by_side(tensors: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """One flat tensor over the storage of ``tensors`` (of one dtype) when they are contiguous
    and lie end to end in one storage, in some order (writing it writes them); else None. Local."""
    if len(tensors) < 2:
        only = tensors[0] if tensors else None
        return only.view(-1) if only is not None and only.is_contiguous() else None
    storage = tensors[0].untyped_storage().data_ptr()
    if any(not t.is_contiguous() or t.untyped_storage().data_ptr() != storage for t in tensors):
        return None
    ordered = sorted(tensors, key=lambda t: t.storage_offset())
    offset = ordered[0].storage_offset()
    for t in ordered:
        if t.storage_offset() != offset:
            return None
        offset += t.numel()
    first = ordered[0]
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (offset - first.storage_offset(),))


class BucketedAverage:
    """The overlapped average of ``parameters`` (module docstring). ``allreduce(flat)`` starts
    the average of one flat tensor and returns something with ``wait()``; ``before_first`` runs
    before the first bucket of a step starts (the step's quorum); ``units``: :func:`fsdp_units` of
    the models (buckets are then cut at their boundaries, :func:`buckets_of`);
    ``find_unused_parameters``: send the per-parameter flags (module docstring); ``after_backward``:
    start every bucket in :meth:`finish`, none during ``backward`` (DDP inside the group:
    :func:`synced_after_backward`)."""

    def __init__(self, parameters: List[torch.nn.Parameter], allreduce: Callable[[torch.Tensor], Any],
                 before_first: Callable[[], None], units: Optional[Dict[int, int]] = None,
                 find_unused_parameters: bool = False, after_backward: bool = False):
        # once each (a parameter tied between prepared models is listed twice: DDP keeps its first
        # place), reversed: backward produces the last layers' gradients first
        once: Dict[int, torch.nn.Parameter] = {}
        for p in parameters:
            once.setdefault(id(p), p)
        self._params = list(reversed(list(once.values())))
        self._allreduce = allreduce
        self._before_first = before_first
        self._find_unused = find_unused_parameters
        # cut at FSDP2's units when every parameter has one, in the order backward finishes the units
        # (the root's embedding and head together, last), else by DDP's rule alone
        cut = units if units and all(id(p) in units for p in self._params) else None
        if cut is not None:
            order = {id(p): i for i, p in enumerate(self._params)}
            self._params.sort(key=lambda p: (cut[id(p)], order[id(p)]))
        self._buckets = buckets_of(list(self._params), [cut[id(p)] for p in self._params] if cut is not None else None)
        self._bucket_of = {}
        for b, members in enumerate(self._buckets):
            for i in members:
                self._bucket_of[id(self._params[i])] = (b, i)
        self._armed = False
        self._finishing = False
        self._abort = False  # this step's backward raised here (finish(abort=True))
        self.aborted = False  # the last step: a backward raised, here or (with the flags) in some group
        self._zeroed: List[int] = []  # this step: parameters without a gradient here, given zeros
        self._flags_sent: Optional[Tuple[torch.Tensor, Any]] = None  # this step's flags and their all-reduce
        self._ready: List[int] = []  # per bucket: gradients ready
        self._seen: List[bool] = []  # per parameter: its gradient is ready in this backward
        self._next = 0  # the next bucket to start
        self._started: List[Any] = []  # (bucket, grads, flat, work); flat None: averaged in place
        self.started_early = 0  # buckets of the last step started during backward (before finish)
        self.early_bytes = 0  # their bytes of gradients
        self.copied_bytes = 0  # bytes the last step copied into flat buckets (0: all in place)
        # (none under DDP: .grad is this rank's alone while backward runs, module docstring)
        self._handles = [] if after_backward else [p.register_post_accumulate_grad_hook(self._on_grad)
                                                   for p in self._params]

    def arm(self) -> None:
        """The next ``backward`` is a gradient-sync step: average its gradients. Local."""
        self._armed = True
        self._ready = [0] * len(self._buckets)
        self._seen = [False] * len(self._params)
        self._next = 0
        self._started = []
        self._zeroed, self._flags_sent = [], None
        self.started_early = self.early_bytes = self.copied_bytes = 0

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._armed:
            return
        found = self._bucket_of.get(id(param))
        if found is None:
            return
        bucket, i = found
        if self._seen[i]:  # a second accumulation in one backward (reentrant checkpointing of a shared module)
            if bucket < self._next:  # its bucket left with the first part: the average would be wrong
                raise FaultToleranceError(
                    f"a parameter of shape {tuple(param.shape)} ({param.dtype}) received its gradient twice in one "
                    "backward, after its bucket's average over the replica groups had started: the second part would "
                    "be left out of the average. A module used in several reentrant activation-checkpoint segments "
                    "does this; use torch.utils.checkpoint.checkpoint(..., use_reentrant=False) (or "
                    "gradient_checkpointing_kwargs={'use_reentrant': False}), which accumulates once per backward")
            return  # its bucket has not left: it will carry both parts
        self._seen[i] = True
        self._ready[bucket] += 1
        while self._next < len(self._buckets) and self._ready[self._next] == len(self._buckets[self._next]):
            self._start(self._next)

    def _start(self, bucket: int) -> None:
        if self._next == 0:
            self._before_first()
        grads = [self._grad(i) for i in self._buckets[bucket]]
        nbytes = sum(g.numel() * g.element_size() for g in grads)
        if not self._finishing:
            self.started_early += 1
            self.early_bytes += nbytes
        # (everything that may fail, an allocation, before the first all-reduce is issued: a retry of
        # this bucket from finish() must not send it twice)
        last = bucket == len(self._buckets) - 1
        flags = self._flags(grads[0]) if last and self._find_unused else None  # final by now (module docstring)
        span = side_by_side(grads)
        flat = torch.cat([g.reshape(-1) for g in grads]) if span is None else None
        self._next = bucket + 1
        if flat is not None:
            self.copied_bytes += nbytes
            self._started.append((bucket, grads, flat, self._allreduce(flat)))
        else:
            self._started.append((bucket, grads, None, self._allreduce(span)))
        if flags is not None:  # the flags follow the last bucket
            self._flags_sent = (flags, self._allreduce(flags))

    def _flags(self, like: torch.Tensor) -> torch.Tensor:
        """Per parameter 1 (a gradient here) or 0 (zeros sent), then 1 when this step's backward
        raised here: averaged over the groups right after the last bucket. Local."""
        flags = torch.ones(len(self._params) + 1)
        flags[-1] = 1.0 if self._abort else 0.0
        if self._zeroed:
            flags[self._zeroed] = 0.0
        return flags.to(device=like.device, dtype=like.dtype)

    def _grad(self, i: int) -> torch.Tensor:
        param = self._params[i]
        if param.grad is None:  # no gradient here this step: zeros in the average (module docstring)
            param.grad = torch.zeros_like(param)
            self._zeroed.append(i)
        return local_part(param.grad)

    def finish(self, abort: bool = False) -> bool:
        """Start what is left, wait for every bucket and put the averages in the gradients; with
        ``find_unused_parameters``, a parameter no group had a gradient for is left without one.
        ``abort``: this process's ``backward`` raised (module docstring): the buckets are sent as
        they are, no average is copied back here, and :attr:`aborted` is set here (with the flags:
        in every group). Returns False when the step was not armed (nothing averaged). Collective
        over the replica groups."""
        if not self._armed:
            return False
        self._finishing, self._abort = True, abort
        try:
            while self._next < len(self._buckets):
                self._start(self._next)
        finally:
            self._finishing, self._abort = False, False
        self._armed = False
        for _, _, _, work in self._started:
            work.wait()
        unused = self._settle_flags(abort)
        for _, grads, flat, _ in ([] if self.aborted else self._started):
            if flat is None:  # averaged in place
                continue
            for grad, averaged in zip(grads, torch.split(flat, [g.numel() for g in grads])):
                grad.copy_(averaged.view_as(grad))
        for i in unused:  # no group had a gradient: none, as DDP (module docstring)
            self._params[i].grad = None
        self._started = []
        return True

    @property
    def zeroed(self) -> List[torch.nn.Parameter]:
        """The parameters the last finished step sent zeros for here (no gradient in this group). Local."""
        return [self._params[i] for i in self._zeroed]

    def _settle_flags(self, abort: bool) -> List[int]:
        """Wait for the averaged flags: set :attr:`aborted`; return which of the parameters given
        zeros here no group had a gradient for. Without the flags (module docstring): ``aborted``
        is ``abort`` (this process's backward raised), and none is returned. Local (the all-reduce
        it waits for is collective)."""
        sent, self._flags_sent = self._flags_sent, None
        if sent is None:  # not sent (find_unused_parameters off), or no parameters
            self.aborted = abort
            return []
        flags, work = sent
        work.wait()
        seen = flags[self._zeroed + [len(self._params)]].tolist()  # one read from the device
        self.aborted = abort or seen[-1] > 0  # (raised after the last bucket left: the flags said nothing yet)
        return [i for i, used in zip(self._zeroed, seen) if used == 0]

    def close(self) -> None:
        """Remove the hooks. Local."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def bucket_count(self) -> int:
        """How many all-reduces a step issues. Local."""
        return len(self._buckets)

    def covers(self, parameters: List[torch.nn.Parameter]) -> Optional[bool]:
        """Whether ``parameters`` are exactly the ones averaged. Local."""
        return {id(p) for p in parameters} == {id(p) for p in self._params}
