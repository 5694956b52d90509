"""The training-state protocol: ``save_state`` and ``load_state``.

Who does what: :func:`save_state` and :func:`load_state` are called by every process with a
:class:`TrainingState` listing, explicitly, what to save (the ``Accelerator`` builds it from what
it prepared). For strategies that store full states, the main process writes the shared files
(models, optimizers, schedulers, scaler, loader positions, registered objects); a sharded strategy
has every process write its shards. Each process writes its own RNG file. Where every process
holds the whole state (one process, DDP) processes may name different directories, as Accelerate
allows (each its own temporary directory, say): the first process naming a directory writes a
whole checkpoint there, and ``load_state`` with different directories has each process read its own. Failures on any process
are reported on all of them (nobody is left waiting in a barrier). The directory layout and the
atomic replacement are in :mod:`anyaccel.checkpoint.layout`. A state marked ``alone`` is saved or
loaded by the main process without the others, nothing collective (who calls:
:mod:`anyaccel.checkpoint.participation`).

Loading uses ``torch.load(weights_only=True)``; only a file whose content needs full unpickling
(e.g. a custom object's state) falls back to ``weights_only=False``, with a warning naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import ops
from ..errors import CheckpointError
from ..fileio import fsync_dir, remove_tree, write_synced
from . import layout
from . import per_process
from .agreement import agreed_checkpoint
from .full_states import read_full_models
from .layout import MANIFEST, SAVED_ALONE, ProjectConfiguration, file_name
from .per_process import holds_whole_state
from .rng import get_rng_state, restore_rng_file, rng_source_rank
from .serialize import (Stage, bytes_writer, model_file_writers, snapshot, to_cpu, torch_load,
                        torch_writer)

__all__ = ["TrainingState", "PendingSave", "begin_save", "finish_save", "save_state", "load_state", "holds_whole_state"]


@dataclasses.dataclass
class TrainingState:
    """Everything ``save_state`` stores and ``load_state`` restores, in prepare order.

    ``strategy`` turns models and optimizers into state (and back); ``save_hooks`` are called as
    ``hook(models, weights, output_dir)`` before models are written (a hook may remove entries
    from ``weights`` to leave a model out), ``load_hooks`` as ``hook(models, input_dir)`` (it may
    remove models to load them itself); ``models`` are the user's modules, as in Accelerate."""

    models: List[torch.nn.Module]
    optimizers: List[Any]
    schedulers: List[Any]
    dataloaders: List[Any]
    custom_objects: List[Any]
    scaler: Optional[Any]
    strategy: Any
    process_index: int = 0
    num_processes: int = 1
    mixed_precision: str = "no"
    gradient_accumulation_steps: int = 1
    step: int = 0
    save_hooks: List[Callable] = dataclasses.field(default_factory=list)
    load_hooks: List[Callable] = dataclasses.field(default_factory=list)
    #: the main process saves or loads without the others (called alone: :mod:`.participation`)
    alone: bool = False

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def collective(self) -> bool:  # saving and loading it takes every process (several, not alone)
        return self.num_processes > 1 and not self.alone

    def counts(self) -> Dict[str, int]:
        return {"models": len(self.models), "optimizers": len(self.optimizers), "schedulers": len(self.schedulers),
                "dataloaders": len(self.dataloaders), "custom_objects": len(self.custom_objects)}


# ---- save_state ----------------------------------------------------------------------------------
Gather = Callable[[Any], List[Any]]


def _gather(obj: Any) -> List[Any]:
    """One object from every process, on every process (the job's default group)."""
    return ops.gather_object([obj])


def _agree(num_processes: int, error: Optional[BaseException], payload: Any, what: str, directory: str,
           gather: Gather = _gather) -> List[Any]:
    """Exchange (error, payload) between all processes; raise on every process if any failed.
    Collective (one object all-gather through ``gather``) in a multi-process job."""
    mine = (None if error is None else f"{type(error).__name__}: {error}", payload)
    results = gather(mine) if num_processes > 1 else [mine]
    failed = [(rank, err) for rank, (err, _) in enumerate(results) if err]
    if failed:
        details = "; ".join(f"process {rank}: {err}" for rank, err in failed)
        raise CheckpointError(f"save_state({directory}) failed while {what}: {details}") from error
    return [p for _, p in results]


Job = Callable[[], Dict[str, int]]


def _file_job(directory: str, name: str, writer: Callable[[str], None]) -> Job:
    return lambda: {name: write_synced(os.path.join(directory, name), writer)}


def _full_model_jobs(state: TrainingState, tmp: str, safe: bool, copy: Optional[Stage],
                     writer: bool) -> Tuple[List[Job], int]:
    """Strategies with full states: the directory's writer (the main process, unless processes
    named directories of their own) writes one file per model and optimizer. Returns the jobs and
    the number of models written (a save hook may take some over)."""
    weights = [state.strategy.model_state_dict(m) for m in state.models]  # collective for some strategies
    models = [state.strategy.unwrap(m) for m in state.models]  # the user's modules, as Accelerate's hooks get them
    for hook in state.save_hooks:
        hook(models, weights, tmp)
    optimizer_states = [state.strategy.optimizer_state_dict(o) for o in state.optimizers]
    jobs: List[Job] = []
    if writer:
        for i, weight in enumerate(weights):
            jobs += [_file_job(tmp, name, writer) for name, writer in
                     model_file_writers(file_name("model", i), weight, safe, copy).items()]
        for i, optimizer_state in enumerate(optimizer_states):
            opt = snapshot(optimizer_state, copy) if copy is not None else to_cpu(optimizer_state)
            jobs.append(_file_job(tmp, file_name("optimizer", i, ".bin"), torch_writer(opt)))
    return jobs, len(weights)


def _shared_file_jobs(state: TrainingState, tmp: str, copy: Optional[Stage]) -> List[Job]:
    """The directory's writer: schedulers, scaler, loader positions, registered objects."""
    own = to_cpu if copy is None else snapshot  # small: new host copies, not the stage's buffers
    jobs = [_file_job(tmp, file_name("scheduler", i, ".bin"), torch_writer(own(s.state_dict())))
            for i, s in enumerate(state.schedulers)]
    if state.scaler is not None:
        jobs.append(_file_job(tmp, "scaler.pt", torch_writer(own(state.scaler.state_dict()))))
    for i, loader in enumerate(state.dataloaders):
        loader_state = loader.state_dict() if hasattr(loader, "state_dict") else {}
        jobs.append(_file_job(tmp, file_name("dataloader", i, ".json"),
                              bytes_writer(json.dumps(loader_state, sort_keys=True).encode())))
    jobs += [_file_job(tmp, f"custom_checkpoint_{i}.pkl", torch_writer(own(obj.state_dict())))
             for i, obj in enumerate(state.custom_objects)]
    return jobs


@dataclasses.dataclass
class PendingSave:
    """A :func:`begin_save` whose content is taken but not yet written: ``jobs`` write this
    process's files; :func:`finish_save` runs them, agrees and commits."""

    final: str
    tmp: str
    is_main_process: bool  # this process writes the directory's shared files, manifest and commit
    num_processes: int
    manifest: Dict[str, Any]
    jobs: List[Job]
    total_limit: Optional[int]
    automatic: bool
    error: Optional[BaseException] = None
    directories: Optional[List[str]] = None  # each process's directory, resolved (None: all write ``final``)
    process_index: int = 0


def begin_save(state: TrainingState, output_dir: Optional[str], project_config: ProjectConfiguration,
               safe_serialization: bool = True, copy: Optional[Stage] = None,
               sharded: Optional[Callable[[str], Job]] = None) -> PendingSave:
    """The first half of :func:`save_state`: choose the directory, create its temporary sibling and
    take what is to be saved. Collective (on the job's default group). With ``copy`` (a
    :data:`~anyaccel.checkpoint.serialize.Stage`) every job holds its own host copy of the models'
    and optimizers' tensors, made by it (training may change the objects before the jobs run); ``sharded``,
    given the temporary directory, starts a sharded strategy's write and returns the job that
    waits for it. An error taking the content is kept in ``error`` and reported by
    :func:`finish_save` on every process. Longer than 60 lines: the order of its steps (the
    directory agreed, the RNG states taken after the save hooks, every error kept for the
    agreement) is the protocol, read in one place."""
    save_id = uuid.uuid4().hex  # rank 0's, on every process (below): names this call in every manifest it writes
    automatic = output_dir is None
    if automatic:
        if not project_config.automatic_checkpoint_naming:
            raise ValueError("save_state() needs output_dir, or ProjectConfiguration(automatic_checkpoint_naming=True, "
                             "project_dir=...) to name checkpoints automatically")
        root = layout.checkpoint_root(project_config)
        index = max([int(project_config.iteration)] + [i + 1 for i in layout.checkpoint_indices(root)])
        if state.collective:
            index, save_id = ops.broadcast_object_list([(index, save_id)], from_process=0)[0]
        output_dir = os.path.join(root, f"checkpoint_{index}")
    final = os.path.abspath(os.fspath(output_dir))
    directories = None
    if state.collective and not automatic:
        directories, save_id = per_process.save_directories(state, final, save_id)
        final = directories[state.process_index]  # resolved: two paths to one directory write it once
    # the directory's writer: the first process naming it (the main process when all name one)
    rank = state.process_index
    main = state.is_main_process if directories is None else directories.index(final) == rank
    tmp = layout.sibling(final, layout.TMP_SUFFIX)

    error: Optional[BaseException] = None
    if main:
        try:
            try:
                layout.prepare_tmp(final, tmp)
            except FileExistsError:  # another writer made it just now: one directory, two paths (caught below)
                if directories is None:
                    raise
            if directories is not None:  # others may reach this directory by paths that look different
                per_process.stamp_writer(tmp, rank)
        except Exception as exc:  # noqa: BLE001 - reported on every process by _agree
            error = exc
    ranks = state.num_processes if state.collective else 1  # the processes that take part
    _agree(ranks, error, None, "preparing the directory", final)

    jobs: List[Job] = []
    saved_models, error = len(state.models), None
    try:
        if not os.path.isdir(tmp):
            raise CheckpointError(f"process {state.process_index} cannot see {tmp}, which the main process "
                                  "created: output_dir must be on a filesystem shared by every process (or "
                                  "different on every process, where each holds the whole state: DDP)")
        if main and directories is not None:  # every writer has stamped its directory by now
            per_process.check_sole_writer(tmp, rank, final, directories)
        if state.strategy.checkpoint_format != "full":  # "sharded" (DCP) or a strategy's own (DeepSpeed's)
            jobs.append(sharded(tmp) if sharded is not None
                        else (lambda: state.strategy.save_sharded(tmp, state.models, state.optimizers)))
        else:
            model_jobs, saved_models = _full_model_jobs(state, tmp, safe_serialization, copy, main)
            jobs += model_jobs
        # The RNG states after the save hooks, as Accelerate takes them: a hook may draw (diffusers'
        # EMAModel.save_pretrained initialises a model), and the uninterrupted run goes on from there.
        rng = torch_writer(get_rng_state())
        jobs.insert(0, _file_job(tmp, f"random_states_{state.process_index}.pkl", rng))
        if main:
            jobs += _shared_file_jobs(state, tmp, copy)
    except Exception as exc:  # noqa: BLE001
        error = exc
    manifest = {
        "format": layout.FORMAT,
        "format_version": layout.FORMAT_VERSION,
        "anyaccel_version": _anyaccel_version(),
        "torch_version": torch.__version__,
        "world_size": state.num_processes,
        "saved_by": SAVED_ALONE if state.alone else "every process",
        "data_parallel_size": int(state.strategy.data_parallel()[1]),
        "strategy": state.strategy.name,
        "checkpoint_format": state.strategy.checkpoint_format,
        "mixed_precision": state.mixed_precision,
        "gradient_accumulation_steps": state.gradient_accumulation_steps,
        "step": int(state.step),
        **state.counts(),
        "models": saved_models,
        "scaler": state.scaler is not None,
        "safe_serialization": bool(safe_serialization),
        "save_id": save_id,  # the same in every directory this call writes (see per_process)
    }
    return PendingSave(final, tmp, main, ranks, manifest, jobs,
                       project_config.total_limit if automatic else None, automatic, error, directories, rank)


def finish_save(pending: PendingSave, gather: Gather = _gather) -> str:
    """The second half of :func:`save_state`: write this process's files, agree that every process
    did, and (main process) write the manifest last and rename the checkpoint into place. Collective
    through ``gather`` (the job's default group unless another is given: an asynchronous save runs
    this in a thread of its own, on a group of its own). Returns the directory; raises
    :class:`CheckpointError` on every process when any failed, leaving the previous checkpoint."""
    p = pending
    files: Dict[str, int] = {}
    error = p.error
    if error is None:
        try:
            for job in p.jobs:
                files.update(job())
        except Exception as exc:  # noqa: BLE001
            error = exc
    p.jobs = []  # the staged copies are freed as soon as they are written
    try:
        per_rank = _agree(p.num_processes, error, files, "writing files", p.final, gather)
    except CheckpointError:
        if p.is_main_process:
            remove_tree(p.tmp)
        raise

    error = None
    if p.is_main_process:
        try:
            all_files: Dict[str, int] = {}
            for rank, part in enumerate(per_rank):
                if p.directories is None or p.directories[rank] == p.final:  # the files written here
                    all_files.update(part)
            if p.directories is not None:
                per_process.remove_stamp(p.tmp, p.process_index)
            layout.carry_over(p.final, p.tmp)
            data = json.dumps({**p.manifest, "files": all_files}, indent=1, sort_keys=True).encode()
            write_synced(os.path.join(p.tmp, MANIFEST), bytes_writer(data))  # last: marks tmp complete
            fsync_dir(p.tmp)
            layout.commit(p.tmp, p.final)
            if p.automatic:
                layout.apply_total_limit(os.path.dirname(p.final), p.total_limit)
        except Exception as exc:  # noqa: BLE001
            error = exc
            remove_tree(p.tmp)  # not committed (or committed already: gone): the previous checkpoint stays newest
    _agree(p.num_processes, error, None, "committing the checkpoint", p.final, gather)
    return p.final


def save_state(state: TrainingState, output_dir: Optional[str], project_config: ProjectConfiguration,
               safe_serialization: bool = True) -> str:
    """Write ``state`` to ``output_dir`` atomically; return the directory. Collective: every
    process calls it (see the module docstring for who writes what).

    Without ``output_dir``, ``project_config.automatic_checkpoint_naming`` picks
    ``project_dir/checkpoints/checkpoint_<n>``, applies ``total_limit`` once the new checkpoint is
    in place and moves ``project_config.iteration`` past it. (The asynchronous variant is
    :class:`anyaccel.checkpoint.async_save.AsyncSaver`.)
    """
    final = finish_save(begin_save(state, output_dir, project_config, safe_serialization))
    if output_dir is None:
        project_config.iteration = layout.checkpoint_index(final) + 1
    return final


def _anyaccel_version() -> str:
    from .. import __version__

    return __version__


# ---- load_state ----------------------------------------------------------------------------------
def _check_counts(directory: str, manifest: dict, state: TrainingState) -> None:
    wrong = [f"{kind}: checkpoint has {manifest.get(kind, 0)}, this Accelerator has {n}"
             for kind, n in state.counts().items() if int(manifest.get(kind, 0)) != n]
    if wrong:
        raise CheckpointError(
            f"checkpoint {directory} does not match what was prepared ({'; '.join(wrong)}). Prepare (and "
            "register_for_checkpointing) the same objects in the same order as in the run that saved it, "
            "then call load_state"
        )


def _read_small_states(state: TrainingState, directory: str, loader_positions: bool) -> None:
    """Schedulers, the gradient scaler, loaders (epoch and shuffle; their positions in the epoch
    only with ``loader_positions``) and custom objects from ``directory``. Local."""
    for i, scheduler in enumerate(state.schedulers):
        path = os.path.join(directory, file_name("scheduler", i, ".bin"))
        try:
            scheduler.load_state_dict(torch_load(path))
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{path} does not fit scheduler {i}: {exc}") from exc
    scaler_path = os.path.join(directory, "scaler.pt")
    if state.scaler is not None:
        if os.path.exists(scaler_path):
            state.scaler.load_state_dict(torch_load(scaler_path))
        else:
            warnings.warn(f"{directory} has no gradient scaler state (saved without fp16); the scaler starts afresh",
                          stacklevel=4)
    for i, loader in enumerate(state.dataloaders):
        with open(os.path.join(directory, file_name("dataloader", i, ".json")), "r", encoding="utf-8") as fh:
            loader_state = json.load(fh)
        if loader_state and hasattr(loader, "load_state_dict"):
            loader.load_state_dict(loader_state, resume_position=loader_positions)
    for i, obj in enumerate(state.custom_objects):
        obj.load_state_dict(torch_load(os.path.join(directory, f"custom_checkpoint_{i}.pkl")))


def load_state(state: TrainingState, input_dir: Optional[str], project_config: ProjectConfiguration,
               strict: bool = True, loader_positions: bool = False) -> Tuple[str, dict]:
    """Restore what :func:`save_state` wrote into every object of ``state``, and this process's
    RNG states; return ``(directory, manifest)``. Loaders get their epoch and shuffle back; a
    loader saved mid-epoch continues after the batches it had yielded only with
    ``loader_positions`` (``Accelerator.resume``, ``use_stateful_dataloader=True``), otherwise it
    runs that epoch from its start, for the script to skip what it has done (Accelerate's rule). Without ``input_dir``, loads the newest complete
    automatic checkpoint. Every process calls it; it only reads. Collective in a multi-process job:
    the main process chooses and checks the checkpoint, the others load that one (see
    :func:`~anyaccel.checkpoint.agreement.agreed_checkpoint`). Raises ``FileNotFoundError``/:class:`CheckpointError` naming the path and what is
    missing or does not match. Moves ``project_config.iteration`` past a loaded
    ``checkpoint_<n>``."""
    if input_dir is None and not project_config.automatic_checkpoint_naming:
        raise ValueError("load_state() needs input_dir, or ProjectConfiguration(automatic_checkpoint_naming=True, "
                         "project_dir=...) to find the newest checkpoint")
    agreeing = state if not state.alone else dataclasses.replace(state, num_processes=1)  # alone: with nobody
    input_dir, directory, manifest, index = agreed_checkpoint(agreeing, input_dir, project_config)

    pairs = [(state.strategy.unwrap(m), m) for m in state.models]
    models = [user for user, _ in pairs]  # the user's modules (diffusers' hooks call their from_pretrained methods)
    for hook in state.load_hooks:
        hook(models, directory)  # a hook may take models over (removing them from the list)
    state = dataclasses.replace(state, models=[prepared for user, prepared in pairs if any(user is m for m in models)])
    _check_counts(directory, manifest, state)
    world = int(manifest.get("world_size", 1))
    # written before tensor parallelism: every process was a data-parallel rank
    saved_dp = int(manifest.get("data_parallel_size", world))
    data_parallel = state.strategy.data_parallel()
    rng_rank = rng_source_rank(state.process_index, state.num_processes, data_parallel, world, saved_dp)
    if (world, saved_dp) != (state.num_processes, data_parallel[1]) and state.is_main_process:
        warnings.warn(f"checkpoint {directory} was saved by {world} processes ({saved_dp} data-parallel) and is "
                      f"loaded by {state.num_processes} ({data_parallel[1]} data-parallel): models and optimizers "
                      "are resharded and loader positions converted; each data-parallel rank d takes the RNG state "
                      f"of saved data-parallel rank d mod {saved_dp} (the same for every process of a "
                      "tensor-parallel group)", stacklevel=3)

    kind = manifest.get("checkpoint_format", "full")
    if kind == "sharded" or (kind != "full" and kind == state.strategy.checkpoint_format):
        state.strategy.load_sharded(directory, manifest, state.models, state.optimizers, strict=strict)
    else:  # "full", or another strategy's own format (DeepSpeed's), converted to full states
        read_full_models(state, directory, strict, kind)
    _read_small_states(state, directory, loader_positions)
    restore_rng_file(directory, rng_rank, state.process_index, state.num_processes,
                     saved_alone=manifest.get("saved_by") == SAVED_ALONE)
    if index is None and project_config.automatic_checkpoint_naming:
        index = layout.checkpoint_index(input_dir)
    if index is not None:
        project_config.iteration = index + 1
    return directory, manifest
