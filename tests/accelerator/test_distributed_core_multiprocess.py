"""Real 2-process runs (gloo) of the core: sharding, collectives, DDP equivalence (the core's job
forked from the suite's warm launcher, tests/scripts/warm_launch.py; exits under torchrun)."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import SCRIPTS, clean_env, torchrun, warm_launch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def core_dir(tmp_path_factory):
    """The folder of the one 2-process job of core_checks.py (its last part: ddp_equivalence.py's training)."""
    out = tmp_path_factory.mktemp("core")
    proc = warm_launch(2, SCRIPTS / "core_checks.py", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


@pytest.fixture(scope="module")
def core(core_dir):
    return [json.loads((core_dir / f"rank{r}.json").read_text()) for r in range(2)]


def test_two_real_ranks_on_cpu(core):
    assert [c["rank"] for c in core] == [0, 1]
    assert all(c["world"] == 2 and c["device"] == "cpu" and c["distributed_type"] == "MULTI_CPU" for c in core)


@pytest.mark.parametrize("n", [37, 40, 5, 1, 9])
def test_gather_for_metrics_counts_each_sample_once(core, n):
    for c in core:
        res = c["gather_for_metrics"][f"{n}-False"]
        assert sorted(res["seen"]) == list(range(n))
    # every rank ran the same number of steps; shares are disjoint apart from the padding
    assert core[0]["gather_for_metrics"][f"{n}-False"]["len"] == core[1]["gather_for_metrics"][f"{n}-False"]["len"]


@pytest.mark.parametrize("n", [37, 40, 9])
def test_gather_for_metrics_with_drop_last(core, n):
    seen = core[0]["gather_for_metrics"][f"{n}-True"]["seen"]
    assert len(seen) == len(set(seen)) == (n // 8) * 8
    mine0 = set(core[0]["gather_for_metrics"][f"{n}-True"]["mine"])
    mine1 = set(core[1]["gather_for_metrics"][f"{n}-True"]["mine"])
    assert not mine0 & mine1, "each process sees a disjoint share"
    assert mine0 | mine1 == set(seen)


def test_object_gather_for_metrics_is_exact(core):
    assert sorted(core[0]["object_metrics"]) == sorted(f"s{i}" for i in range(7))


def test_shape_mismatch_is_a_clear_error_on_every_rank(core):
    for c in core:
        assert "rank 0: (2, 3) float32" in c["mismatch"] and "rank 1: (3, 3) float32" in c["mismatch"]
        assert "rank 1: (2,) float32, (2,) float32" in c["mismatch_reduce"]
        assert c["after_mismatch"] == [0, 1]


def test_nested_collectives(core):
    c = core[1]
    assert c["nested_gather"] == {"a": [0, 0, 1, 1], "b0": [0.0, 1.0], "b1": [[0.0] * 3, [1.0] * 3]}
    assert c["int16_gather"] == [0, 0, 1, -1] and c["int16_dtype"] == "torch.int16"  # gloo lacks int16
    assert c["reduce_sum"] == [2.0, 1.0]
    assert c["reduce_mean_int"] == [2.0, 2.0]
    assert core[0]["broadcast"] == core[1]["broadcast"] == [11.0]
    assert core[0]["pad"] == [[1.0, 1.0], [-1.0, -1.0]] and core[1]["pad"] == [[1.0, 1.0], [1.0, 1.0]]
    assert core[0]["pad_first"] == [[0.0, 1.0], [0.0, 1.0]]
    assert c["gather_object"] == ["r0", "r1"]
    assert c["gather_object_dict"] == [{"rank": 0}, {"rank": 1}]
    assert core[0]["split"] == [0, 1, 2] and core[1]["split"] == [3, 4]
    assert core[0]["split_padded"] == [0, 1, 2] and core[1]["split_padded"] == [3, 4, 4]


def test_main_process_first_and_save(core):
    assert all(c["marker_seen"] for c in core)
    assert all(c["saved"] == [1.0, 1.0] and c["leftover_tmp"] == [] for c in core)


def test_mid_epoch_evaluation_keeps_training_state(core):
    for c in core:
        assert sorted(c["eval_mid_epoch"]) == list(range(6))
        assert c["train_end_flags"] == [False, True]


def test_second_accelerator_and_prepare_errors(core):
    for c in core:
        assert c["second"] == [c["rank"], 2, "cpu"]
        assert "builtins.object" in c["prepare_object"] and "DataLoader" in c["prepare_object"]
        assert c["trigger"] is True


def test_fused_gather_matches_a_plain_gather_for_every_dtype(core):
    for c in core:
        assert all(c["fused_gather"].values()), c["fused_gather"]
        assert all(c["fused_gather_equal"].values())


def test_small_gathers_share_the_header_collective_with_the_same_results(core):
    """gather_for_metrics' every batch but the first costs one collective, not two (header, then
    data): the data rides in the header's buffer once the group has seen its size."""
    for c in core:
        got = c["carried_gather"]
        assert got["same"]
        # first call: header, then data; later: one, except a call that needs more room than the
        # last one (5 rows after 3) which sends its data separately once more; a small gather() of
        # another layout fits in the same room
        assert got["collectives"] == [2, 1, 1, 1, 2, 1, 1, 1, 1, 1], got["collectives"]
        assert "rank 0: gather()" in got["mismatch"] and "rank 1: barrier()" in got["mismatch"], got["mismatch"]


def test_the_inline_region_grows_to_what_gathers_need_and_goes_back_to_zero_when_unused():
    """The rules every rank applies to the same headers (local, so tested directly): grow to a
    gather's need up to the limit, keep the size while gathers use a quarter of it, drop to zero
    after 256 headers that did not."""
    from anyaccel.backends.transport import _Inline

    region = _Inline(world=2)
    region.update(3072)
    assert region.size == 3072
    region.update(1024)  # a smaller last batch: kept, the next epoch's batches still fit
    assert region.size == 3072
    region.update(_Inline.limit(2) + 16)  # too large to share the header's collective: unchanged
    assert region.size == 3072
    for _ in range(_Inline.IDLE_RESET - 1):
        region.update(0)  # barriers, reductions
    assert region.size == 3072
    region.update(0)
    assert region.size == 0
    assert _Inline.limit(2) == 64 << 10 and _Inline.limit(1024) == 1 << 10


def test_ranks_in_different_collectives_get_an_error_naming_each(core):
    for c in core:
        assert "rank 0: gather()" in c["op_mismatch"] and "rank 1: reduce()" in c["op_mismatch"], c["op_mismatch"]
        assert c["after_op_mismatch"] == [2.0]  # the group keeps working


def test_pad_across_processes_checks_the_other_dimensions(core):
    for c in core:
        assert "pad_across_processes()" in c["pad_mismatch"] and "(2, 2)" in c["pad_mismatch"], c["pad_mismatch"]
        assert "(2, 3)" in c["pad_mismatch"]
        assert c["reduce_max_min"] == [[1.0], [0.0]]


def test_even_batches_false_leaves_the_last_batches_uneven(core):
    # As Accelerate: 3 samples, batch 1, 2 processes -> rank 0 [[0], [2]], rank 1 [[1]].
    assert core[0]["uneven_batches"] == [[0], [2]] and core[1]["uneven_batches"] == [[1]]
    assert core[0]["uneven_len"] == [2, 2] and core[1]["uneven_len"] == [1, 2]
    for c in core:  # 7 samples, batch 2: the last batches have 2 and 1 samples; each sample counted once
        assert sorted(c["uneven_gather_for_metrics"]) == list(range(7))


def test_save_state_with_a_directory_per_rank_writes_a_whole_checkpoint_in_each(core):
    """As Accelerate allows under DDP: each rank names its own directory; each gets the model, the
    loader positions and that rank's RNG state, and loads back from it."""
    for r, c in enumerate(core):
        assert isinstance(c["save_dirs"], dict), c["save_dirs"]
        files = c["save_dirs"]["files"]
        assert "model.safetensors" in files and f"random_states_{r}.pkl" in files, files
        assert f"random_states_{1 - r}.pkl" not in files
        assert c["save_dirs"]["restored"] is True


def test_a_directory_per_process_must_hold_one_checkpoint_and_two_paths_to_one_directory_write_it_once(core):
    """Each rank saved to a_<r> after step 1 and b_<r> after step 3. Rank 0 loading a_0 while rank
    1 loads b_1 is an error on both naming each directory (before: no error, the replicas
    diverged and rank 0 hung in DDP's backward); a_<r> on each loads, the replicas agree. A
    symlinked spelling of rank 0's directory writes it once (both RNG states in it, no writer
    stamp left); two spellings that do not resolve alike (another machine's mount) fail clearly,
    leaving nothing behind."""
    for r, c in enumerate(core):
        checks = c["own_directories"]
        mixed = checks["mixed"]
        assert mixed.startswith("CheckpointError: load_state() with a directory per process: the directories hold "
                                "different checkpoints"), mixed
        assert "a_0" in mixed and "b_1" in mixed and "save_state call" in mixed and "dataloader.json epoch 0" in mixed, mixed
        assert checks["own"] == "ok" and checks["own_weights"][0] == checks["own_weights"][1]
        assert checks["symlink_save"] == "ok" and checks["symlink_load"] == "ok"
        alias = checks["alias_save"]
        assert alias.startswith("CheckpointError: save_state(") and \
            "write the same directory through different paths" in alias, alias
    assert core[0]["own_directories"]["mixed"] == core[1]["own_directories"]["mixed"]
    files = core[0]["own_directories"]["symlink_files"]
    assert "random_states_0.pkl" in files and "random_states_1.pkl" in files and "model.safetensors" in files
    assert not [f for f in files if "writer" in f], files
    assert core[0]["own_directories"]["alias_left"] == ["ck"]  # no ck2, no temporary directory


def test_two_processes_equal_one_process_with_double_batch(core_dir, tmp_path):
    # the 2-process side ran last in the core job (core_checks.py: ddp_equivalence.main(OUT/two.pt, 4))
    single = subprocess.run([sys.executable, str(SCRIPTS / "ddp_equivalence.py"), tmp_path / "one.pt", "8"],
                            capture_output=True, text=True, env=clean_env(), timeout=120)
    assert single.returncode == 0, single.stderr
    two, one = torch.load(core_dir / "two.pt"), torch.load(tmp_path / "one.pt")
    assert two.keys() == one.keys()
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-5)


def test_exit_without_teardown_never_aborts():
    # gloo used to SIGABRT at interpreter exit in ~3 of 8 runs without destroy_process_group.
    for _ in range(4):
        proc = torchrun(SCRIPTS / "exit_without_teardown.py", check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.count("2.0") == 2  # both ranks finished (their lines may interleave)
