"""What `make test-wheel` checks in the built files and in the installed package (scripts/test_wheel.sh).

    python scripts/check_dist.py contents WHEEL SDIST     # with the build environment's python
    python scripts/check_dist.py installed VENV           # with the fresh environment's python, outside the checkout

``contents``: the wheel holds every ``anyaccel/**/*.py`` of the checkout (a package directory
without ``__init__.py`` would be left out by ``packages.find``), ``anyaccel/py.typed`` (PEP 561),
the license and the ``anyaccel`` console script, and nothing else (no tests); the sdist holds every
tracked file of ``anyaccel/``, ``tests/``, ``examples/`` and ``docs/`` (``MANIFEST.in``'s grafts,
minus its prunes) and the top-level files a packager needs. Files are listed by ``git ls-files``
(skipped with a note outside a git checkout). ``python -m build`` makes the wheel *from the sdist*,
so a wheel that installs also proves that the sdist builds.

``installed``: ``import anyaccel`` resolves into ``VENV``'s site-packages, every module of the
installed package imports (a module may only fail for a missing *optional* third-party package:
DeepSpeed, transformers, torch-xla), ``py.typed`` is there, and the console script answers
``--help``. Exits 1 naming what is wrong.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import List, Set

ROOT = Path(__file__).resolve().parents[1]
#: top-level files the sdist must hold (MANIFEST.in's includes, and what setuptools adds)
SDIST_TOP = ("LICENSE", "README.md", "CHANGELOG.md", "constraints.txt", "Makefile", "pyproject.toml", "MANIFEST.in")
GRAFTS = ("anyaccel/", "tests/", "examples/", "docs/")
PRUNED = ("docs/_build/", "docs/reference/generated/")


def _tracked() -> List[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [line for line in out.splitlines() if line and (ROOT / line).exists()]


def check_contents(wheel: str, sdist: str) -> List[str]:
    problems: List[str] = []
    names = set(zipfile.ZipFile(wheel).namelist())
    tracked = _tracked()
    if not tracked:
        print("check_dist: not a git checkout; the file lists are not compared")
    package = {f for f in tracked if f.startswith("anyaccel/") and (f.endswith(".py") or f == "anyaccel/py.typed")}
    problems += [f"the wheel lacks {f}" for f in sorted(package - names)]
    if "anyaccel/py.typed" not in names:
        problems.append("the wheel lacks anyaccel/py.typed")
    if not any(n.endswith("licenses/LICENSE") for n in names):
        problems.append("the wheel lacks *.dist-info/licenses/LICENSE")
    strays = sorted(n for n in names if not n.startswith("anyaccel/") and ".dist-info/" not in n)
    problems += [f"the wheel holds {n}, outside the package" for n in strays[:10]]
    entry = next((n for n in names if n.endswith(".dist-info/entry_points.txt")), None)
    scripts = zipfile.ZipFile(wheel).read(entry).decode() if entry else ""
    if "anyaccel = anyaccel.cli:main" not in scripts:
        problems.append(f"the wheel's console script is not `anyaccel = anyaccel.cli:main` (entry_points.txt: {scripts!r})")
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    wanted: Set[str] = {f for f in tracked if f.startswith(GRAFTS) and not f.startswith(PRUNED)
                        and not f.endswith((".pyc", ".pyo", ".pyd"))}
    wanted |= set(SDIST_TOP) if tracked else set()
    missing = sorted(wanted - members)
    problems += [f"the sdist lacks {f}" for f in missing[:20]]
    if len(missing) > 20:
        problems.append(f"... and {len(missing) - 20} more files the sdist lacks")
    print(f"check_dist: the wheel holds {len(names)} files, the sdist {len(members)}; "
          f"{len(package)} package and {len(wanted)} source files compared")
    return problems


def check_installed(venv: str) -> List[str]:
    problems: List[str] = []
    import anyaccel

    where = os.path.realpath(anyaccel.__file__)
    if "site-packages" not in where or not where.startswith(os.path.realpath(venv)):
        return [f"anyaccel is imported from {where}, not from the installed wheel in {venv}"]
    if not os.path.exists(os.path.join(os.path.dirname(where), "py.typed")):
        problems.append("the installed package lacks py.typed")
    optional, count = [], 0
    for info in pkgutil.walk_packages(anyaccel.__path__, "anyaccel."):
        if info.name.rsplit(".", 1)[-1] == "__main__":  # importing it runs the command (with this script's argv)
            continue
        count += 1
        try:
            importlib.import_module(info.name)
        except ImportError as exc:
            if exc.name and not exc.name.startswith("anyaccel") and exc.name.split(".")[0] != "torch":
                optional.append(f"{info.name} ({exc.name})")
            else:
                problems.append(f"{info.name} does not import: {exc!r}")
        except Exception as exc:  # noqa: BLE001 - any error at import is a defect
            problems.append(f"{info.name} does not import: {exc!r}")
    script = Path(venv) / "bin" / "anyaccel"
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or "launch" not in done.stdout:
        problems.append(f"`{script} --help` failed ({done.returncode}): {(done.stdout + done.stderr)[-500:]}")
    import torch

    print(f"check_dist: anyaccel from {where}; torch {torch.__version__}; {count} modules imported"
          f"{'; without their optional package: ' + ', '.join(optional) if optional else ''}")
    return problems


if __name__ == "__main__":
    kind, args = sys.argv[1], sys.argv[2:]
    found = check_contents(*args) if kind == "contents" else check_installed(*args)
    for problem in found:
        print(f"check_dist: {problem}", file=sys.stderr)
    sys.exit(1 if found else 0)
