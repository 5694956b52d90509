"""Tests are grouped by feature, mirroring the package (issue 38 item 5), and stay so:

* every test file sits in a feature's folder named after an anyaccel package or top-level module
  (``tests/training/`` for ``anyaccel/training/``, ``tests/cli/`` for ``anyaccel/cli/``), or in a
  suite folder of its own kind (``project``, ``cluster``, ``slurm``, ``xla``, ``gpu``, ``soak``,
  ``examples``, ...);
* a feature's folder holds its unit tests, its multi-process tests (``*_multiprocess.py``) and the
  worker scripts they launch: every other ``.py`` file in it is named by a test file next to it;
* no orphan scripts: every worker script anywhere in tests/ is named by some file that runs it;
* tests/scripts (:data:`HELPERS`) holds no tests, only the helpers that the files of several
  folders import (``train_common``, ``tiny_models``) or tests/conftest.py uses for every folder
  (``warm_launch``); a helper of one folder lives in that folder;
* a worker script's name is unique under tests/, so ``SCRIPTS / "name.py"`` (tests/conftest.py's
  :func:`script`) finds it wherever it lives.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PACKAGE = ROOT / "anyaccel"
#: folders of one kind of check, not of one feature (each says what it is in its files)
SUITES = {"project", "cluster", "slurm", "xla", "gpu", "soak", "accelerate_compat", "tiny_strategy",
          "ci_cost",  # ci_cost: the per-test CPU measurement (docs/contributing/testing.md, "CI's time")
          "examples"}  # examples: every script of the repository's examples/ run as a user starts it
#: the folder of the helpers several folders' worker scripts import (on every worker's PYTHONPATH)
HELPERS = "scripts"
#: files every folder may hold that are not worker scripts
PLUMBING = {"__init__.py", "conftest.py", "__main__.py"}

pytestmark = pytest.mark.skipif(not PACKAGE.is_dir() or not TESTS.is_dir(), reason="needs the checkout")


def python_files(folder: Path) -> list:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def feature_folders() -> list:
    return sorted(p for p in TESTS.iterdir() if p.is_dir() and p.name not in SUITES | {HELPERS, "__pycache__"})


def test_every_test_file_sits_in_a_feature_folder_or_a_suite():
    wrong = []
    for path in python_files(TESTS):
        top = path.relative_to(TESTS).parts
        if len(top) == 1:
            if path.name != "conftest.py":
                wrong.append(f"{path.relative_to(ROOT)}: directly in tests/")
            continue
        folder = top[0]
        if folder in SUITES:
            continue
        if folder == HELPERS:
            if path.name.startswith("test_"):
                wrong.append(f"{path.relative_to(ROOT)}: tests/{HELPERS}/ holds only helpers; a test goes in its "
                             "feature's folder")
            continue
        sub = Path(*top[:-1])  # tests/strategies/fsdp/ mirrors anyaccel/strategies/fsdp/
        if len(top) > 2 and not any(path.parent.glob("test_*.py")):
            continue  # a folder of a feature's test data, with what writes it (tests/config/accelerate_files/)
        if not ((PACKAGE / sub).is_dir() or (PACKAGE / sub).with_suffix(".py").is_file()
                or (PACKAGE / folder).with_suffix(".py").is_file()):
            wrong.append(f"{path.relative_to(ROOT)}: tests/{sub}/ names no anyaccel package or module "
                         f"(a feature's tests go in the folder named after its package or module)")
    assert not wrong, "\n".join(wrong)


def test_a_features_worker_scripts_sit_next_to_the_tests_that_launch_them():
    wrong = []
    for folder in feature_folders():
        files = python_files(folder)
        tests = {p: p.read_text() for p in files if p.name.startswith("test_")}
        for path in files:
            if path.name.startswith("test_") or path.name in PLUMBING:
                continue
            if not any(path.name in text or f"import {path.stem}" in text for text in tests.values()):
                wrong.append(f"{path.relative_to(ROOT)}: no test in {folder.relative_to(ROOT)}/ launches or imports "
                             "it (move it next to the tests that run it, or into tests/scripts if several features' "
                             "workers import it)")
    assert not wrong, "\n".join(wrong)


def test_no_orphan_worker_scripts_and_unique_names():
    scripts = [p for folder in feature_folders() + [TESTS / HELPERS] if folder.is_dir()
               for p in python_files(folder) if not p.name.startswith("test_") and p.name not in PLUMBING]
    everything = {p: p.read_text() for p in python_files(TESTS)}
    for extra in ("scripts", "benchmarks", ".ci"):
        if (ROOT / extra).is_dir():
            everything.update({p: p.read_text(errors="replace") for p in (ROOT / extra).rglob("*") if p.is_file()
                               and "__pycache__" not in p.parts})
    orphans = [str(p.relative_to(ROOT)) for p in scripts
               if not any(q != p and (p.name in text or f"import {p.stem}" in text or f"from {p.stem} import" in text)
                          for q, text in everything.items())]
    assert not orphans, f"worker scripts nothing runs or imports (delete them, git remembers): {orphans}"
    names: dict = {}
    for p in python_files(TESTS):
        names.setdefault(p.name, []).append(p)
    clashes = {p.name: [str(q.relative_to(ROOT)) for q in names[p.name]] for p in scripts if len(names[p.name]) > 1}
    assert not clashes, f"a worker script's name must be unique under tests/ (SCRIPTS / name finds it): {clashes}"


def test_a_shared_helper_is_imported_by_several_folders():
    helpers = TESTS / HELPERS
    if not helpers.is_dir():
        return
    texts = {p: p.read_text() for p in python_files(TESTS) if p.parent != helpers}
    lonely = {}
    for path in python_files(helpers):
        if path.name in PLUMBING:
            continue
        users = {q.relative_to(TESTS).parts[0] for q, text in texts.items()
                 if f"import {path.stem}" in text or f"from {path.stem} import" in text}
        if len(users) < 2 and "conftest.py" not in users:  # tests/conftest.py's helpers serve every folder
            lonely[str(path.relative_to(ROOT))] = sorted(users)
    assert not lonely, (f"helpers in tests/{HELPERS}/ that the files of one folder import or none (move each next to "
                        f"the files that use it): {lonely}")


def test_a_test_modules_name_is_unique_among_the_folders_without_init():
    # pytest imports a file of a folder without __init__.py by its bare name (the folder put on sys.path), and a
    # multi-process half imports its unit file's helpers so (`from test_checkpoint import _same`)
    names: dict = {}
    for path in python_files(TESTS):
        if path.name.startswith("test_") and not (path.parent / "__init__.py").exists():
            names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert not clashes, f"test files of one name in folders without __init__.py (rename one): {clashes}"
