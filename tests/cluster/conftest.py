"""The two-host test cluster (scripts/cluster.sh) as a pytest fixture.

``make test-cluster`` starts the cluster, runs ``pytest -m cluster tests/cluster`` and stops it
whatever the tests did. Run by hand (as root)::

    bash scripts/cluster.sh start
    PYTHONPATH=$PWD .venv/bin/python -m pytest -m cluster tests/cluster
    bash scripts/cluster.sh stop

Each host is a network namespace with its own address, host name and /etc/hosts; the filesystem
is shared (as NFS would be). Every command of a test runs "on" a host (``cluster.popen(i, ...)``);
nothing runs from the root namespace, whose traffic into the namespaces is refused on some machines.
Tests are skipped, saying why, when not root, without ``ip netns``, or when the cluster is not started.

The ``slurm`` fixture adds a SLURM over the hosts for the tests of one module
(``scripts/cluster.sh slurm start``: slurmctld on host 0, one slurmd per host; installs slurm-wlm
and munge with apt-get the first time, as ``make test-slurm`` does) and stops it after them, so
the other modules see hosts without daemons; each test's jobs are cancelled after it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from . import figures
from .harness import CONSOLE_SCRIPT, SCRIPT, SCRIPTS, Cluster, Host, Slurm, skip_reason, slurm_command, wait_all


def pytest_configure(config):
    config.addinivalue_line("markers", "cluster: needs the two-host test cluster (`make test-cluster`, root)")


def pytest_sessionfinish(session, exitstatus):
    """The fault tests' timings as a results file for the docs (tests/cluster/figures.py)."""
    written = figures.write()
    if written:
        print(f"\ncluster fault figures: {written}")


@pytest.fixture(scope="session")
def cluster_hosts() -> List[Host]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    status = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True, text=True, check=True)
    hosts = []
    for line in status.stdout.splitlines():
        index, name, addr = line.split()[:3]
        hosts.append(Host(int(index), name, addr))
    return hosts


@pytest.fixture
def cluster(cluster_hosts):
    c = Cluster(cluster_hosts)
    c.reset()
    yield c
    c.reset()


@pytest.fixture(scope="module")
def slurm_daemons(cluster_hosts):
    """SLURM_CONF of a SLURM started over the hosts for one module (stopped after it)."""
    started = slurm_command("start")
    if started.returncode != 0:
        slurm_command("stop")
        pytest.fail(f"`scripts/cluster.sh slurm start` failed ({started.returncode}):\n{started.stdout}{started.stderr}")
    conf = slurm_command("env").stdout.strip().split("=", 1)[1]
    try:
        yield conf
    finally:
        Slurm(Cluster(cluster_hosts), conf).cancel_all()
        slurm_command("stop")


@pytest.fixture
def slurm(cluster_hosts, slurm_daemons):
    """A :class:`Slurm` whose jobs, and whatever the test started, are ended after the test."""
    s = Slurm(Cluster(cluster_hosts), slurm_daemons)
    yield s
    s.cluster.end_started()
    s.cancel_all()


@pytest.fixture(scope="session")
def preempt_reference(cluster_hosts, tmp_path_factory) -> Path:
    """The weights tests/process/train_preempt.py ends with, uninterrupted, with its default
    arguments (3 epochs; ``--sleep`` changes only the time): 2 processes on host 0, run once for
    the session. The tests that interrupt and resume that training compare with it bitwise
    (test_faults.py's (c) and (e): two hosts reach it too); each used to run its own reference first."""
    out = tmp_path_factory.mktemp("preempt-reference")
    proc = Cluster(cluster_hosts).popen(0, [sys.executable, "-c", CONSOLE_SCRIPT, "launch", "--cpu", "--num_processes",
                                            2, SCRIPTS / "train_preempt.py", "--project", out / "project",
                                            "--out", out / "ref.pt"])
    text = wait_all([proc], timeout=240)[0]
    assert proc.returncode == 0, text[-3000:]
    return out / "ref.pt"
