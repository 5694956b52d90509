"""Shared test helpers: run the real `anyaccel` CLI, or a script under torch's own launcher, with real processes.

Imported as ``from conftest import ...`` from every folder of tests/ (pytest puts this folder on
sys.path). Where tests live (docs/contributing/testing.md): a feature's folder, named after its
package or module (tests/training/, tests/strategies/fsdp/, tests/checkpoint/, ...), holds its unit
tests, its multi-process tests (``*_multiprocess.py``, marked slow) and the worker scripts those
launch; tests/scripts only the helpers several features' workers import (``train_common``,
``tiny_models``); tests/project the whole-project checks, and the other suite folders (examples,
soak, cluster, slurm, ...) one kind of check each (tests/project/test_test_layout.py keeps the layout).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def script(name: str) -> Path:
    """The worker script ``name`` (``"fp8_checks.py"``) wherever it lives under tests/: next to the
    tests that launch it. Names are unique (tests/project/test_test_layout.py)."""
    found = [p for p in TESTS.rglob(name) if "__pycache__" not in p.parts]
    if len(found) != 1:
        raise FileNotFoundError(f"tests/ has {len(found)} files named {name!r} ({found}); a worker script's name is "
                                "unique under tests/ (put it next to the tests that launch it)")
    return found[0]


class _ScriptFolder(type(Path())):  # type: ignore[misc]
    """tests/scripts, where ``SCRIPTS / "x.py"`` finds the worker script ``x.py`` wherever it lives
    (:func:`script`); ``str(SCRIPTS)`` is the folder of the helpers workers import."""

    def __truediv__(self, name):  # type: ignore[override]
        here = Path(str(self)) / name
        return here if here.exists() else script(str(name))


SCRIPTS = _ScriptFolder(TESTS / "scripts")
if str(SCRIPTS) not in sys.path:  # the helpers of tests/scripts (warm_launch) import by name, as workers do
    sys.path.append(str(SCRIPTS))

# ``warm_launch(nproc, script, *args, env=, timeout=, cwd=)``: ``anyaccel launch --num_processes N --cpu``
# as far as the script can tell, its workers forked from a warm interpreter (the public
# ``debug_launcher``); for the tests of what the library computes across ranks
from warm_launch import warm_launch  # noqa: E402

# What the `anyaccel` console script runs (``-c`` code), for tests that drive the real CLI.
CONSOLE_SCRIPT = "import sys; from anyaccel.cli import main; sys.exit(main())"

# Variables from an outer launcher would make a test worker think it is part of another job.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def clean_env(**extra: str) -> dict:
    """os.environ without launcher/SLURM/MPI variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_VARS and not k.startswith(("SLURM_", "OMPI_", "PMI_", "ANYACCEL_"))}
    env.setdefault("OMP_NUM_THREADS", "1")
    # the checkout first; then the helpers a worker script imports from any feature's folder (train_common, ...)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS / "scripts"), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def alive(pids) -> list:
    """The processes of ``pids`` that still run (a zombie, ended but not yet reaped, counts as gone)."""
    import psutil

    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            pass
    return running


def alive_after(pids, within: float) -> list:
    """Wait up to ``within`` seconds for every process of ``pids`` to be gone; those still running."""
    deadline = time.monotonic() + within
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)


def torchrun(script, *args, nproc: int = 2, timeout: float = 180, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run ``script`` with ``python -m torch.distributed.run`` on a free port; return the result."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--max-restarts", "0",
           str(script), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or clean_env())
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode})\nSTDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}")
    return proc


@pytest.fixture
def run_torchrun():
    return torchrun


def anyaccel(*args, timeout: float = 240, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Run the `anyaccel` CLI (as its console script does) with ``args``; return the result."""
    return subprocess.run([sys.executable, "-c", CONSOLE_SCRIPT, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env or clean_env(), cwd=cwd)


def launch_checks(script: str, out: Path, *flags, nproc: int = 2, timeout: float = 240, warm: bool = True,
                  env: dict | None = None) -> list:
    """`anyaccel launch --num_processes N --cpu FLAGS SCRIPT OUT` (the worker script found by name,
    :func:`script`) in ``env`` (default ``clean_env()``), which must succeed; without FLAGS and with
    ``warm`` (the default), forked from the warm interpreter (:func:`warm_launch`). Returns what
    each rank wrote to ``OUT/rank{r}.json``, in rank order."""
    if warm and not flags:
        proc = warm_launch(nproc, SCRIPTS / script, out, timeout=timeout, env=env)
    else:
        proc = anyaccel("launch", "--num_processes", nproc, "--cpu", *flags, SCRIPTS / script, out, timeout=timeout,
                        env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(nproc)]


#: the multi-process test files that take longest (CPU time: tests/ci_cost; docs/contributing/testing.md),
#: longest first, by name without ``.py`` and ``_multiprocess``: pytest-xdist (``make test``: 2
#: workers, whole files) hands them out first, the other multi-process files next and the unit tests
#: last, so that no long file starts at the end
LONG_FIRST = ("test_soak", "test_examples", "test_launch", "test_preemption", "test_selftest", "test_deepspeed",
              "test_fault_tolerance", "test_diffusers_shapes", "test_pipeline", "test_fsdp", "test_distributed_core",
              "test_accelerate_compat", "test_expert", "test_lifetime")  # by wall time, 2026-11-29 (warm launcher)


def free_port_in(low: int, high: int, host: str = "0.0.0.0") -> int:
    """A port in ``low..high`` that ``host`` can bind right now. Keep ``high`` below Linux's
    ephemeral range (32768+), so that no other test's outgoing connection takes it before the
    launcher binds it."""
    import random
    import socket

    for _ in range(100):
        port = random.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {low}-{high}")


@pytest.fixture
def free_port():
    """A function giving a port free right now, below Linux's ephemeral range (:func:`free_port_in`)."""
    return lambda: free_port_in(20000, 32767)


#: what may appear at the repository's top level while tests run: tools' caches, and what the CI
#: steps that run beside a pytest session make (``make setup``'s virtual environment and egg-info
#: beside test-xla, test-wheel's build/); anything else is a test (or a worker it launched) writing
#: into the working directory instead of tmp_path
_ROOT_TOOLS = {".pytest_cache", ".hypothesis", "__pycache__", ".venv", ".venv-xla", "build", "dist", ".mypy_cache",
               ".ruff_cache", ".import_linter_cache", ".whl", ".gl", ".gpu-wheels"}
_ROOT_BEFORE: set = set()


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # (the controller, or a run without xdist)
        _ROOT_BEFORE.update(os.listdir(ROOT))


def pytest_sessionfinish(session, exitstatus):
    """Fail the run when it left new files or folders at the repository's top level (CI runs on a
    clean clone: a test's job started there with no ``cwd`` writes its project_dir, its
    ``replica_group_<g>`` folders, its checkpoints into the clone). Local to the controller."""
    if hasattr(session.config, "workerinput") or not _ROOT_BEFORE:
        return
    left = sorted(name for name in set(os.listdir(ROOT)) - _ROOT_BEFORE - _ROOT_TOOLS if not name.endswith(".egg-info"))
    if left:
        sys.stderr.write(f"\nthe tests left {left} in {ROOT}: a test (or a job it launched) wrote into the working "
                         "directory; give its subprocess cwd=tmp_path (or chdir there). Remove them before the next "
                         "run.\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(config, items):
    """Long files first (:data:`LONG_FIRST`), then the other files with multi-process tests, then
    the rest, each file's tests in their own order (a stable sort: module fixtures run once)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}

    def rank(item):
        if item.path not in slow_files:
            return len(LONG_FIRST) + 1
        stem = item.path.stem.removesuffix("_multiprocess")
        return LONG_FIRST.index(stem) if stem in LONG_FIRST else len(LONG_FIRST)

    items.sort(key=rank)


if os.environ.get("CI_COST_LOG"):  # per-test CPU time and process starts (docs/contributing/testing.md, "CI's time")
    from ci_cost import plugin as _cost_plugin

    _cost_plugin.install()

    def pytest_configure(config):
        config.pluginmanager.register(_cost_plugin, "ci_cost")
