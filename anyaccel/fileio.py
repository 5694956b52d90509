"""Writing files so that a crash never leaves a truncated one: the one atomic-write helper.

:func:`atomic_write` creates a temporary file next to the target (a unique name, so two writers
never share it), lets the caller fill it, fsyncs it, renames it over the target and fsyncs the
directory: at every instant the target is either the old file or the complete new one. Used by
checkpoints, ``save``/``save_model``, the configuration file and the trackers.

Everything here is local to the calling process. Standard library only.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable, Optional, Union

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_text", "write_synced", "fsync_dir", "remove_tree",
           "link_or_copy"]

PathLike = Union[str, "os.PathLike[str]"]


def fsync_dir(path: PathLike) -> None:
    """Make renames inside directory ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def write_synced(path: PathLike, write: Callable[[str], None]) -> int:
    """Create ``path`` with ``write(path)`` and fsync it; return its size in bytes. Not atomic by
    itself: for files inside a directory that becomes visible only once complete (a checkpoint's
    temporary directory, whose manifest is written last)."""
    path = os.fspath(path)
    write(path)
    _fsync_file(path)
    return os.path.getsize(path)


def atomic_write(path: PathLike, write: Callable[[str], None], mode: Optional[int] = None) -> None:
    """Call ``write(tmp)`` for a fresh temporary file next to ``path``, fsync it, rename it over
    ``path`` and fsync the directory. Parent directories are created. ``mode`` sets the file's
    permissions (default: keep an existing file's, else the process default). A failure in
    ``write`` removes the temporary file and leaves ``path`` as it was."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    if mode is None:
        try:
            mode = os.stat(path).st_mode & 0o777
        except FileNotFoundError:
            mode = None
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        _fsync_file(tmp)
        if mode is not None:
            os.chmod(tmp, mode)
        else:  # mkstemp makes 0600 files; give new files the usual permissions
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
        fsync_dir(directory)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: PathLike, data: bytes, mode: Optional[int] = None) -> None:
    """:func:`atomic_write` of ``data``."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as fh:
            fh.write(data)

    atomic_write(path, write, mode)


def atomic_write_text(path: PathLike, text: str, mode: Optional[int] = None) -> None:
    """:func:`atomic_write` of ``text`` (UTF-8)."""
    atomic_write_bytes(path, text.encode("utf-8"), mode)


def remove_tree(path: PathLike) -> None:
    """Remove a directory tree, a file or a link at ``path`` if anything is there."""
    path = os.fspath(path)
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def link_or_copy(src: str, dst: str) -> None:
    """Hard-link ``src`` to ``dst``; copy when the filesystem cannot link."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
