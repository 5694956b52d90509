"""Checkpoints in a directory per process, as Accelerate allows (each process its own temporary
directory, say): where every process holds the whole training state (one process, DDP), each
directory named gets a whole checkpoint, and ``load_state`` with a directory per process has each
process read its own.

* Saving: :func:`save_directories` agrees on who writes which directory. Paths are compared as
  the filesystem resolves them (:func:`os.path.realpath`), so two spellings of one directory (a
  symlink) have one writer; each writer then stamps its temporary directory
  (:func:`stamp_writer`) and, after every writer has, checks that no other process's stamp is
  there (:func:`check_sole_writer`) — which catches two paths naming one directory where no
  process can see it (another machine's mount of the same share). Every directory one
  ``save_state`` call writes carries the same ``save_id`` in its manifest.
* Loading: :func:`own_checkpoints` has each process resolve its own directory, then compares what
  decides where training continues — the ``save_state`` call that wrote it (``save_id``), the
  step, the loader positions, the sizes of the model, optimizer, scheduler and scaler files —
  and raises on every process, listing each one's directory, when they differ: DDP
  replicas that loaded different checkpoints would diverge and then wait for ever in a collective.

Every function here that says so is collective; ``state`` is the caller's
:class:`~anyaccel.checkpoint.training_state.TrainingState`.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Optional, Tuple, cast

from .. import ops
from ..errors import CheckpointError
from . import layout

__all__ = ["holds_whole_state", "save_directories", "stamp_writer", "check_sole_writer", "remove_stamp",
           "own_checkpoints"]

_STAMP = ".anyaccel-writer-{}"
_STAMP_RE = re.compile(r"^\.anyaccel-writer-(\d+)$")
_LOADER = re.compile(r"^dataloader(_\d+)?\.json$")  # loader positions: compared by content
# files compared by size (registered objects and RNG states may differ between processes)
_COMPARED = re.compile(r"^(model|pytorch_model|optimizer|scheduler|scaler)")


def holds_whole_state(strategy: Any) -> bool:
    """Whether every process holds the whole training state (one process, DDP), so that each can
    write, or read, a whole checkpoint in a directory of its own. Local."""
    return bool(strategy.checkpoint_format == "full" and not strategy.collective_state_dict)


def save_directories(state: Any, final: str, save_id: str) -> Tuple[List[str], str]:
    """Every process's directory, resolved (:func:`os.path.realpath`), and rank 0's ``save_id``.
    Collective (one all-gather). Processes may name different directories only where every one
    holds the whole state (:func:`holds_whole_state`); otherwise a :class:`CheckpointError` on
    every process names each one's directory."""
    gathered = ops.gather_object([(os.path.realpath(final), final, save_id)])
    paths = [str(real) for real, _, _ in gathered]
    if len(set(paths)) > 1 and not holds_whole_state(state.strategy):
        listing = "; ".join(f"process {rank}: {given}" for rank, (_, given, _) in enumerate(gathered))
        raise CheckpointError(
            f"save_state() was called with different directories on different processes ({listing}). The "
            f"{state.strategy.name!r} strategy writes one checkpoint with every process (each holds a part of it): "
            "pass the same path on every process (on a filesystem they all see), e.g. one computed on the main "
            "process, or use ProjectConfiguration(automatic_checkpoint_naming=True)."
        )
    return paths, str(gathered[0][2])


def stamp_writer(tmp: str, rank: int) -> None:
    """The writer of a directory marks its temporary directory as its own. Local."""
    os.makedirs(tmp, exist_ok=True)  # another writer of the same directory may have just replaced it
    with open(os.path.join(tmp, _STAMP.format(rank)), "w", encoding="utf-8") as fh:
        fh.write(f"process {rank} writes this checkpoint\n")


def check_sole_writer(tmp: str, rank: int, final: str, directories: List[str]) -> None:
    """After every writer stamped its temporary directory (:func:`stamp_writer`): ``tmp`` must
    hold this process's stamp and no other's, else two processes' paths name one directory.
    Raises :class:`CheckpointError` naming both paths and the fix. Local."""
    try:
        stamps = sorted(int(m.group(1)) for m in map(_STAMP_RE.match, os.listdir(tmp)) if m)
    except OSError:
        stamps = []
    others = [r for r in stamps if r != rank]
    if others or rank not in stamps:
        who = ", ".join(f"process {r} ({directories[r]})" for r in others) or "another process"
        found = (f"the writer stamp of {', '.join(f'process {r}' for r in others)}" if others
                 else f"no stamp of process {rank}, which wrote one there")
        raise CheckpointError(
            f"save_state({final}): process {rank} and {who} write the same directory through different paths (a "
            f"symlink, or another machine's mount of the same filesystem): {tmp} holds {found}. Give every process "
            "the same path, or each a directory of its own that no other path reaches.")


def remove_stamp(tmp: str, rank: int) -> None:
    """Take the writer's stamp out before the manifest is written. Local."""
    try:
        os.remove(os.path.join(tmp, _STAMP.format(rank)))
    except FileNotFoundError:
        pass


def own_checkpoints(state: Any, every: List[Optional[str]]) -> Tuple[str, str, Dict[str, Any], Optional[int]]:
    """Processes named different directories (``every``: each one's, as given): each reads its
    own, where every process holds the whole state (one process, DDP), once every process found
    its checkpoint and all of them hold the same one (see the module docstring). Otherwise, or
    when a process asked for the newest automatic checkpoint, a :class:`CheckpointError` on every
    process lists each one's directory. Collective (one all-gather)."""
    listing = "; ".join(f"process {rank}: {a or '(newest automatic checkpoint)'}" for rank, a in enumerate(every))
    if None in every or not holds_whole_state(state.strategy):
        why = ("each holds a part of the state" if None not in every
               else "some asked for the newest automatic checkpoint")
        raise CheckpointError(f"load_state() was called with different directories on different processes ({listing}); "
                              f"{why}: every process must load the same checkpoint.")
    choice, problem, mine = None, None, None
    path = str(every[state.process_index])
    try:
        directory, manifest = layout.resolve_checkpoint(path)
        choice = (path, directory, manifest, None)
        mine = _fingerprint(directory, manifest)
    except Exception as exc:  # raised on every process, not on this one alone
        problem = f"{type(exc).__name__}: {exc}"
    gathered = ops.gather_object([(problem, mine)])
    failed = [(rank, p) for rank, (p, _) in enumerate(gathered) if p]
    if failed:
        raise CheckpointError("load_state() with a directory per process: "
                              + "; ".join(f"process {rank} ({every[rank]}): {p}" for rank, p in failed))
    prints = [_flatten(f) for _, f in gathered]
    keys = sorted(set().union(*prints), key=lambda k: list(prints[0]).index(k) if k in prints[0] else len(prints[0]))
    differ = [key for key in keys if any(f.get(key) != prints[0].get(key) for f in prints)]
    if differ:
        shown = "; ".join(f"process {rank} ({every[rank]}): " + ", ".join(f"{k} {_short(f.get(k))}" for k in differ)
                          for rank, f in enumerate(prints))
        raise CheckpointError(
            f"load_state() with a directory per process: the directories hold different checkpoints ({shown}). "
            "Every process must resume from the same state (the replicas would diverge): load directories "
            "written by one save_state call, or the same directory on every process.")
    return cast(Tuple[str, str, Dict[str, Any], Optional[int]], choice)  # set: no process failed


def _fingerprint(directory: str, manifest: Dict[str, Any]) -> Dict[str, Any]:
    """What two checkpoints must share to be the same training state. Local; reads the manifest
    and the loader positions (small JSON files)."""
    files = manifest.get("files", {})
    positions = {}
    for name in sorted(files):
        if _LOADER.match(name):
            with open(os.path.join(directory, name), "r", encoding="utf-8") as fh:
                position = json.load(fh)
            # where the loader stands; its generators' states are each process's own (worker seeds)
            positions[name] = {k: v for k, v in position.items() if k != "generators"} \
                if isinstance(position, dict) else position
    return {
        "save_state call": manifest.get("save_id"),
        "step": manifest.get("step"),
        "loader positions": positions,
        "file sizes": {f"{k} (bytes)": v for k, v in sorted(files.items()) if _COMPARED.match(k)},
    }


def _flatten(value: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """``{"loader positions": {"dataloader.json": {"epoch": 1}}}`` as ``{"dataloader.json epoch": 1}``:
    one entry per value, so that only the ones that differ are named."""
    flat: Dict[str, Any] = {}
    for key, item in value.items():
        name = f"{prefix}{key}" if prefix or key not in ("loader positions", "file sizes") else ""
        if isinstance(item, dict) and item:
            flat.update(_flatten(item, f"{name} " if name else ""))
        else:
            flat[name or key] = item
    return flat


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 120 else text[:117] + "..."
