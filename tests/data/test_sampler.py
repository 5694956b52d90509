"""Sharding logic of prepared data loaders, rank by rank, without a process group."""

import itertools

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler, TensorDataset

from anyaccel.data import DataLoaderConfiguration, PreparedDataLoader, ShardedBatchSampler, prepare_data_loader


def shards(n, world, batch, shuffle=True, drop_last=False, seed=123, epoch=0):
    ds = list(range(n))
    base = RandomSampler(ds) if shuffle else SequentialSampler(ds)
    out = []
    for r in range(world):
        s = ShardedBatchSampler(base, batch, drop_last, world, r, seed)
        s.set_epoch(epoch)
        out.append((list(s), s.last_round_real, s.last_round_total, len(s)))
    return out


@pytest.mark.parametrize("n,world,batch", [(37, 2, 4), (40, 2, 4), (5, 4, 2), (1, 2, 3), (101, 3, 7)])
def test_every_sample_once_after_removing_padding(n, world, batch):
    per_rank = shards(n, world, batch)
    counts = {len(batches) for batches, *_ in per_rank}
    assert len(counts) == 1, "every rank must run the same number of steps"
    for batches, _, _, length in per_rank:
        assert len(batches) == length
    # rebuild what a gather returns batch by batch: rank-ordered concatenation
    seen = []
    steps = counts.pop()
    for step in range(steps):
        gathered = list(itertools.chain.from_iterable(b[step] for b, *_ in per_rank))
        if step == steps - 1 and per_rank[0][2]:
            assert len(gathered) == per_rank[0][2]
            gathered = gathered[: per_rank[0][1]]
        seen += gathered
    assert sorted(seen) == list(range(n))


def test_shares_are_disjoint_and_rounds_are_contiguous():
    (a, *_), (b, *_) = shards(40, 2, 4)
    assert not set(sum(a, [])) & set(sum(b, []))
    one_process = shards(40, 1, 8)[0][0]
    assert [x + y for x, y in zip(a, b)] == one_process, "2 × batch b must equal 1 × batch 2b"


def test_same_permutation_on_every_rank_and_new_one_each_epoch():
    e0 = shards(64, 2, 4, epoch=0)
    e1 = shards(64, 2, 4, epoch=1)
    order0 = [x for step in zip(e0[0][0], e0[1][0]) for b in step for x in b]
    order1 = [x for step in zip(e1[0][0], e1[1][0]) for b in step for x in b]
    assert sorted(order0) == sorted(order1) == list(range(64))
    assert order0 != order1
    assert shards(64, 2, 4, epoch=1) == e1, "same seed and epoch → same order"


def test_drop_last_drops_the_incomplete_round_only():
    per_rank = shards(37, 2, 4, drop_last=True)
    for batches, real, total, length in per_rank:
        assert length == len(batches) == 4 and all(len(b) == 4 for b in batches)
        assert (real, total) == (0, 0)
    seen = sum((sum(b, []) for b, *_ in per_rank), [])
    assert len(seen) == len(set(seen)) == 32


def test_custom_batch_sampler_is_sharded_by_whole_batches():
    ds = list(range(10))
    user = BatchSampler(SequentialSampler(ds), 3, False)

    class MyBatches(BatchSampler):  # a user subclass is kept as is
        pass

    user = MyBatches(SequentialSampler(ds), 3, False)
    r0 = ShardedBatchSampler(user, 3, False, 2, 0, 0, batches_given=True)
    r1 = ShardedBatchSampler(user, 3, False, 2, 1, 0, batches_given=True)
    assert list(r0) == [[0, 1, 2], [6, 7, 8]]
    assert list(r1) == [[3, 4, 5], [9]]
    assert len(r0) == len(r1) == 2


def test_prepared_loader_single_process_behaves_like_the_original():
    ds = TensorDataset(torch.arange(10).float(), torch.arange(10))
    loader = prepare_data_loader(DataLoader(ds, batch_size=4, shuffle=False), torch.device("cpu"), 1, 0)
    assert isinstance(loader, PreparedDataLoader)
    batches = [y.tolist() for _, y in loader]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert len(loader) == 3 and loader.batch_size == 4 and loader.dataset is ds


@pytest.mark.parametrize("seedable", [False, True])
def test_loader_reshuffles_each_epoch_without_set_epoch(seedable):
    ds = TensorDataset(torch.arange(32))
    config = DataLoaderConfiguration(use_seedable_sampler=seedable)
    loader = prepare_data_loader(DataLoader(ds, batch_size=8, shuffle=True), torch.device("cpu"), 1, 0, config=config)
    first = torch.cat([b for (b,) in loader]).tolist()
    second = torch.cat([b for (b,) in loader]).tolist()
    assert sorted(first) == sorted(second) == list(range(32))
    assert first != second
    if seedable:  # the order is a function of (seed, epoch): set_epoch replays an epoch
        loader.set_epoch(0)
        assert torch.cat([b for (b,) in loader]).tolist() == first


def test_split_batches_divides_the_global_batch():
    ds = TensorDataset(torch.arange(16))
    loader = prepare_data_loader(DataLoader(ds, batch_size=8), torch.device("cpu"), 2, 1, split_batches=True)
    assert loader.batch_size == 4
    assert [b.tolist() for (b,) in loader] == [[4, 5, 6, 7], [12, 13, 14, 15]]
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        prepare_data_loader(DataLoader(ds, batch_size=5), torch.device("cpu"), 2, 0, split_batches=True)


def test_iterable_dataset_is_sharded_by_batches():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(11))

    got = []
    every_rank_reads = DataLoaderConfiguration(dispatch_batches=False)  # no process group here to dispatch
    for r in range(2):
        loader = prepare_data_loader(DataLoader(Stream(), batch_size=2), torch.device("cpu"), 2, r,
                                     config=every_rank_reads)
        got.append(([b.tolist() for b in loader], loader.last_round_real, loader.last_round_total,
                    loader.end_of_dataloader))
    assert got[0][0] == [[0, 1], [4, 5], [8, 9]]
    assert got[1][0] == [[2, 3], [6, 7], [10]]
    assert got[0][3] and got[1][3]
    assert got[0][1:3] == (0, 0)  # final round [8, 9] + [10] is complete: nothing padded

    class Five(torch.utils.data.IterableDataset):  # 5 batches for 2 ranks: last round padded
        def __iter__(self):
            return iter(range(9))

    r1 = prepare_data_loader(DataLoader(Five(), batch_size=2), torch.device("cpu"), 2, 1, config=every_rank_reads)
    assert [b.tolist() for b in r1] == [[2, 3], [6, 7], [0, 1]]
    assert (r1.last_round_real, r1.last_round_total) == (1, 3)


def _reference_plan(order, world, rank, batch, drop_last, even):
    """The epoch's batches of ``rank``, written the plain way (lists, one slice per batch)."""
    per_round = world * batch
    full = len(order) // per_round
    mine = [order[k * per_round + rank * batch : k * per_round + (rank + 1) * batch] for k in range(full)]
    tail = order[full * per_round :]
    if tail and not drop_last:
        if even:
            per = -(-len(tail) // world)
            ring = tail + [order[i % len(order)] for i in range(per * world - len(tail))]
            mine.append(ring[rank * per : (rank + 1) * per])
        elif tail[rank * batch : (rank + 1) * batch]:
            mine.append(tail[rank * batch : (rank + 1) * batch])
    return mine


@pytest.mark.parametrize("n,world,batch", [(37, 2, 4), (40, 2, 4), (5, 4, 2), (1, 2, 3), (101, 3, 7), (3, 2, 1),
                                           (2, 4, 1), (64, 1, 8)])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("shuffle", [True, False])
def test_tensor_view_plan_equals_the_plain_plan(n, world, batch, drop_last, even, shuffle):
    ds = list(range(n))
    base = RandomSampler(ds) if shuffle else SequentialSampler(ds)
    for rank in range(world):
        s = ShardedBatchSampler(base, batch, drop_last, world, rank, seed=7, even_batches=even)
        s.set_epoch(3)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(7 + 3)).tolist() if shuffle else ds
        expected = _reference_plan(order, world, rank, batch, drop_last, even)
        assert list(s) == expected
        assert len(s) == len(expected)


def test_a_sampler_with_its_own_order_keeps_it():
    class Reversed(torch.utils.data.Sampler):
        def __init__(self, n):
            self.n = n

        def __iter__(self):
            return iter(range(self.n - 1, -1, -1))

        def __len__(self):
            return self.n

    s = ShardedBatchSampler(Reversed(7), 2, False, 2, 1, seed=0)
    assert list(s) == [[4, 3], [0, 6]]  # round 6 5 | 4 3, then 2 1 0 split 2 + 2 with 6 as padding
    assert (s.last_round_real, s.last_round_total) == (3, 4)


def test_random_sampler_with_more_samples_than_the_dataset_uses_whole_permutations():
    s = ShardedBatchSampler(RandomSampler(list(range(5)), num_samples=12), 4, False, 1, 0, seed=1)
    flat = sum(list(s), [])
    assert len(flat) == 12 and sorted(flat[:5]) == sorted(flat[5:10]) == list(range(5))
