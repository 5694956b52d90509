"""What must work across two machines, on the two-host cluster (scripts/cluster.sh; ``make test-cluster``).

Each host is its own network namespace, address and host name; ``anyaccel launch`` runs once per
host with ``--num_machines 2``, as a user would on two machines.
"""

from __future__ import annotations

import sys

import pytest
import torch

from .harness import CONSOLE_SCRIPT, SCRIPTS, wait_all

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
TRAIN = SCRIPTS / "train_preempt.py"


def test_launch_on_two_hosts_trains_like_one_host(cluster, tmp_path, preempt_reference):
    """One process on each of two hosts ends with the weights two processes on one host reach
    (the session's reference run, conftest.py)."""
    procs = [cluster.launch(h, TRAIN, "--project", tmp_path / "two", "--out", tmp_path / "two.pt", nproc=1)
             for h in (0, 1)]
    outs = wait_all(procs, timeout=240, cluster=cluster)
    for proc, out in zip(procs, outs):
        assert proc.returncode == 0, out[-3000:]
    assert "machine 1 of 2, main 192.0.2.10:29500" in outs[1]
    two, single = torch.load(tmp_path / "two.pt"), torch.load(preempt_reference)
    assert two.keys() == single.keys()
    for key in two:
        assert torch.equal(two[key], single[key]), key


def test_anyaccel_test_passes_across_two_hosts(cluster):
    procs = [cluster.popen(h, [sys.executable, "-c", CONSOLE_SCRIPT, "test", "--cpu", "--num_machines", 2,
                               "--machine_rank", h, "--main_process_ip", cluster.hosts[0].addr,
                               "--main_process_port", 29500, "--num_processes", 2]) for h in (0, 1)]
    outs = wait_all(procs, timeout=240, cluster=cluster)
    for proc, out in zip(procs, outs):
        assert proc.returncode == 0 and "PASS:" in out and "FAIL" not in out, out[-3000:]
