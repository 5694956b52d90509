"""What must work across two machines, on the two-host cluster (scripts/cluster.sh; ``make test-cluster``).

Each host is its own network namespace, address and host name; ``anyaccel launch`` runs once per
host with ``--num_machines 2``, as a user would on two machines. That two hosts train bitwise as
two processes on one host is checked by test_faults.py's (e) and (c): both train on the two hosts
from step 0, resume there, and end bitwise at the one-host reference (an uninterrupted run on two
hosts was a launch of its own here, ~25 s of CI, for nothing those two do not assert).
"""

from __future__ import annotations

import sys

import pytest

from .harness import CONSOLE_SCRIPT, wait_all

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_anyaccel_test_passes_across_two_hosts(cluster):
    procs = [cluster.popen(h, [sys.executable, "-c", CONSOLE_SCRIPT, "test", "--cpu", "--num_machines", 2,
                               "--machine_rank", h, "--main_process_ip", cluster.hosts[0].addr,
                               "--main_process_port", 29500, "--num_processes", 2]) for h in (0, 1)]
    outs = wait_all(procs, timeout=240, cluster=cluster)
    for proc, out in zip(procs, outs):
        assert proc.returncode == 0 and "PASS:" in out and "FAIL" not in out, out[-3000:]
