"""HSDP over the two hosts (scripts/cluster.sh; ``make test-cluster``): 2 processes per host,
``ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)`` — each replica sharded over the two
processes of one host, the replicas across hosts (gradients reduce-scattered within a host,
all-reduced across) — trains like one process, and every shard group lies on one host.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .fault_tools import no_process_left
from .harness import wait_all

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
WORKER = Path(__file__).resolve().parent / "hsdp_worker.py"


def test_hsdp_replicates_across_hosts_shards_within_and_trains_like_one_process(cluster, tmp_path):
    procs = [cluster.launch(h, WORKER, tmp_path, nproc=2) for h in (0, 1)]
    outs = wait_all(procs, timeout=400, cluster=cluster)
    assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outs]
    no_process_left(cluster)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    where = [json.loads((tmp_path / f"host{r}.json").read_text()) for r in range(4)]
    r0 = ranks[0]
    assert (r0["strategy"], r0["distributed_type"], r0["mesh_dims"], r0["mesh_shape"]) == \
        ("nd", "FSDP", ["dp_replicate", "dp_shard"], [2, 2])
    # float32 sums of 4 partial gradients (reduce-scatter within a host, all-reduce across) in
    # another order than the one process's batch of 16: rounding of ~1e-7 per step, 6 SGD steps
    for r in ranks:
        assert r["batches"] == 6 and r["gathered"] == [16] * 6
        assert r["losses"] == pytest.approx(r0["ref_losses"], rel=1e-5)
        assert r["norms"] == pytest.approx(r0["ref_norms"], rel=1e-5)
        assert r["local_param_numel"] <= 0.5 * r["full_param_numel"] * 1.1  # each rank holds half
    assert r0["same_keys"] and r0["max_weight_diff"] < 1e-5
    # the mesh's rows are the shard groups: both ranks of a row on one host, the two rows on two hosts
    mesh = where[0]["mesh"]
    assert where[0]["dims"] == ["dp_replicate", "dp_shard"] and all(w["mesh"] == mesh for w in where)
    host_of = {r: where[r]["host"] for r in range(4)}
    shard_hosts = [{host_of[r] for r in row} for row in mesh]
    assert all(len(h) == 1 for h in shard_hosts), (mesh, host_of)
    assert {h.pop() for h in shard_hosts} == {h.name for h in cluster.hosts}, (mesh, host_of)
    print(f"FIGURE hsdp 2 hosts x 2 processes: shard groups {mesh} on {[host_of[row[0]] for row in mesh]}; "
          f"losses within rel 1e-5 of one process, max weight difference {r0['max_weight_diff']:.1e}")
