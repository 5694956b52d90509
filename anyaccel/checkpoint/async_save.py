"""Asynchronous checkpoints: ``save_state(..., async_save=True)`` returns once the state is copied.

One :class:`AsyncSaver` per ``Accelerator`` (its owner) holds at most one save in flight:

1. On the training thread, collectively: the directory is chosen and its temporary sibling
   created, and everything to be saved is copied to host memory (:func:`~anyaccel.checkpoint.
   training_state.begin_save` given the saver's :class:`StagingBuffers`; a sharded strategy's
   shards go through ``torch.distributed.checkpoint.async_save`` with a DCP stager that copies
   into the same buffers, :func:`~anyaccel.strategies.dcp.async_stager`). The buffers are kept
   from one save to the next: after the first save, staging is a copy into memory already
   mapped, which is nearly all the stall. ``save()`` returns: training goes on.
2. On a thread of the saver's own, the files are written, every process agrees that every process
   wrote its part, and the main process writes the manifest last and renames the checkpoint into
   place (:func:`~anyaccel.checkpoint.training_state.finish_save`): the same atomic protocol as a
   synchronous save, so the checkpoint becomes visible only when complete on every process, and a
   process killed during the write leaves the previous checkpoint as the newest loadable one.
   The collectives of this phase use a gloo group created for the saver (as torchtitan does), never
   the group training uses, so they cannot interleave with the training's collectives.

The next ``save()`` first waits for the one in flight; :meth:`AsyncSaver.wait` waits and raises its
error (the same :class:`~anyaccel.errors.CheckpointError` on every process); :meth:`close`
waits and releases the group and the buffers (``end_training``). The thread is not a daemon: a
process that reaches its end waits for the write. Extra host memory: one copy of what this process
stages (the main process's full model and optimizer states for DDP, each process's shards for
FSDP2), held from the first asynchronous save until :meth:`AsyncSaver.close`.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..errors import CheckpointError
from . import layout
from .layout import ProjectConfiguration
from .training_state import PendingSave, TrainingState, begin_save, finish_save

__all__ = ["AsyncSaver", "StagingBuffers"]


class StagingBuffers:
    """Host buffers that asynchronous saves copy into, kept from one save to the next: the n-th
    tensor of a given shape and dtype staged by a save lands in the n-th buffer of that shape and
    dtype (a training state has the same tensors at every save, in the same order), so after the
    first save staging is a ``copy_`` into memory already mapped, not an allocation (fresh pages
    cost more than the copy itself). Buffers of device tensors are pinned where the device allows.
    Reusing them is safe because at most one save is in flight and the next waits for it. Local.

    Extra host memory: one copy of what this process stages, held while the saver lives
    (:meth:`release` frees it: :meth:`AsyncSaver.close`)."""

    def __init__(self) -> None:
        self._buffers: Dict[Tuple[Any, ...], List[torch.Tensor]] = {}
        self._used: Dict[Tuple[Any, ...], int] = {}

    def begin(self) -> "StagingBuffers":
        """Start staging one save (the counts restart). Local."""
        self._used = {}
        return self

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` in a reused buffer (the :data:`~anyaccel.checkpoint.serialize.Stage`
        of an asynchronous save). Local."""
        pin = tensor.device.type != "cpu" and _pinnable(tensor.device)
        key = (tuple(tensor.shape), tensor.dtype, pin)
        n = self._used.get(key, 0)
        self._used[key] = n + 1
        kept = self._buffers.setdefault(key, [])
        if n == len(kept):
            kept.append(torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin))
        return kept[n].copy_(tensor.detach())

    def end(self) -> None:
        """Free the buffers this save did not use (the state changed since the last one). Local."""
        for key in list(self._buffers):
            used = self._used.get(key, 0)
            if used:
                del self._buffers[key][used:]
            else:
                del self._buffers[key]

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the buffers hold. Local."""
        return sum(t.numel() * t.element_size() for kept in self._buffers.values() for t in kept)

    def release(self) -> None:
        """Free every buffer. Local."""
        self._buffers, self._used = {}, {}


class AsyncSaver:
    """At most one asynchronous ``save_state`` in flight for one training job (see the module
    docstring). Collective methods must be called by every process in the same order."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._staging = StagingBuffers()  # host copies, full states (main process) and shards alike
        self._stager: Any = None  # sharded states: a DCP stager copying into self._staging
        self._error: Optional[BaseException] = None
        self._group: Any = None
        self._group_made = False
        self.directory: Optional[str] = None  # of the save in flight, or the last one

    @property
    def in_flight(self) -> bool:
        """True while a write runs. Local."""
        return self._thread is not None and self._thread.is_alive()

    def save(self, state: TrainingState, output_dir: Optional[str], project_config: ProjectConfiguration,
             safe_serialization: bool = True) -> str:
        """Wait for the save in flight (raising its error), copy ``state`` and start writing it to
        ``output_dir`` (or the next automatic ``checkpoint_<n>``); return that directory at once.
        Collective (every process calls it). The directory holds a complete checkpoint only once
        :meth:`wait` has returned."""
        self.wait()
        group = self._saver_group(state.num_processes if state.collective else 1)
        sharded = None
        if state.strategy.checkpoint_format != "full":  # DCP shards, or a strategy's own files (DeepSpeed's)
            def sharded(tmp: str) -> Any:
                return state.strategy.save_sharded(tmp, state.models, state.optimizers, process_group=group,
                                                   asynchronous=self._sharded_stager())
        try:
            pending = begin_save(state, output_dir, project_config, safe_serialization, copy=self._staging.begin(),
                                 sharded=sharded)
        finally:
            self._staging.end()
        if output_dir is None:  # the next save gets the next number, whether or not this one is written yet
            project_config.iteration = layout.checkpoint_index(pending.final) + 1
        self.directory = pending.final
        self._thread = threading.Thread(target=self._write, args=(pending, group), daemon=False,
                                        name="anyaccel-async-save")
        self._thread.start()
        return pending.final

    def _write(self, pending: PendingSave, group: Any) -> None:
        try:
            finish_save(pending, _gather_on(group))
        except BaseException as exc:  # noqa: BLE001 - kept for wait(), which raises it on the training thread
            self._error = exc
            print(f"anyaccel: the asynchronous save_state({pending.final}) failed: {exc}. The previous checkpoint "
                  "stays the newest complete one; the error is raised by the next save_state or end_training.",
                  file=sys.stderr, flush=True)

    def wait(self) -> Optional[str]:
        """Block until the save in flight is complete on every process; return its directory
        (None when none was started). Raises the save's :class:`CheckpointError` (every process
        raises it: the agreement reports a failure on any process to all). Local wait; the write it
        waits for is collective."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"the asynchronous save_state({self.directory}) failed: "
                                  f"{type(error).__name__}: {error}") from error
        return self.directory if thread is not None else None

    def close(self) -> None:
        """Wait for the save in flight (raising its error), then release the saver's group.
        Collective when a group was made (every process calls it, e.g. from ``end_training``)."""
        try:
            self.wait()
        finally:
            self._staging.release()
            stager, self._stager = self._stager, None
            if stager is not None:
                stager.close()
            group, self._group, self._group_made = self._group, None, False
            if group is not None:  # torch forgets it; the object lives until the process ends
                from ..process import process_group

                process_group.retire(group)

    def _sharded_stager(self) -> Any:
        if self._stager is None:
            from ..strategies.dcp import async_stager

            self._stager = async_stager(self._staging)
        return self._stager

    def _saver_group(self, num_processes: int) -> Any:
        """The saver's own gloo group, made at the first save (collective: ``new_group``)."""
        if num_processes > 1 and not self._group_made:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")
            self._group_made = True
        return self._group


def _pinnable(device: torch.device) -> bool:
    """Whether host buffers for copies from ``device`` can be pinned (it is the current accelerator)."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator is not None and accelerator.type == device.type


def _gather_on(group: Any):
    """``gather(obj) -> [obj of every rank]`` on ``group`` (None: one process, never called)."""

    def gather(obj: Any) -> List[Any]:
        import torch.distributed as dist

        out: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    return gather
