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
"""

from __future__ import annotations

import subprocess
from typing import List

import pytest

from .harness import SCRIPT, Cluster, Host, skip_reason


def pytest_configure(config):
    config.addinivalue_line("markers", "cluster: needs the two-host test cluster (`make test-cluster`, root)")


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


