"""What a migrating Accelerate user relies on from prepared loaders, checked without a process
group (rank by rank where it matters): the original loader's order on one process, each rank's
share of that same order, batch_size=None loaders, iterable resume, DataLoaderConfiguration."""

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler, TensorDataset

from anyaccel.data import DataLoaderConfiguration, prepare_data_loader, resolve_dataloader_config

CPU = torch.device("cpu")


def _epochs(loader, n):
    return [[b[0].tolist() for b in loader] for _ in range(n)]


def _make(kind, seed=5):
    ds = TensorDataset(torch.arange(23))
    if kind == "generator":
        return DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(seed))
    if kind == "sampler_generator":
        return DataLoader(ds, batch_size=4, sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(seed)))
    if kind == "two_generators":
        return DataLoader(ds, batch_size=4, sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(seed)),
                          generator=torch.Generator().manual_seed(seed + 1))
    return DataLoader(ds, batch_size=4, shuffle=True)  # no generator: the global RNG, as torch draws it


@pytest.mark.parametrize("kind", ["generator", "sampler_generator", "two_generators", "global"])
def test_one_process_yields_the_original_loaders_batches_epoch_after_epoch(kind):
    torch.manual_seed(0)
    expected = _epochs(_make(kind), 3)
    rng_after_plain = torch.get_rng_state()
    torch.manual_seed(0)
    prepared = prepare_data_loader(_make(kind), CPU, 1, 0)
    assert _epochs(prepared, 3) == expected
    # the global RNG is drawn from exactly as the original loader draws from it
    assert torch.equal(torch.get_rng_state(), rng_after_plain)


def test_reseeding_the_users_generator_after_prepare_takes_effect():
    # Accelerate's training_check does this: prepare, then generator.manual_seed(42), then train
    expected = _epochs(_make("generator", seed=42), 2)
    loader = _make("generator", seed=0)
    prepared = prepare_data_loader(loader, CPU, 1, 0)
    loader.generator.manual_seed(42)
    assert _epochs(prepared, 2) == expected


def test_each_rank_takes_its_share_of_the_original_order():
    original = _epochs(_make("generator"), 2)  # batches of 4 from one process
    shares = [_epochs(prepare_data_loader(_make("generator"), CPU, 2, r), 2) for r in range(2)]
    for epoch in range(2):
        # the original batch k*W + r is rank r's batch k; the short last one is padded with the
        # epoch's first sample (as Accelerate's even_batches does)
        for k in range(len(original[epoch]) // 2):
            assert shares[0][epoch][k] == original[epoch][2 * k]
            short = original[epoch][2 * k + 1]
            assert shares[1][epoch][k][: len(short)] == short
        assert shares[1][epoch][-1] == original[epoch][-1] + original[epoch][0][:1]


def test_seedable_sampler_follows_data_seed():
    config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=42)
    a = _epochs(prepare_data_loader(_make("global"), CPU, 1, 0, config=config), 2)
    b = _epochs(prepare_data_loader(_make("generator", seed=9), CPU, 1, 0, config=config), 2)
    assert a == b and a[0] != a[1]
    order = torch.randperm(23, generator=torch.Generator().manual_seed(42)).tolist()
    assert sum(a[0], []) == order


@pytest.mark.parametrize("world", [1, 2])
def test_batch_sampler_given_as_sampler_with_batch_size_none(world):
    ds = TensorDataset(torch.arange(10))
    user = DataLoader(ds, sampler=BatchSampler(SequentialSampler(ds), 3, False), batch_size=None)
    original = [b[0].tolist() for b in user]
    assert original == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    got = [[b[0].tolist() for b in prepare_data_loader(user, CPU, world, r)] for r in range(world)]
    if world == 1:
        assert got[0] == original
    else:
        assert got[0] == [[0, 1, 2], [6, 7, 8]] and got[1] == [[3, 4, 5], [9]]
    loader = prepare_data_loader(user, CPU, world, 0)
    assert len(loader) == len([b for b in loader]) == (4 if world == 1 else 2)


def test_shuffled_batch_sampler_given_as_sampler_keeps_the_original_order():
    ds = TensorDataset(torch.arange(12))

    def make():
        g = torch.Generator().manual_seed(3)
        return DataLoader(ds, sampler=BatchSampler(RandomSampler(ds, generator=g), 4, False), batch_size=None)

    assert _epochs(prepare_data_loader(make(), CPU, 1, 0), 2) == _epochs(make(), 2)


@pytest.mark.parametrize("kind", ["generator", "global"])
def test_resume_mid_epoch_and_at_an_epoch_boundary_in_the_default_mode(kind):
    torch.manual_seed(1)
    reference = prepare_data_loader(_make(kind), CPU, 1, 0)
    full = _epochs(reference, 3)
    for stop_epoch, stop_batch in [(1, 2), (0, 6)]:  # mid-epoch; after the last batch of epoch 0
        torch.manual_seed(1)
        loader = prepare_data_loader(_make(kind), CPU, 1, 0)
        for epoch in range(stop_epoch + 1):
            for i, _ in enumerate(loader):
                if epoch == stop_epoch and i + 1 == stop_batch:
                    break
        state, rng = loader.state_dict(), torch.get_rng_state()
        torch.manual_seed(123)  # a fresh process: other RNG, other generators
        resumed = prepare_data_loader(_make(kind, seed=77), CPU, 1, 0)
        resumed.load_state_dict(state)
        torch.set_rng_state(rng)  # what load_state restores
        rest = _epochs(resumed, 3 - stop_epoch)
        finished = stop_batch == len(full[stop_epoch])
        if finished:
            assert rest[:2] == full[stop_epoch + 1:]
        else:
            assert rest[0] == full[stop_epoch][stop_batch:] and rest[1:] == full[stop_epoch + 1:]


class _Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


@pytest.mark.parametrize("world", [1, 2])
def test_iterable_loader_resumes_where_its_state_was_taken(world):
    config = DataLoaderConfiguration(dispatch_batches=False)
    for rank in range(world):
        loader = prepare_data_loader(DataLoader(_Stream(20), batch_size=2), CPU, world, rank, config=config)
        full = [b.tolist() for b in loader]
        it = iter(loader)
        seen = [next(it).tolist() for _ in range(3)]
        state = loader.state_dict()
        assert state["position"] == 3 and not state["finished_epoch"]
        fresh = prepare_data_loader(DataLoader(_Stream(20), batch_size=2), CPU, world, rank, config=config)
        fresh.load_state_dict(state)
        assert seen + [b.tolist() for b in fresh] == full
        assert [b.tolist() for b in fresh] == full  # and the pass after it is complete


def test_dataloader_configuration_and_legacy_arguments():
    assert resolve_dataloader_config(None, split_batches=True).split_batches is True
    config = DataLoaderConfiguration(even_batches=False, whole_last_batches=False)
    assert resolve_dataloader_config(config, even_batches=False) is config
    unset = DataLoaderConfiguration(even_batches=False)  # whole_last_batches None: the default given
    assert resolve_dataloader_config(unset, whole_last_batches=True).whole_last_batches is True
    assert resolve_dataloader_config(unset).whole_last_batches is False
    with pytest.raises(ValueError, match=r"even_batches=True\) contradicts dataloader_config.even_batches=False"):
        resolve_dataloader_config(config, even_batches=True)
    with pytest.raises(ValueError, match="use_seedable_sampler=True"):
        DataLoaderConfiguration(data_seed=3)
    # dispatch_batches=True on a map-style loader: rank 0 iterates the user's loader (as Accelerate)
    dispatched = prepare_data_loader(DataLoader(TensorDataset(torch.arange(6)), batch_size=2), CPU, 1, 0,
                                     config=DataLoaderConfiguration(dispatch_batches=True))
    assert [b[0].tolist() for b in dispatched] == [[0, 1], [2, 3], [4, 5]]


def test_accelerator_takes_a_dataloader_config_or_the_older_arguments():
    from anyaccel import Accelerator

    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=False, use_seedable_sampler=True))
    assert acc.even_batches is False and acc.split_batches is False and acc.use_seedable_sampler is True
    assert Accelerator(cpu=True, split_batches=True).dataloader_config.split_batches is True
    with pytest.raises(ValueError, match=r"Accelerator\(split_batches=True\) contradicts"):
        Accelerator(cpu=True, split_batches=True, dataloader_config=DataLoaderConfiguration())
    acc.even_batches = True  # a setter, as Accelerate's (join_uneven_inputs uses it)
    assert acc.dataloader_config.even_batches is True and acc.use_seedable_sampler is True
    acc.dataloader_config = DataLoaderConfiguration(use_stateful_dataloader=True)  # accepted: loaders are stateful
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(6)), batch_size=2))
    assert [b[0].tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]] and "position" in loader.state_dict()


def test_seedable_order_is_accelerates_seedable_random_sampler():
    pytest.importorskip("accelerate")
    from accelerate.data_loader import SeedableRandomSampler

    ds = list(range(13))
    torch.manual_seed(42)
    theirs = SeedableRandomSampler(data_source=ds, num_samples=len(ds))
    expected = [list(theirs) for _ in range(2)]
    torch.manual_seed(42)
    config = DataLoaderConfiguration(use_seedable_sampler=True)
    ours = prepare_data_loader(DataLoader(ds, batch_size=13, shuffle=True), CPU, 1, 0, config=config)
    assert [b.tolist() for _ in range(2) for b in ours] == expected


@pytest.mark.parametrize("replacement, num_samples", [(False, None), (False, 30), (True, 70), (True, 5)])
def test_seedable_loader_shows_accelerates_structure_and_deals_its_samplers_order(replacement, num_samples):
    """Accelerate's users reach into a prepared loader: ``batch_sampler.batch_sampler.sampler`` is
    the SeedableRandomSampler (use_seedable_sampler=True), and iterating it gives the order the
    ranks share, epoch after epoch; with replacement too, drawn as torch's RandomSampler draws."""
    pytest.importorskip("accelerate")
    from accelerate.data_loader import SeedableRandomSampler as Theirs

    from anyaccel.data_loader import SeedableRandomSampler

    ds = list(range(13))
    config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=7)
    source = DataLoader(ds, batch_size=3, sampler=RandomSampler(ds, replacement=replacement, num_samples=num_samples))
    ranks = [prepare_data_loader(source, CPU, 2, r, config=config) for r in range(2)]
    shown = ranks[0].batch_sampler.batch_sampler
    assert isinstance(shown.sampler, SeedableRandomSampler) and (shown.batch_size, shown.drop_last) == (3, False)
    theirs = Theirs(ds, replacement=replacement, num_samples=num_samples, data_seed=7)
    for epoch in range(2):
        batches = [[b.tolist() for b in loader] for loader in ranks]
        dealt = [i for pair in zip(*batches) for batch in pair for i in batch]
        order = list(theirs)
        assert dealt[:len(order)] == order  # the rest: the last round's padding
        assert shown.sampler.epoch == epoch
        assert list(shown.sampler) == order


def test_prepared_loader_shows_the_users_batch_sampler():
    ds = TensorDataset(torch.arange(10))
    source = DataLoader(ds, batch_size=2, shuffle=True)
    prepared = prepare_data_loader(source, CPU, 1, 0)
    assert prepared.batch_sampler.batch_sampler is source.batch_sampler
    assert prepared.batch_sampler.batch_sampler.sampler is source.sampler


@pytest.mark.parametrize("n,num_samples,replacement", [(10, None, False), (10, 25, False), (10, 20, False),
                                                       (7, 70, True), (7, 5, True), (1, None, False)])
def test_random_sampler_fast_path_draws_what_torch_draws(n, num_samples, replacement):
    from anyaccel.data.sampler import UserGenerators

    ds = list(range(n))
    theirs = RandomSampler(ds, replacement=replacement, num_samples=num_samples,
                           generator=torch.Generator().manual_seed(3))
    expected = [list(theirs) for _ in range(2)]
    ours_sampler = RandomSampler(ds, replacement=replacement, num_samples=num_samples,
                                 generator=torch.Generator().manual_seed(3))
    ours = UserGenerators(ours_sampler, None, 1)
    assert [ours.random_order(ours_sampler).tolist() for _ in range(2)] == expected


def _two_epochs(loaders):
    return [[[b.tolist() for b in loader] for _ in range(2)] for loader in loaders]


@pytest.mark.parametrize("n, batch, world, split", [(400, 16, 2, False), (37, 4, 3, False), (5, 4, 2, False),
                                                    (40, 8, 2, False), (30, 8, 2, True), (7, 4, 4, True)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_whole_last_batches_deals_every_rank_what_accelerate_deals(n, batch, world, split, shuffle):
    """DataLoaderConfiguration(whole_last_batches=True): each rank's samples, epoch after epoch,
    are exactly those Accelerate 1.15's own prepare_data_loader gives it (shuffled: with the
    seedable sampler on both sides, the order Accelerate's SeedableRandomSampler draws)."""
    pytest.importorskip("accelerate")
    ds = list(range(n))
    source = DataLoader(ds, batch_size=batch, shuffle=shuffle)
    seedable = dict(use_seedable_sampler=True, data_seed=11) if shuffle else {}
    config = DataLoaderConfiguration(whole_last_batches=True, split_batches=split, **seedable)
    from accelerate.data_loader import prepare_data_loader as accelerates

    ours = _two_epochs(prepare_data_loader(source, CPU, world, r, config=config) for r in range(world))
    theirs = _two_epochs(accelerates(source, CPU, num_processes=world, process_index=r, split_batches=split,
                                     **seedable) for r in range(world))
    assert ours == theirs
    if n == 400:  # the migration guide's example: rank 1's last batch is the epoch's first 16 samples
        assert theirs[1][0][-1] == list(range(16)) if not shuffle else len(theirs[1][0][-1]) == 16
        default = [prepare_data_loader(source, CPU, world, r, config=DataLoaderConfiguration(**seedable))
                   for r in range(world)]
        assert [len(list(loader)[-1]) for loader in default] == [8, 8]  # anyaccel's default: 8 each


def test_whole_last_batches_comes_from_the_launcher_unless_given(monkeypatch):
    from anyaccel import Accelerator

    monkeypatch.setenv("ANYACCEL_WHOLE_LAST_BATCHES", "1")
    assert Accelerator(cpu=True).dataloader_config.whole_last_batches is True
    given = DataLoaderConfiguration(whole_last_batches=False)
    assert Accelerator(cpu=True, dataloader_config=given).dataloader_config.whole_last_batches is False
    monkeypatch.delenv("ANYACCEL_WHOLE_LAST_BATCHES")
    assert Accelerator(cpu=True).dataloader_config.whole_last_batches is False


def test_a_dataloader_config_assigned_later_keeps_the_launchers_whole_last_batches(monkeypatch):
    """Accelerate's test scripts assign ``accelerator.dataloader_config = DataLoaderConfiguration(...)``
    (Accelerate's class has no whole_last_batches): None there is the launcher's value, as at
    construction; a value given in the new configuration wins; loaders prepared afterwards use it."""
    from anyaccel import Accelerator

    monkeypatch.setenv("ANYACCEL_WHOLE_LAST_BATCHES", "1")
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(whole_last_batches=False))
    acc.dataloader_config = DataLoaderConfiguration(even_batches=True)
    assert acc.dataloader_config.whole_last_batches is True
    loader = acc.prepare(DataLoader(list(range(10)), batch_size=4))
    assert loader.batch_sampler.whole_last_batches is True
    acc.even_batches = True  # the properties that replace the configuration keep it
    assert acc.dataloader_config.whole_last_batches is True
    acc.dataloader_config = DataLoaderConfiguration(whole_last_batches=False)
    assert acc.dataloader_config.whole_last_batches is False
    with pytest.raises(TypeError, match="dataloader_config must be a DataLoaderConfiguration; got dict"):
        acc.dataloader_config = {"even_batches": True}
    monkeypatch.delenv("ANYACCEL_WHOLE_LAST_BATCHES")
    plain = Accelerator(cpu=True)
    plain.dataloader_config = DataLoaderConfiguration()
    assert plain.dataloader_config.whole_last_batches is False


class _Items(IterableDataset):
    """0..n-1, as samples (the DataLoader batches them): ints, or (tensor, text, dict) tuples."""

    def __init__(self, n, rich=False):
        self.n, self.rich = n, rich

    def __iter__(self):
        for i in range(self.n):
            yield (torch.tensor([i, -i]), f"s{i}", {"y": torch.tensor(float(i))}) if self.rich else i


def _flat(batch):
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    if isinstance(batch, dict):
        return {k: _flat(v) for k, v in batch.items()}
    return [_flat(v) for v in batch] if isinstance(batch, (list, tuple)) else batch


@pytest.mark.parametrize("n, batch, world, split", [(11, 2, 2, False), (37, 4, 3, False), (5, 4, 2, False),
                                                    (3, 4, 2, False), (16, 4, 2, False), (30, 8, 2, True),
                                                    (7, 4, 4, True), (3, 4, 2, True)])
@pytest.mark.parametrize("rich", [False, True])
def test_whole_last_batches_deals_an_iterable_dataset_as_accelerate_does(n, batch, world, split, rich):
    """An IterableDataset (every rank reading the stream): each rank's batches, epoch after epoch,
    are those Accelerate 1.15's prepare_data_loader gives it (its IterableDatasetShard), padding
    included; gather_for_metrics' bookkeeping counts the real samples once."""
    pytest.importorskip("accelerate")
    from accelerate.data_loader import prepare_data_loader as accelerates

    config = DataLoaderConfiguration(whole_last_batches=True, split_batches=split, dispatch_batches=False)
    ours = [prepare_data_loader(DataLoader(_Items(n, rich), batch_size=batch), CPU, world, r, config=config)
            for r in range(world)]
    theirs = [accelerates(DataLoader(_Items(n, rich), batch_size=batch), CPU, num_processes=world, process_index=r,
                          split_batches=split, dispatch_batches=False) for r in range(world)]
    for _ in range(2):
        got = [[_flat(b) for b in loader] for loader in ours]
        assert got == [[_flat(b) for b in loader] for loader in theirs]
        per = batch // world if split else batch
        assert all(len(b[0] if rich else b) == per for rank in got for b in rank)  # every batch whole
        if n % (batch if split else batch * world):
            assert (ours[0].last_round_real, ours[0].last_round_total) == (
                n % (batch if split else batch * world), batch if split else batch * world)


class _Chunks:
    """A custom batch sampler (not torch's BatchSampler class) with a batch_size."""

    def __init__(self, n, batch_size):
        self.n, self.batch_size, self.drop_last = n, batch_size, False

    def __iter__(self):
        for i in range(0, self.n, self.batch_size):
            yield list(range(i, min(i + self.batch_size, self.n)))

    def __len__(self):
        return -(-self.n // self.batch_size)


@pytest.mark.parametrize("n, batch, world", [(11, 2, 2), (37, 4, 3), (5, 4, 2), (3, 4, 2), (16, 4, 2), (12, 4, 2)])
def test_whole_last_batches_deals_a_custom_batch_sampler_as_accelerate_does(n, batch, world):
    pytest.importorskip("accelerate")
    from accelerate.data_loader import prepare_data_loader as accelerates

    config = DataLoaderConfiguration(whole_last_batches=True)
    ds = list(range(n))
    ours = _two_epochs(prepare_data_loader(DataLoader(ds, batch_sampler=_Chunks(n, batch)), CPU, world, r,
                                           config=config) for r in range(world))
    theirs = _two_epochs(accelerates(DataLoader(ds, batch_sampler=_Chunks(n, batch)), CPU, num_processes=world,
                                     process_index=r) for r in range(world))
    assert ours == theirs
    assert all(len(b) == batch for rank in ours for epoch in rank for b in epoch)
    lengths = [len(prepare_data_loader(DataLoader(ds, batch_sampler=_Chunks(n, batch)), CPU, world, r, config=config))
               for r in range(world)]
    assert lengths == [len(epochs[0]) for epochs in ours]


def test_whole_last_batches_without_a_batch_size_says_why():
    """Nothing to complete: a batch_size=None loader (its sampler's items, or an iterable
    dataset's own batches) is an error naming it, never silently dealt otherwise."""
    config = DataLoaderConfiguration(whole_last_batches=True)
    ds = TensorDataset(torch.arange(10))
    items = DataLoader(ds, sampler=BatchSampler(SequentialSampler(ds), 3, False), batch_size=None)
    with pytest.raises(ValueError, match="batch_size=None loader's sampler items give no batch size to complete"):
        prepare_data_loader(items, CPU, 2, 0, config=config)
    with pytest.raises(ValueError, match="_Stream has batch_size=None"):
        prepare_data_loader(DataLoader(_Stream(10), batch_size=None), CPU, 2, 0, config=config)
    # where nothing is completed (drop_last, even_batches=False) the option asks for nothing
    dropping = DataLoader(ds, sampler=BatchSampler(SequentialSampler(ds), 3, True), batch_size=None)
    assert len(prepare_data_loader(dropping, CPU, 2, 0, config=config)) == 1  # drop_last: the third batch dropped
    uneven = DataLoaderConfiguration(whole_last_batches=True, even_batches=False)
    assert [b[0].tolist() for b in prepare_data_loader(items, CPU, 2, 1, config=uneven)] == [[3, 4, 5], [9]]
