"""Put an installed distribution and everything it requires into a fresh virtual environment by
hard-linking the files another environment already has (what `uv` does from its cache), instead of
downloading and unpacking the wheels again. `make test-wheel` uses it for torch 2.9 (3 GB of CUDA
wheels) from the XLA environment that `make test-xla` made just before; the package under test
(anyaccel's wheel) and the test runner are still installed by pip, and `pip check` still runs.

    SOURCE_VENV/bin/python scripts/link_installed.py TARGET_VENV torch==2.9.0

Run with the SOURCE environment's Python (it reads that environment's metadata). Copied, as pip
would have installed them: every file each distribution's RECORD lists (its dist-info included, so
pip and `pip check` see it installed), checked against the size RECORD gives; a console script
(bin/) is copied with its first line naming TARGET's Python. Hard links where the two directories
share a filesystem, else copies. The closure is what the distribution requires on this platform,
without extras. Exit 0: linked; exit 3 (a line on stderr says why): not usable here (another
version, another Python, a missing or changed file), and TARGET is left without any of it.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Dict, List

from packaging.markers import default_environment
from packaging.requirements import Requirement

UNUSABLE = 3


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(name: str) -> Dict[str, md.Distribution]:
    """``name`` and every distribution it requires (markers of this interpreter, no extras)."""
    installed = {_key(d.metadata["Name"]): d for d in md.distributions()}
    env = dict(default_environment(), extra="")
    todo, found = [name], {}
    while todo:
        key = _key(todo.pop())
        if key in found:
            continue
        if key not in installed:
            raise LookupError(f"{key} is required but not installed in {sys.prefix}")
        found[key] = installed[key]
        for line in installed[key].requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return found


def plan(dists: Dict[str, md.Distribution], target: Path) -> List[tuple]:
    """(source, destination, is_script) of every file; raises when a file is missing or changed."""
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    target_site = target / site.relative_to(Path(sys.prefix).resolve())
    out, seen = [], set()
    for dist in dists.values():
        for f in dist.files or []:
            src = Path(os.path.normpath(site / f))
            if f.suffix == ".pyc" and not src.exists():
                continue  # a byte-compiled file pip wrote and something removed: Python writes it again
            if not src.is_file():
                raise FileNotFoundError(f"{dist.metadata['Name']}: {src} is listed in its RECORD but missing")
            if f.size is not None and src.stat().st_size != f.size:
                raise ValueError(f"{dist.metadata['Name']}: {src} has {src.stat().st_size} bytes, RECORD says {f.size}")
            rel = os.path.relpath(src, site)
            script = rel.startswith("..")
            dst = Path(os.path.normpath(target_site / rel))
            if dst not in seen:  # a namespace package's __init__.py is in several RECORDs (nvidia/)
                seen.add(dst)
                out.append((src, dst, script))
    return out


def link(files: List[tuple], target: Path) -> int:
    python = f"#!{target / 'bin' / 'python'}\n"
    for src, dst, script in files:
        dst.parent.mkdir(parents=True, exist_ok=True)
        if script:
            data = src.read_bytes()
            if data.startswith(b"#!") and b"python" in data.split(b"\n", 1)[0]:
                data = python.encode() + (data.split(b"\n", 1)[1] if b"\n" in data else b"")
            dst.write_bytes(data)
            shutil.copymode(src, dst)
            continue
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
    return len(files)


def main(argv: List[str]) -> int:
    if len(argv) != 2 or "==" not in argv[1]:
        print("usage: SOURCE_VENV/bin/python link_installed.py TARGET_VENV NAME==VERSION", file=sys.stderr)
        return 2
    target, (name, version) = Path(argv[0]).resolve(), argv[1].split("==", 1)
    target_python = target / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    if not target_python.exists():
        print(f"link_installed: {target} has no {target_python.name} (this is Python "
              f"{sys.version_info[0]}.{sys.version_info[1]}): not usable", file=sys.stderr)
        return UNUSABLE
    try:
        have = md.version(name)
        if have.split("+")[0] != version:
            raise LookupError(f"{sys.prefix} has {name} {have}, not {version}")
        dists = closure(name)
        files = plan(dists, target)
    except (LookupError, OSError, ValueError) as exc:
        print(f"link_installed: not usable: {exc}", file=sys.stderr)
        return UNUSABLE
    count = link(files, target)
    names = ", ".join(sorted(f"{d.metadata['Name']} {d.version}" for d in dists.values()))
    print(f"link_installed: {count} files of {len(dists)} distributions from {sys.prefix}: {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
