"""Per-test CPU cost (docs/contributing/testing.md, "CI's time"), loaded by tests/conftest.py when ``CI_COST_LOG`` is set.

For every test phase (setup: module fixtures land in the first test that uses them; call;
teardown) it appends a JSON line to ``$CI_COST_LOG``: node id, phase, wall seconds, and CPU
seconds (user + sys) of the pytest process and of its finished children, from
``resource.getrusage`` deltas (a child's own children are counted once it has waited for them:
launchers' workers, notebook kernels' forks). CPU time is what a shared 2-core CI machine pays
whatever the load; wall time here is distorted by the load. Interpreter starts and forks are
counted by :mod:`sitecustomize` next to this file (``$CI_COST_LOG.procs``).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _cpu() -> tuple:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    warm = sys.modules.get("warm_launch")  # jobs forked by the warm server: its children, not ours
    jobs = warm.CPU["jobs"] if warm is not None else 0.0
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime + jobs


def install() -> None:
    """Puts this folder first on PYTHONPATH (every child logs its start); Local, the pytest process."""
    os.environ["PYTHONPATH"] = str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    os.environ["CI_COST_TEST"] = item.nodeid
    yield
    os.environ.pop("CI_COST_TEST", None)


def _phase(item, phase):
    began, wall, (own, kids) = time.time(), time.monotonic(), _cpu()
    yield
    own2, kids2 = _cpu()
    record = {"test": item.nodeid, "phase": phase, "wall": round(time.monotonic() - wall, 3),
              "cpu_self": round(own2 - own, 3), "cpu_children": round(kids2 - kids, 3),
              # when and where (the xdist worker): the schedule of the workers, their idle ends (report.py)
              "start": round(began, 3), "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
    with open(os.environ["CI_COST_LOG"], "a") as f:
        f.write(json.dumps(record) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _phase(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _phase(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield from _phase(item, "teardown")
