"""The one mesh object (anyaccel/strategies/mesh.py): sizes checked once, and every rank answer —
coordinates, groups by use, the metrics share, the pipeline's stage placement — as pure
arithmetic, for several layouts, without a process group."""

import itertools
import math

import pytest

from anyaccel.strategies.mesh import DIMS, USES, ProcessMesh, resolve_sizes


def _meshes(sizes):
    world = math.prod(sizes.values())
    return [ProcessMesh(sizes, rank) for rank in range(world)]


LAYOUTS = [
    {"dp_replicate": 4},                                        # DDP over 4
    {"dp_shard": 8},                                            # FSDP over 8
    {"dp_replicate": 2, "dp_shard": 2, "tp": 2},                # HSDP x TP
    {"pp": 2, "dp_shard": 2, "tp": 2},                          # pipeline x FSDP x TP
    {"dp_shard": 2, "sp": 2, "tp": 2},                          # FSDP x Ulysses x TP
    {"pp": 2, "dp_replicate": 2, "dp_shard": 3, "sp": 1, "tp": 2},
]


@pytest.mark.parametrize("sizes", LAYOUTS, ids=lambda s: "x".join(f"{k}{v}" for k, v in s.items()))
def test_coordinates_are_row_major_with_tp_fastest(sizes):
    meshes = _meshes(sizes)
    full = [sizes.get(d, 1) for d in DIMS]
    for rank, coords in enumerate(itertools.product(*(range(n) for n in full))):  # outermost first
        assert tuple(meshes[rank].coordinate(d) for d in DIMS) == coords


@pytest.mark.parametrize("sizes", LAYOUTS, ids=lambda s: "x".join(f"{k}{v}" for k, v in s.items()))
def test_every_use_partitions_the_job_into_groups_that_agree(sizes):
    meshes = _meshes(sizes)
    for use in list(USES) + list(DIMS):
        groups = {m.ranks(use) for m in meshes}
        members = sorted(r for g in groups for r in g)
        assert members == list(range(len(meshes))), use  # every process in exactly one group
        for m in meshes:
            group = m.ranks(use)
            assert len(group) == m.size(use) and group[m.rank_in(use)] == m.rank, use
            assert all(meshes[r].ranks(use) == group for r in group), use
            # the processes of a group differ only along the use's dimensions
            spanned = {u for d in m.dims(use) for u in _UNDER.get(d, (d,))}  # ep/efsdp split dp_shard x cp x sp
            others = [d for d in DIMS if d not in spanned]
            assert all([meshes[r].coordinate(d) for d in others] == [m.coordinate(d) for d in others] for r in group)


def test_a_tp_x_hsdp_layout_answers_each_use():
    # 16 processes: pp 2 x dp_replicate 2 x dp_shard 2 x tp 2; rank 13 = (pp 1, rep 1, shard 0, tp 1)
    mesh = ProcessMesh({"pp": 2, "dp_replicate": 2, "dp_shard": 2, "tp": 2}, 13)
    assert [mesh.coordinate(d) for d in ("pp", "dp_replicate", "dp_shard", "tp")] == [1, 1, 0, 1]
    assert (mesh.rank_in("batch"), mesh.size("batch")) == (2, 4)  # the loader's shard: replica 1, shard 0
    assert mesh.ranks("batch") == (9, 11, 13, 15)
    assert mesh.ranks("tp") == (12, 13) and mesh.ranks("pp") == (5, 13)
    assert mesh.ranks("loss") == mesh.ranks("gradients") == (9, 11, 13, 15)  # no sp/cp: the batch's processes
    assert mesh.size("stage") == 8 and mesh.ranks("stage") == tuple(range(8, 16))
    assert not mesh.keeps_metrics_share  # tp 1, pp 1: its batch is counted by rank 4 (pp 0, tp 0)
    assert ProcessMesh({"pp": 2, "dp_replicate": 2, "dp_shard": 2, "tp": 2}, 2).keeps_metrics_share
    assert [m.rank for m in _meshes({"pp": 2, "dp_replicate": 2, "dp_shard": 2, "tp": 2})
            if m.keeps_metrics_share] == [0, 2, 4, 6]  # one per batch: pp 0, tp 0


def test_sequence_parallel_ranks_share_a_batch_and_count_in_the_loss():
    meshes = _meshes({"dp_shard": 2, "sp": 2, "tp": 2})
    assert [m.rank_in("batch") for m in meshes] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [m.coordinate("sp") for m in meshes] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert meshes[0].ranks("loss") == (0, 2, 4, 6) and meshes[0].size("gradients") == 4  # dp x sp, not tp
    assert [m.rank for m in meshes if m.keeps_metrics_share] == [0, 4]


def test_a_flat_mesh_is_every_process_on_one_data_parallel_dimension():
    ddp = ProcessMesh.flat(4, 3)
    assert ddp.sizes["dp_replicate"] == 4 and (ddp.rank_in("batch"), ddp.size("batch")) == (3, 4)
    assert ddp.keeps_metrics_share and ddp.size("loss") == 4 and ddp.keep == ("dp_replicate",)
    fsdp = ProcessMesh.flat(4, 1, dim="dp_shard")
    assert fsdp.sizes["dp_shard"] == 4 and fsdp.rank_in("batch") == 1
    one = ProcessMesh.flat(1, 0)
    assert one.size("batch") == one.size("loss") == 1 and one.ranks("tp") == (0,)
    assert repr(one) == "ProcessMesh(one process; rank 0)" and "dp_shard=4" in repr(fsdp)


def test_pipeline_stages_are_placed_looped_or_in_a_v():
    mesh = ProcessMesh({"pp": 4}, 0)
    assert mesh.stage_ranks(1) == (0, 1, 2, 3)
    assert mesh.stage_ranks(2) == (0, 1, 2, 3, 0, 1, 2, 3)
    assert mesh.stage_ranks(2, v_shape=True) == (0, 1, 2, 3, 3, 2, 1, 0)


def test_sizes_are_checked_once_with_the_numbers_and_the_fix():
    assert resolve_sizes({}, 4)["dp_replicate"] == 4  # Accelerate's rule: all 1 -> plain data parallelism
    with pytest.raises(ValueError, match=r"ParallelismConfig: pp_size=1 x dp_replicate_size=1 x dp_shard_size=2 x "
                                         r"cp_size=1 x sp_size=1 x tp_size=2 = 4 processes, but this job has 8; .*"
                                         r"dp_shard_size=4 with the others as they are, or launch with --num_processes 4"):
        resolve_sizes({"dp_shard": 2, "tp": 2}, 8, owner="ParallelismConfig")
    with pytest.raises(ValueError, match=r"but this job has 6; .*\(launch with --num_processes 4\)"):
        resolve_sizes({"tp": 4}, 6)  # 6 is not a multiple of tp 4: no dp_shard_size hint
    with pytest.raises(ValueError, match=r"ProcessMesh\(tp_size=0\): must be an integer >= 1"):
        ProcessMesh({"tp": 0}, 0)
    with pytest.raises(ValueError, match="unknown mesh dimension\\(s\\) \\['ep'\\]"):
        ProcessMesh({"ep": 2}, 0)
    with pytest.raises(ValueError, match="rank 4 is outside a job of 4 processes"):
        ProcessMesh({"tp": 4}, 4)
    with pytest.raises(ValueError, match="unknown mesh dimension or use 'expert'"):
        ProcessMesh({"tp": 2}, 0).size("expert")


def test_the_n_d_strategy_and_its_config_read_the_mesh():
    from anyaccel import backends
    from anyaccel.environment import Environment
    from anyaccel.strategies import create_strategy
    from anyaccel.strategies.nd.options import ParallelismConfig

    env = Environment(world_size=8, rank=5, local_world_size=8, source="test", backend="gloo")
    strategy = create_strategy(env, backends.backend_class("cpu")(env), "nd",
                               options=ParallelismConfig(dp_shard_size=2, sp_size=2, tp_size=2))
    mesh = strategy.process_mesh
    assert (mesh.rank, mesh.sizes["sp"]) == (5, 2)
    assert [strategy.rank_in(d) for d in ("dp_shard", "sp", "tp")] == [1, 0, 1]
    assert strategy.data_parallel() == (1, 2) and strategy.sequence_slice() == (0, 2, None)
    assert ParallelismConfig(tp_size=2).for_world_size(2).sizes()["tp"] == 2


# ---- expert parallel: ep borrows dp_shard x cp x sp (issue 39) ----------------------------------------
EP_LAYOUTS = [
    ({"dp_shard": 4}, 2),                                       # ep2 x efsdp2
    ({"dp_shard": 4}, 4),                                       # every shard rank in one ep group
    ({"dp_replicate": 2, "dp_shard": 2}, 2),                    # HSDP with ep
    ({"dp_shard": 2, "tp": 2}, 2),                              # ep2 x tp2: each tp rank its own ep group
    ({"pp": 2, "dp_shard": 2, "sp": 2, "tp": 2}, 4),            # ep across dp_shard and sp
    ({"dp_replicate": 2, "dp_shard": 4, "sp": 1, "tp": 2}, 2),
]
_UNDER = {"ep": ("dp_shard", "cp", "sp"), "efsdp": ("dp_shard", "cp", "sp")}


def _ep_meshes(sizes, ep):
    return [ProcessMesh(sizes, rank, ep=ep) for rank in range(math.prod(sizes.values()))]


@pytest.mark.parametrize("sizes,ep", EP_LAYOUTS, ids=lambda v: "x".join(f"{k}{n}" for k, n in v.items())
                         if isinstance(v, dict) else f"ep{v}")
def test_expert_groups_partition_the_borrowed_processes(sizes, ep):
    meshes = _ep_meshes(sizes, ep)
    borrowed = math.prod(sizes.get(d, 1) for d in ("dp_shard", "cp", "sp"))
    for use in ("experts", "expert_sharding", "ep", "efsdp") + tuple(USES) + DIMS:
        groups = {m.ranks(use) for m in meshes}
        assert sorted(r for g in groups for r in g) == list(range(len(meshes))), use
        for m in meshes:
            group = m.ranks(use)
            assert len(group) == m.size(use) and group[m.rank_in(use)] == m.rank, use
            assert all(meshes[r].ranks(use) == group for r in group), use
            spanned = {u for d in m.dims(use) for u in _UNDER.get(d, (d,))}
            same = [d for d in DIMS if d not in spanned]  # tp and pp are never borrowed
            assert all([meshes[r].coordinate(d) for d in same] == [m.coordinate(d) for d in same] for r in group)
    m = meshes[0]
    assert m.size("experts") == ep and m.size("efsdp") == borrowed // ep
    # the experts' FSDP group x the ep group = the loss group: every process whose tokens differ
    assert m.size("expert_sharding") * m.size("experts") == m.size("loss")
    assert set(m.ranks("experts")) <= set(m.ranks("loss"))


def test_ep_takes_neighbouring_shard_ranks():
    meshes = _ep_meshes({"dp_replicate": 2, "dp_shard": 4}, 2)  # 8 processes
    assert [m.ranks("experts") for m in meshes[:4]] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert meshes[0].ranks("expert_sharding") == (0, 2, 4, 6)  # replicas x efsdp: the same experts
    assert [m.coordinate("ep") for m in meshes] == [0, 1] * 4
    assert [m.coordinate("efsdp") for m in meshes] == [0, 0, 1, 1] * 2
    tp = _ep_meshes({"dp_shard": 2, "tp": 2}, 2)
    assert tp[0].ranks("experts") == (0, 2) and tp[1].ranks("experts") == (1, 3)  # one ep group per tp rank
    assert repr(tp[0]) == "ProcessMesh(dp_shard=2, tp=2, ep=2; rank 0)"


def test_ep_errors_name_the_values_and_the_fix():
    with pytest.raises(ValueError, match=r"ep_size=3.*dp_shard_size=4\).*among \[1, 2, 4\]"):
        ProcessMesh({"dp_shard": 4}, 0, ep=3)
    with pytest.raises(ValueError, match=r"ep_size=2.*does not divide 1.*raise dp_shard_size"):
        ProcessMesh({"dp_replicate": 2, "tp": 2}, 0, ep=2)
    with pytest.raises(ValueError, match=r"ep_size=0"):
        ProcessMesh({"dp_shard": 2}, 0, ep=0)
    # ep alone on a job of 4: the sizes' default is then dp_shard (ep borrows shard ranks), not replicas
    assert resolve_sizes({}, 4, ep=2)["dp_shard"] == 4 and resolve_sizes({}, 4)["dp_replicate"] == 4
