"""Which checkpoint every process loads, decided once.

The main process finds the checkpoint (the newest complete ``checkpoint_<n>``, or the directory
asked for) and checks every file against its manifest; every other process takes that choice and
checks only what it must see itself. A process whose view of ``project_dir`` is stale (NFS's
directory cache) or node-local can then neither start afresh nor load an older checkpoint while
the others resume, and a problem on any process raises on all of them instead of leaving the
others waiting in the next collective. Every function here is collective in a multi-process job.
``state`` is the caller's :class:`~anyaccel.checkpoint.training_state.TrainingState` (its
``is_main_process``, ``process_index``, ``num_processes`` and ``strategy`` are read).
"""

from __future__ import annotations

import os
from typing import Any, Optional, Tuple

from .. import ops
from ..errors import CheckpointError
from . import layout
from .layout import MANIFEST, ProjectConfiguration
from .per_process import holds_whole_state, own_checkpoints

__all__ = ["newest_checkpoint", "agreed_checkpoint", "holds_whole_state"]

_ERRORS = {"FileNotFoundError": FileNotFoundError, "CheckpointError": CheckpointError, "ValueError": ValueError}


def newest_checkpoint(state: Any, project_config: ProjectConfiguration) -> Optional[str]:
    """The newest complete ``checkpoint_<n>`` under ``project_dir/checkpoints``, or None when there
    is none. The main process looks and every process receives its answer (collective in a
    multi-process job): a process whose view of the directory is stale or node-local cannot start
    afresh while the others resume."""
    found, error, probe = None, None, None
    project_dir = project_config.project_dir or "."
    if state.is_main_process:
        try:
            found = layout.latest_checkpoint(project_config)[0]
        except FileNotFoundError:
            found = None
        except Exception as exc:  # raised on every process, not on this one alone
            error = exc
        if error is None and state.num_processes > 1:
            probe = _write_probe(project_dir)
    found, probe = _from_main(state, (found, probe), error)
    if state.num_processes > 1:
        _check_shared(state, project_dir, probe)
    return found


def _write_probe(project_dir: str) -> Optional[str]:
    """A small file in ``project_dir`` that every process must see (None when it cannot be written:
    the first save reports that)."""
    import uuid

    path = os.path.join(os.path.abspath(project_dir), f".anyaccel-shared-{uuid.uuid4().hex[:12]}")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write("written by process 0 to check that every process sees project_dir\n")
    except OSError:
        return None
    return path


def _check_shared(state: Any, project_dir: str, probe: Optional[str]) -> None:
    """Every process must see the file process 0 wrote in ``project_dir``: a directory that is not
    shared would only fail at the first save, which may be the save on preemption. Collective."""
    sees = probe is None or os.path.exists(probe)
    results = ops.gather_object([(sees, _host())])
    if state.is_main_process and probe is not None:
        try:
            os.remove(probe)
        except OSError:
            pass
    blind = [(rank, host) for rank, (ok, host) in enumerate(results) if not ok]
    if blind:
        who = ", ".join(f"process {rank} on {host}" for rank, host in blind)
        raise CheckpointError(
            f"project_dir {os.path.abspath(project_dir)} is not shared: {who} cannot see a file that process 0 "
            f"({results[0][1]}) wrote there. Checkpoints, resume and the save on preemption need a directory every "
            "process sees: put project_dir on a filesystem all machines mount (an absolute path there)."
        )


def _host() -> str:
    import socket

    return socket.gethostname()


def agreed_checkpoint(state: Any, input_dir: Optional[str],
                       project_config: ProjectConfiguration) -> Tuple[str, str, dict, Optional[int]]:
    """``(input_dir, directory, manifest, index)`` of the checkpoint to load. The main process finds
    it (the newest automatic one without ``input_dir``) and checks every file against the manifest;
    every other process takes that choice, and checks only that it can read the manifest there.
    Processes given different ``input_dir`` (different directories, not two paths to one) each
    read their own where each holds the whole state (DDP; see
    :func:`~anyaccel.checkpoint.per_process.own_checkpoints`). Collective in a multi-process job:
    an error on any process raises on all, naming each process's problem."""
    asked = os.path.abspath(os.fspath(input_dir)) if input_dir is not None else None
    if state.num_processes > 1:
        every = ops.gather_object([(asked, os.path.realpath(asked) if asked is not None else None)])
        if len({real for _, real in every}) > 1:
            return own_checkpoints(state, [given for given, _ in every])
    choice, error = None, None
    if state.is_main_process:
        try:
            path, index = (input_dir, None) if input_dir is not None else layout.latest_checkpoint(project_config)
            directory, manifest = layout.resolve_checkpoint(path)
            choice = (path, directory, manifest, index)
        except Exception as exc:  # raised on every process, not on this one alone
            error = exc
    choice = _from_main(state, choice, error)
    if state.num_processes == 1:
        return choice
    path, directory = choice[0], choice[1]
    problem = None
    if not state.is_main_process and layout.read_manifest(directory) is None:
        problem = (f"cannot read {os.path.join(directory, MANIFEST)}, which process 0 loads: every process must see "
                   "the same checkpoint directory (put project_dir / the checkpoint on a filesystem shared by all "
                   "machines)")
    results = ops.gather_object([problem])
    failed = [(rank, p) for rank, p in enumerate(results) if p]
    if failed:
        raise CheckpointError(f"load_state({path}): " + "; ".join(f"process {rank} {p}" for rank, p in failed))
    return choice


def _from_main(state: Any, value: Any, error: Optional[BaseException]) -> Any:
    """The main process's ``value``, on every process; its ``error`` raised on every process, as
    the same type everywhere (``FileNotFoundError``, ``ValueError``, else ``CheckpointError``), so
    that code catching it takes the same path on every rank."""
    if error is not None and type(error).__name__ not in _ERRORS:
        wrapped = CheckpointError(f"{type(error).__name__}: {error}")
        wrapped.__cause__ = error
        error = wrapped
    if state.num_processes == 1:
        if error is not None:
            raise error
        return value
    box = [(value, None if error is None else (type(error).__name__, str(error)))]
    ops.broadcast_object_list(box, from_process=0)
    value, failure = box[0]
    if failure is not None:
        if error is not None:
            raise error
        kind, message = failure
        raise _ERRORS[kind](f"{message} (found by process 0)")
    return value
