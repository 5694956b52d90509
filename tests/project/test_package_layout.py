"""The package's layout holds together (issue 38 item 4), checked without running any of it:

* every import of an anyaccel module inside ``anyaccel/`` (relative or absolute) names a module
  that exists, and every name it imports is a submodule or is defined in that module — so a
  ``from .. import ops`` left pointing at the wrong package by a move fails here, in a second,
  instead of in the one multi-process test that reaches the import (it happened: the FSDP
  strategy's rank-0 optimizer load, after ``strategies/fsdp/`` became a package);
* the top level shows the layers: besides Accelerate's module paths and ``accelerator.py``, at most
  ~20 modules and packages;
* every module path of before the packages (``anyaccel.MOVED_MODULES``) is its new module, and
  ``python -m`` of an old path still runs it.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, Optional, Set, Tuple

import anyaccel

PACKAGE = Path(anyaccel.__file__).resolve().parent  # the checkout, or the installed wheel (make test-wheel)
ROOT = PACKAGE.parent

#: Accelerate's module paths (re-exports that must stay where Accelerate has them; ``as_accelerate``
#: is the module ``accelerate`` itself), and the façade
ACCELERATE_PATHS = {"as_accelerate", "accelerator", "state", "kwargs", "plugins", "utils", "data_loader", "optimizer", "scheduler",
                    "hooks", "launchers", "logging", "local_sgd", "parallelism_config", "big_modeling", "test_utils",
                    "tracking"}
TOP_LEVEL_LIMIT = 20


def module_file(name: str) -> Optional[Path]:
    """The file of module ``name`` (``anyaccel.x.y``) in the tree, or None."""
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def module_name(path: Path) -> Tuple[str, bool]:
    """``(dotted name, is a package)`` of a file under the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def defined_names(path: Path) -> Tuple[Set[str], bool]:
    """The names bound at the top level of a module (also inside top-level ``if``/``try`` blocks),
    and whether it makes names at run time — a module ``__getattr__`` (lazy exports) or
    ``globals()[name] = ...`` — in which case its string constants count as names too; or
    ``from X import *``, in which case any name counts (the second item: True)."""
    tree = ast.parse(path.read_text())
    names: Set[str] = set()
    lazy = star = False

    def visit(body: list) -> None:
        nonlocal lazy, star
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                lazy = lazy or node.name == "__getattr__"
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
                lazy = lazy or "__getattr__" in names  # __getattr__, __dir__ = lazyclass.module_attributes(...)
            elif isinstance(node, ast.ImportFrom) and node.names[0].name == "*":
                star = True
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "finalbody", []))

    visit(tree.body)
    lazy = lazy or any(isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Call)
                       and getattr(n.value.func, "id", "") == "globals" for n in ast.walk(tree))
    if lazy:
        names.update(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return names, star


def anyaccel_imports() -> Iterator[Tuple[Path, int, str, Tuple[str, ...]]]:
    """``(file, line, imported module, names)`` for every ``from X import ...`` of an anyaccel
    module in ``anyaccel/``, relative ones resolved against the file's package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        name, is_package = module_name(path)
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    if node.level - 1 >= len(base):
                        yield path, node.lineno, "." * node.level + (node.module or ""), ()
                        continue
                    target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
                elif (node.module or "").split(".")[0] == "anyaccel":
                    target = node.module or ""
                else:
                    continue
                yield path, node.lineno, target, tuple(a.name for a in node.names)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "anyaccel":
                        yield path, node.lineno, alias.name, ()


def test_every_import_of_an_anyaccel_module_resolves():
    cache: Dict[Path, Tuple[Set[str], bool]] = {}
    wrong = []
    for path, line, target, names in anyaccel_imports():
        where = f"{path.relative_to(ROOT)}:{line}"
        file = module_file(target) if target.startswith("anyaccel") else None
        if file is None:
            wrong.append(f"{where}: module {target!r} does not exist (a package moved? import it from its new home)")
            continue
        for imported in names:
            if imported == "*" or module_file(f"{target}.{imported}") is not None:
                continue
            if file not in cache:
                cache[file] = defined_names(file)
            defined, star = cache[file]
            if imported not in defined and not star:
                wrong.append(f"{where}: {target!r} has no name or submodule {imported!r}")
    assert not wrong, "imports that fail when they run:\n" + "\n".join(wrong)


def test_the_top_level_shows_the_layers():
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    own = sorted(modules - ACCELERATE_PATHS)
    assert len(own) <= TOP_LEVEL_LIMIT, (
        f"{len(own)} top-level modules besides Accelerate's paths and the façade (at most {TOP_LEVEL_LIMIT}): {own}; "
        "put a new module in the package of its layer (docs/concepts/architecture.md)")
    assert not set(anyaccel.MOVED_MODULES) & {f"anyaccel.{e}" for e in modules | packages}, "a moved path is a file again"
    text = (ROOT / "docs" / "concepts" / "architecture.md")
    if text.is_file():  # (not in the wheel)
        picture = text.read_text().split("```text", 1)[1].split("```", 1)[0]
        missing = [e for e in sorted((modules | packages) - ACCELERATE_PATHS)
                   if not re.search(rf"(^|[\s·]){e}(/|\b)", picture)]
        assert not missing, f"docs/concepts/architecture.md's picture of the layers does not show {missing}"


def test_the_module_paths_of_before_the_packages_are_the_new_modules():
    from anyaccel.strategies import MOVED_MODULES as STRATEGIES_MOVED

    for old, new in {**anyaccel.MOVED_MODULES, **STRATEGIES_MOVED}.items():
        assert module_file(new) is not None, new
        assert importlib.import_module(old) is importlib.import_module(new), old
    from anyaccel.detectors import Detector  # names through the old path: the same objects
    from anyaccel.environment.detectors import Detector as Home
    from anyaccel.stepping import AcceleratedOptimizer

    assert Detector is Home and AcceleratedOptimizer.__module__ == "anyaccel.training.stepping"


def test_python_m_of_an_old_module_path_runs_the_new_module():
    done = subprocess.run([sys.executable, "-m", "anyaccel.selftest_worker", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "usage: anyaccel.cli.selftest_worker" in done.stdout, done.stderr[-2000:]
