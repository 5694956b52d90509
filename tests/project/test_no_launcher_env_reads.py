"""Launcher facts are read once, by the detectors, into the frozen Environment (issue 21 item 5):
no module below them reads a launcher's variable (``RANK``, ``TORCHELASTIC_RUN_ID``,
``SLURM_JOB_ID``, ...) from ``os.environ`` on its own. Setting variables for workers is fine.

An AST scan of the package: ``os.environ.get("X")``, ``os.environ["X"]`` (read), ``"X" in
os.environ`` and ``os.getenv("X")`` with a constant launcher variable name ``X``."""

from __future__ import annotations

import ast
import pathlib
import re
from typing import Iterator, List, Tuple

from conftest import ROOT

PACKAGE = ROOT / "anyaccel"

LAUNCHER_VARIABLE = re.compile(
    r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_RANK|NODE_RANK|NNODES"
    r"|PET_NNODES|MASTER_ADDR|MASTER_PORT|PJRT_DEVICE|XRT_TPU_CONFIG|MPI_LOCALRANKID|MPI_LOCALNRANKS"
    r"|TORCHELASTIC_\w+|SLURM_\w+|SLURMD_\w+|OMPI_\w+|PMI_\w+|TPU_\w+)$")

# Where reading them is the job (paths relative to anyaccel/):
ALLOWED = {
    "detectors.py",  # the detectors: launcher variables -> Topology + LaunchFacts
    "slurm.py",  # the one SLURM parser, used by the SLURM detector and by the launch planner
    "envvars.py",  # anyaccel's own variables and the worker settings the launcher passes
    "launch/plan.py",  # the launch planner reads the launcher's machine (inside srun, etc.) to plan workers
    "env_report.py",  # `anyaccel env` prints the launcher variables that are set, as they are
}


def _is_os_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name) \
        and node.value.id == "os"


def _constant(node: ast.AST) -> str:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""


def reads(tree: ast.AST) -> Iterator[Tuple[int, str]]:
    """(line, variable) of every read of a launcher variable from ``os.environ`` in ``tree``."""
    for node in ast.walk(tree):
        name = ""
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            func = node.func
            if (_is_os_environ(func.value) and func.attr == "get") or (
                    func.attr == "getenv" and isinstance(func.value, ast.Name) and func.value.id == "os"):
                name = _constant(node.args[0])
        elif isinstance(node, ast.Subscript) and _is_os_environ(node.value) and isinstance(node.ctx, ast.Load):
            name = _constant(node.slice)
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
                and _is_os_environ(node.comparators[0]):
            name = _constant(node.left)
        if name and LAUNCHER_VARIABLE.match(name):
            yield node.lineno, name


def launcher_reads(package: pathlib.Path = PACKAGE) -> List[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if relative in ALLOWED:
            continue
        for line, name in reads(ast.parse(path.read_text(), str(path))):
            found.append(f"anyaccel/{relative}:{line} reads {name}")
    return found


def test_only_the_detectors_read_launcher_variables_from_os_environ():
    found = launcher_reads()
    assert not found, ("launcher variables read outside the detectors; use Environment.launch (or "
                       "anyaccel.detectors.launch_facts / detect_topology where no Environment exists):\n"
                       + "\n".join(found))


def test_the_scan_sees_each_kind_of_read():
    source = '''
import os
a = os.environ.get("TORCHELASTIC_RUN_ID")
b = os.environ["SLURM_JOB_ID"]
c = "RANK" in os.environ
d = os.getenv("MASTER_PORT", "1")
os.environ["RANK"] = "0"           # a write: fine
e = os.environ.get("HOME")         # not a launcher variable
'''
    assert sorted(name for _, name in reads(ast.parse(source))) == [
        "MASTER_PORT", "RANK", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"]
