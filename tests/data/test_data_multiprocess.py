"""Accelerate-compatible data loading and scheduling with 2 real processes (`anyaccel launch
--num_processes 2 --cpu`, gloo): dispatch_batches, iterable resume and split, batch_size=None
loaders, the user's generator order shared by the ranks, the scheduler's steps, and the
pad_across_processes shape check."""


import pytest

from conftest import launch_checks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    return launch_checks("data_checks.py", out)


def test_dispatch_batches_rank0_reads_and_the_others_receive(ranks):
    assert ranks[0]["dispatch_batches"] == [[0, 1], [4, 5], [8, 9]]
    assert ranks[1]["dispatch_batches"] == [[2, 3], [6, 7], [10]]
    assert ranks[0]["dispatch_reads"] == 11 and ranks[1]["dispatch_reads"] == 0
    for r in ranks:  # each sample counted once
        assert r["dispatch_gather_for_metrics"] == list(range(11))
        assert r["every_rank_batches"] == r["dispatch_batches"] and r["every_rank_reads"] == 11


def test_whole_last_batches_pads_a_dispatched_stream_to_whole_batches(ranks):
    """dispatch_batches (the iterable default) with whole_last_batches=True: the last round of 11
    samples in batches of 2 on 2 ranks is [8, 9] and [10, 0] (Accelerate's IterableDatasetShard),
    the same as when every rank reads the stream; gather_for_metrics counts each sample once."""
    assert ranks[0]["dispatch_whole"] == [[0, 1], [4, 5], [8, 9]]
    assert ranks[1]["dispatch_whole"] == [[2, 3], [6, 7], [10, 0]]
    assert ranks[0]["dispatch_whole_reads"] == 11 and ranks[1]["dispatch_whole_reads"] == 0
    for r in ranks:
        assert r["every_rank_whole"] == r["dispatch_whole"]
        assert r["dispatch_whole_gathered"] == list(range(11))


def test_iterable_loader_resumes_at_its_saved_position(ranks):
    for r in ranks:
        res = r["iterable_resume"]
        assert res["state_position"] == 2
        assert res["first"] + res["rest"] == res["full"]  # continues, then the next pass is whole
        assert len(res["full"]) == 5


def test_split_batches_splits_each_stream_batch(ranks):
    assert ranks[0]["iterable_split"] == [[0, 1], [4, 5]] and ranks[1]["iterable_split"] == [[2, 3], [6, 7]]


def test_batch_sampler_passed_as_sampler_with_batch_size_none(ranks):
    assert ranks[0]["batch_sampler_as_sampler"] == [[0, 1, 2], [6, 7, 8]]
    assert ranks[1]["batch_sampler_as_sampler"] == [[3, 4, 5], [9]]


def test_each_rank_takes_its_share_of_the_users_generator_order(ranks):
    original = ranks[0]["original_order"]
    assert original[0] != original[1]  # the generator moves on between epochs
    for epoch in range(2):
        for r, res in enumerate(ranks):
            assert res["prepared_order"][epoch] == original[epoch][r::2]


def test_scheduler_follows_the_single_process_schedule(ranks):
    for r in ranks:
        assert r["sched_default"] == 6  # 3 optimizer steps x 2 processes, as Accelerate
        assert r["sched_split_batches"] == 3 and r["sched_per_optimizer_step"] == 3
        assert r["onecycle_steps"] == 5  # never past OneCycleLR's total_steps


def test_pad_across_processes_checks_dimensions_on_every_rank(ranks):
    for r in ranks:
        assert "rank 0: (2, 3) float32; rank 1: (2, 3, 1) float32" in r["pad_ndim"], r["pad_ndim"]
        assert "rank 0: (1, 3) float32; rank 1: (2, 4) float32" in r["pad_other_dim"], r["pad_other_dim"]
        assert r["pad_ok"] == 2
