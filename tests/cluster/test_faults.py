"""The faults clusters have, on the two-host cluster (scripts/cluster.sh; ``make test-cluster``).

Each test prints one line ``FIGURE <fault>: ...`` (time to a clear error or to recovery, steps
lost); docs/guides/cluster.md has the table. The job: tests/scripts/train_preempt.py, one process
per host (world size 2), ``--hang_timeout 5``, a short sleep per step so that a fault lands mid-run.
"""

from __future__ import annotations

import time

import pytest
import torch

from .harness import SCRIPTS, wait_all

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
TRAIN = SCRIPTS / "train_preempt.py"
HANG = 5.0


def _start(cluster, tmp_path, *args, extra=(), name="run"):
    marker = tmp_path / f"{name}.marker"
    procs = [cluster.launch(h, TRAIN, "--project", tmp_path / "project", "--out", tmp_path / f"{name}.pt",
                            "--marker", marker, *args, nproc=1, extra=("--hang_timeout", HANG, *extra))
             for h in (0, 1)]
    deadline = time.monotonic() + 180
    while not marker.exists():
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            outs = wait_all(procs, timeout=30, cluster=cluster)
            pytest.fail("the job did not reach the marker step:\n" + "\n----\n".join(o[-3000:] for o in outs))
        time.sleep(0.2)
    return procs


def _until_no_process(cluster, procs, timeout):
    outs = wait_all(procs, timeout=timeout, cluster=cluster)
    deadline = time.monotonic() + 10
    while any(cluster.processes(h.index) for h in cluster.hosts) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {h.name: cluster.processes(h.index) for h in cluster.hosts}
    assert not any(left.values()), f"processes left: {left}"
    return outs


def test_a_link_down_ends_every_process_naming_the_unreachable_host(cluster, tmp_path):
    procs = _start(cluster, tmp_path, "--epochs", 100, "--sleep", 0.2, "--marker_step", 5)
    cluster.link(1, up=False)
    down = time.monotonic()
    outs = _until_no_process(cluster, procs, timeout=120)
    elapsed = time.monotonic() - down
    assert all(p.returncode != 0 for p in procs), outs
    assert "aa-host1" in outs[0] and "unreachable" in outs[0], outs[0][-4000:]
    assert "store on machine 0 (192.0.2.10:29500) has not answered" in outs[1], outs[1][-4000:]
    print(f"FIGURE a link down: every process ended {elapsed:.1f} s after the link went down "
          f"(hang_timeout {HANG:g} s), no process left")
    assert elapsed < 2 * HANG + 30
