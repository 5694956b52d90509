"""Where checkpoints live and how they are named; how a directory is replaced atomically.

Layout of a ``save_state`` directory (names follow Hugging Face Accelerate where it has one)::

    model.safetensors, model_1.safetensors, ...   unwrapped model state dicts (safetensors;
                                                  ``pytorch_model*.bin`` with safe_serialization=False;
                                                  non-tensor entries in ``model*_extra.bin``)
    optimizer.bin, optimizer_1.bin, ...           optimizer state dicts
    scheduler.bin, ...                            LR scheduler state dicts
    scaler.pt                                     fp16 gradient scaler
    dataloader.json, dataloader_1.json, ...       loader position: epoch, batches seen, seed
    custom_checkpoint_0.pkl, ...                  objects given to register_for_checkpointing
    random_states_<rank>.pkl                      RNG states, one per process
    anyaccel_checkpoint.json                      manifest: counts, world size, versions, file sizes

(A sharded strategy stores models and optimizers in its own files instead, under ``sharded/``
(torch.distributed.checkpoint) or ``deepspeed/`` (DeepSpeed's checkpoint); the manifest lists them.)

Atomicity. Every process writes into a hidden sibling ``.<name>.anyaccel-tmp``; once all have
finished, the main process writes the manifest *last*, moves the previous checkpoint (if any) to
``.<name>.anyaccel-old``, renames the new one into place and deletes the old one. A process killed
at any point leaves a directory that :func:`resolve_checkpoint` accepts: the target when it has a
manifest, otherwise the complete sibling (the previous checkpoint, or the finished new one). A
directory without a manifest never passes for a checkpoint.

Everything here is local to the calling process (the protocol in
:mod:`anyaccel.checkpoint.training_state` decides who calls what).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from typing import List, Optional, Tuple

from .. import lazyclass
from ..errors import CheckpointError
from ..fileio import fsync_dir, link_or_copy, remove_tree

__all__ = ["MANIFEST", "SAVED_ALONE", "FORMAT", "FORMAT_VERSION", "ProjectConfiguration", "file_name", "sibling", "TMP_SUFFIX",
           "read_manifest", "resolve_checkpoint", "checkpoint_root", "checkpoint_indices", "latest_checkpoint",
           "checkpoint_index", "prepare_tmp", "carry_over", "commit", "apply_total_limit"]

MANIFEST = "anyaccel_checkpoint.json"
FORMAT = "anyaccel-checkpoint"
FORMAT_VERSION = 1
TMP_SUFFIX = ".anyaccel-tmp"
#: the manifest's ``saved_by`` for a checkpoint the main process wrote alone (its RNG states only)
SAVED_ALONE = "the main process alone"
OLD_SUFFIX = ".anyaccel-old"
# (patterns, not compiled objects: ``re`` compiles and caches them at first use, not at import)
_CHECKPOINT_RE = r"^\.?checkpoint_(\d+)(?:\.anyaccel-(?:tmp|old))?$"
# Files save_state writes itself; anything else in a replaced checkpoint is carried over.
_OWN_FILE_RE = (
    r"^(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin|model(_\d+)?_extra\.bin|optimizer(_\d+)?\.bin|"
    r"scheduler(_\d+)?\.bin|scaler\.pt|dataloader(_\d+)?\.json|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl|"
    r"sharded(/.*)?|deepspeed(/.*)?|" + re.escape(MANIFEST) + r")$"
)


def file_name(kind: str, index: int, extension: str = "") -> str:
    """``model``, ``model_1``, ``optimizer_2.bin``, ...: the first of each kind has no number."""
    return f"{kind}{'' if index == 0 else f'_{index}'}{extension}"


@lazyclass.dataclass
class ProjectConfiguration:
    """Where a project writes (``project_dir``), and automatic checkpoint naming:
    with ``automatic_checkpoint_naming=True``, :meth:`Accelerator.save_state` called without a
    directory writes ``project_dir/checkpoints/checkpoint_<n>`` (``n`` = ``iteration``, or one past
    the highest existing checkpoint) and then keeps the newest ``total_limit`` of them;
    :meth:`Accelerator.load_state` without a directory loads the newest complete one.
    ``async_save=True`` makes ``save_state`` asynchronous by default (:mod:`anyaccel.checkpoint.async_save`)."""

    project_dir: Optional[str] = None
    logging_dir: Optional[str] = None
    automatic_checkpoint_naming: bool = False
    total_limit: Optional[int] = None
    iteration: int = 0
    async_save: bool = False

    def set_directories(self, project_dir: Optional[str] = None) -> None:
        """Set ``project_dir`` (and ``logging_dir`` when unset) — Accelerate's method name."""
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir


def sibling(final: str, suffix: str) -> str:
    parent, base = os.path.split(final)
    return os.path.join(parent, f".{base}{suffix}")


def read_manifest(directory: str) -> Optional[dict]:
    """The manifest of ``directory``, or None when it has none (or not ours)."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, "r", encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def _problems(directory: str, manifest: dict) -> List[str]:
    """What is missing or truncated in ``directory`` compared with its manifest."""
    problems = []
    for name, size in sorted(manifest.get("files", {}).items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            problems.append(f"{name} is missing")
        elif os.path.getsize(path) != size:
            problems.append(f"{name} has {os.path.getsize(path)} bytes, the manifest says {size}")
    return problems


def resolve_checkpoint(path: str) -> Tuple[str, dict]:
    """Return ``(directory, manifest)`` of the complete checkpoint saved at ``path``.

    If a save to ``path`` was killed, the complete sibling it left is used instead (with a
    warning). Raises ``FileNotFoundError`` when nothing is there, and :class:`CheckpointError`
    naming the path and what is missing when the checkpoint is incomplete or damaged. Local,
    read-only."""
    final = os.path.abspath(os.fspath(path))
    manifest = read_manifest(final)
    if manifest is not None:
        problems = _problems(final, manifest)
        if problems:
            raise CheckpointError(f"checkpoint {final} is damaged: " + "; ".join(problems))
        return final, manifest
    for candidate, what in ((sibling(final, OLD_SUFFIX), "the previous checkpoint"),
                            (sibling(final, TMP_SUFFIX), "the new checkpoint, complete but not yet renamed")):
        manifest = read_manifest(candidate)
        if manifest is not None and not _problems(candidate, manifest):
            warnings.warn(f"{final} is not a complete checkpoint (a save_state was interrupted); loading {what} "
                          f"from {candidate}", stacklevel=3)
            return candidate, manifest
    if not os.path.exists(final):
        raise FileNotFoundError(f"no checkpoint at {final}: the directory does not exist")
    if not os.path.isdir(final):
        raise CheckpointError(f"{final} is a file, not a checkpoint directory")
    content = sorted(os.listdir(final))
    listing = ", ".join(content[:10]) + (" ..." if len(content) > 10 else "") if content else "nothing"
    raise CheckpointError(
        f"{final} is not a complete anyaccel checkpoint: {MANIFEST} is missing (save_state writes it last, so "
        f"the save that made this directory did not finish, or it was not made by save_state). It contains: {listing}"
    )


# ---- automatic naming ---------------------------------------------------------------------------


def checkpoint_root(config: ProjectConfiguration) -> str:
    if not config.project_dir:
        raise ValueError("automatic_checkpoint_naming needs a project directory: "
                         "ProjectConfiguration(project_dir=...) or Accelerator(project_dir=...)")
    return os.path.join(os.path.abspath(config.project_dir), "checkpoints")


def checkpoint_indices(root: str) -> List[int]:
    """Indices n of ``checkpoint_<n>`` under ``root`` (siblings of interrupted saves included)."""
    if not os.path.isdir(root):
        return []
    found = set()
    for entry in os.listdir(root):
        match = re.match(_CHECKPOINT_RE, entry)
        if match:
            found.add(int(match.group(1)))
    return sorted(found)


def checkpoint_index(path: str) -> Optional[int]:
    """``n`` when ``path`` is named ``checkpoint_<n>`` (or a sibling of one), else None."""
    match = re.match(_CHECKPOINT_RE, os.path.basename(os.path.abspath(os.fspath(path))))
    return int(match.group(1)) if match else None


def latest_checkpoint(config: ProjectConfiguration) -> Tuple[str, int]:
    """The newest complete ``checkpoint_<n>`` of the project and its index; incomplete ones are
    skipped with a warning. Raises ``FileNotFoundError`` when there is none."""
    root = checkpoint_root(config)
    skipped = []
    for index in reversed(checkpoint_indices(root)):
        path = os.path.join(root, f"checkpoint_{index}")
        try:
            resolve_checkpoint(path)
        except (CheckpointError, FileNotFoundError) as exc:
            skipped.append(str(exc))
            continue
        if skipped:
            warnings.warn("skipping incomplete checkpoints: " + " | ".join(skipped), stacklevel=4)
        return path, index
    raise FileNotFoundError(f"no complete checkpoint under {root}" + (": " + " | ".join(skipped) if skipped else ""))


def apply_total_limit(root: str, limit: Optional[int]) -> None:
    """Main process: delete the oldest ``checkpoint_<n>`` (and leftovers of interrupted saves of
    them) until ``limit`` remain; the newest is always kept."""
    if limit is None:
        return
    keep = max(1, int(limit))
    indices = [i for i in checkpoint_indices(root) if os.path.isdir(os.path.join(root, f"checkpoint_{i}"))]
    for i in indices[: max(0, len(indices) - keep)]:
        final = os.path.join(root, f"checkpoint_{i}")
        for path in (final, sibling(final, OLD_SUFFIX), sibling(final, TMP_SUFFIX)):
            remove_tree(path)


# ---- replacing a checkpoint ----------------------------------------------------------------------


def prepare_tmp(final: str, tmp: str) -> None:
    """Main process: check the target, start an empty temporary directory next to it."""
    if os.path.exists(final) and not os.path.isdir(final):
        raise CheckpointError(f"{final} exists and is a file; save_state needs a directory path")
    if os.path.isdir(final) and os.listdir(final) and read_manifest(final) is None \
            and read_manifest(sibling(final, OLD_SUFFIX)) is None:
        raise CheckpointError(
            f"{final} exists, is not empty and is not an anyaccel checkpoint (no {MANIFEST}); save_state replaces "
            "the checkpoint directory as a whole, so give it a new or empty directory"
        )
    cwd = os.path.abspath(os.getcwd())
    if cwd == final or cwd.startswith(final + os.sep):
        raise CheckpointError(f"save_state({final}) would replace the current working directory; choose another path")
    os.makedirs(os.path.dirname(final), exist_ok=True)
    remove_tree(tmp)  # left over from an interrupted save
    os.makedirs(tmp)


def carry_over(final: str, tmp: str) -> None:
    """Main process: hard-link (or copy) entries of the checkpoint being replaced that
    save_state does not write itself (e.g. a tokenizer saved next to it) into the new one."""
    source = final if read_manifest(final) is not None else sibling(final, OLD_SUFFIX)
    if not os.path.isdir(source) or read_manifest(source) is None:
        return
    for entry in os.listdir(source):
        if re.match(_OWN_FILE_RE, entry) or os.path.lexists(os.path.join(tmp, entry)):
            continue
        src, dst = os.path.join(source, entry), os.path.join(tmp, entry)
        if os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, dst, copy_function=link_or_copy, symlinks=True)
        else:
            link_or_copy(src, dst)


def commit(tmp: str, final: str) -> None:
    """Main process: put the complete ``tmp`` in place of ``final``. At every instant either
    ``final`` or one of its siblings is a complete checkpoint."""
    old = sibling(final, OLD_SUFFIX)
    if os.path.lexists(old):
        if read_manifest(final) is not None:
            remove_tree(old)  # an earlier save finished renaming but not cleaning up
        elif os.path.lexists(final):
            remove_tree(final)  # broken: the complete previous checkpoint is `old`
    if os.path.lexists(final):
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(final))
    remove_tree(old)
