"""Accelerate's module paths stay paths (issue 30 item 4): ``anyaccel/optimizer.py``,
``scheduler.py``, ``data_loader.py``, ``hooks.py``, ``launchers.py``,
``parallelism_config.py``, ``state.py``, ``kwargs.py`` and ``plugins.py`` exist so that
``sed s/accelerate/anyaccel/`` on a script's imports is enough. Each holds only re-exports of
names whose home has a name of its own (``stepping.py``, ``data/``,
``big_modeling/forward_hooks.py``, ``launch/notebook.py``, ``strategies/options.py``,
``compat/``), and no anyaccel module imports them, so a reader never has to pick between two
homes. (``anyaccel/utils/`` is the same kind of path, checked in
``tests/compat/test_compat_api.py``.)"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import anyaccel

PACKAGE = Path(anyaccel.__file__).resolve().parent  # the checkout, or the installed wheel (make test-wheel)
PATHS = ["optimizer", "scheduler", "data_loader", "hooks", "launchers", "parallelism_config", "state", "kwargs", "plugins"]


def only_reexports(tree: ast.Module) -> list:
    """The statements of ``tree`` that are not a docstring, an import or ``__all__ = [...]``."""
    extra = []
    for i, node in enumerate(tree.body):
        docstring = i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        all_list = isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["__all__"]
        if not (docstring or all_list or isinstance(node, (ast.Import, ast.ImportFrom))):
            extra.append(f"line {node.lineno}: {ast.dump(node)[:60]}")
    return extra


@pytest.mark.parametrize("name", PATHS)
def test_an_accelerate_module_path_only_reexports_from_its_home(name):
    assert only_reexports(ast.parse((PACKAGE / f"{name}.py").read_text())) == []
    module = importlib.import_module(f"anyaccel.{name}")
    for exported in module.__all__:  # every name is really there, defined in its home
        value = getattr(module, exported)
        if not callable(value):
            continue  # a constant (a tuple of keys) carries no home; the AST check above says it is imported
        home = getattr(value, "__module__", "")
        assert home and home != f"anyaccel.{name}", (exported, home)


def test_no_anyaccel_module_imports_an_accelerate_module_path():
    importers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        package = ".".join(("anyaccel",) + path.relative_to(PACKAGE).with_suffix("").parts[:-1])
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                target = f"{base}.{node.module}" if node.level and node.module else (node.module or base)
                names = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n in {f"anyaccel.{p}" for p in PATHS} for n in names):
                importers.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert importers == [], "import the name from its home instead: " + ", ".join(importers)


def test_the_scan_tells_a_reexport_from_a_definition():
    assert only_reexports(ast.parse('"""doc"""\nfrom .stepping import X\n__all__ = ["X"]\n')) == []
    assert only_reexports(ast.parse('"""doc"""\nX = 1\n')) != []
