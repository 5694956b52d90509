"""save_state / load_state, exact resume, atomic writes under SIGKILL, save_model, automatic naming."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import SCRIPTS
sys.path.insert(0, str(SCRIPTS))
import train_common as tc  # noqa: E402

from anyaccel import Accelerator, ProjectConfiguration  # noqa: E402
from anyaccel.checkpoint import MANIFEST, CheckpointError, parse_size  # noqa: E402


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _setup(seed, **acc_kwargs):
    acc = Accelerator(**acc_kwargs)
    model, opt, loader, sched = tc.build(acc, seed=seed, n=60, batch_size=3)
    progress = tc.Progress()
    acc.register_for_checkpointing(progress)
    return acc, model, opt, loader, sched, progress


def _train(acc, model, opt, loader, sched, progress, epochs, save_at=None, ckpt=None):
    while progress.epoch < epochs:
        for batch in loader:
            tc.train_step(acc, model, opt, sched, batch)
            progress.step += 1
            if progress.step == save_at:
                acc.save_state(ckpt)
        progress.epoch += 1


# ------------------------------------------------------------------------------------------
# exact resume, one process (fast) and two processes (torchrun)
# ------------------------------------------------------------------------------------------


def _train_from(acc, model, opt, loader, sched, progress, epochs, skip):
    """The loop of a script that resumed with ``load_state`` and skips the batches already done
    itself: transformers' ``*_no_trainer.py`` (``skip="skip_first_batches"``: starting_epoch and
    resume_step from the step, ``accelerator.skip_first_batches`` for that epoch only) or
    diffusers' ``train_*.py`` (``skip="continue"``: every batch of the resumed epoch is read, the
    first ``resume_step`` are passed over)."""
    starting_epoch, resume_step = divmod(progress.step, len(loader))
    for epoch in range(starting_epoch, epochs):
        active = loader
        if epoch == starting_epoch and skip == "skip_first_batches":
            active = acc.skip_first_batches(loader, resume_step)
        for step, batch in enumerate(active):
            if epoch == starting_epoch and skip == "continue" and step < resume_step:
                continue
            tc.train_step(acc, model, opt, sched, batch)
            progress.step += 1
        progress.epoch = epoch + 1


def _assert_resumed_bitwise(resumed, full, precision="no"):
    acc, model, opt, loader, sched, progress = resumed
    assert _same(tc.weights(acc, model), tc.weights(full[0], full[1]))
    assert sched.get_last_lr() == full[4].get_last_lr() and progress.step == full[5].step
    assert opt.state_dict()["state"][0]["step"] == full[2].state_dict()["state"][0]["step"]
    assert torch.equal(torch.rand(4), full[6])  # the RNG went on as in the uninterrupted run
    if precision == "fp16":
        assert acc.scaler.get_scale() == full[0].scaler.get_scale()


def _uninterrupted(ckpt, **acc_kwargs):
    full = _setup(0, **acc_kwargs)
    _train(*full, epochs=3, save_at=26, ckpt=ckpt)  # 20 batches per epoch: step 26 is mid epoch 1
    return (*full, torch.rand(4))


@pytest.mark.parametrize("precision,accum", [("no", 1), ("fp16", 2), ("bf16", 1)])
def test_load_state_then_skip_first_batches_resumes_mid_epoch_bitwise(tmp_path, precision, accum):
    """transformers' no_trainer shape: load_state restores the epoch, its shuffle and the RNG but
    not the loader's position (Accelerate's rule), so the script's own skip_first_batches skips
    the batches once, and the run ends bitwise where the uninterrupted one did."""
    ckpt = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16-on-CPU warning
        full = _uninterrupted(ckpt, mixed_precision=precision, gradient_accumulation_steps=accum)
        resumed = _setup(5, mixed_precision=precision, gradient_accumulation_steps=accum)
    acc, model, opt, loader, sched, progress = resumed
    assert not _same(tc.weights(acc, model), tc.weights(full[0], full[1]))
    acc.load_state(ckpt)
    assert (progress.epoch, progress.step, loader.epoch) == (1, 26, 1)
    assert loader.state_dict()["position"] == 0  # the saved epoch runs again from its start...
    _train_from(*resumed, epochs=3, skip="skip_first_batches")  # ...and the script skips 6 batches of it
    _assert_resumed_bitwise(resumed, full, precision)


@pytest.mark.parametrize("how", ["continue", "resume", "use_stateful_dataloader"])
def test_every_way_to_resume_mid_epoch_is_bitwise(tmp_path, how):
    """diffusers' ``continue`` loop after load_state; anyaccel's one-call ``resume()``, which
    restores the loader's position itself; and ``use_stateful_dataloader=True``, with which
    load_state does too. Each skips the 6 batches done exactly once."""
    from anyaccel.data import DataLoaderConfiguration

    ckpt = tmp_path / "ckpt"
    full = _uninterrupted(ckpt)
    stateful = how == "use_stateful_dataloader"
    resumed = _setup(5, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful))
    acc, model, opt, loader, sched, progress = resumed
    if how == "resume":
        assert acc.resume(ckpt) == (1, 26, str(ckpt))
    else:
        acc.load_state(ckpt)
    assert loader.state_dict()["position"] == (0 if how == "continue" else 6)
    if how == "continue":
        _train_from(*resumed, epochs=3, skip="continue")
    else:
        _train(*resumed, epochs=3)  # the loader continues mid-epoch: the script skips nothing
    _assert_resumed_bitwise(resumed, full)


def test_checkpoint_layout_and_weights_only_loading(tmp_path):
    acc, model, opt, loader, sched, progress = _setup(0, mixed_precision="bf16")
    _train(acc, model, opt, loader, sched, progress, epochs=1)
    acc.save_state(tmp_path / "c")
    names = sorted(os.listdir(tmp_path / "c"))
    assert names == sorted([MANIFEST, "model.safetensors", "optimizer.bin", "scheduler.bin", "dataloader.json",
                            "custom_checkpoint_0.pkl", "random_states_0.pkl"])
    assert sorted(os.listdir(tmp_path)) == ["c"]  # no temporary siblings left behind
    manifest = json.loads((tmp_path / "c" / MANIFEST).read_text())
    assert manifest["world_size"] == 1 and manifest["models"] == 1 and manifest["mixed_precision"] == "bf16"
    for name in ("optimizer.bin", "scheduler.bin", "custom_checkpoint_0.pkl", "random_states_0.pkl"):
        torch.load(tmp_path / "c" / name, weights_only=True)  # no pickled code anywhere
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _setup(1)[0].load_state(tmp_path / "c")  # loads without any weights_only fallback warning


def test_tied_weights_and_non_tensor_state(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.out = torch.nn.Linear(4, 10, bias=False)
            self.out.weight = self.emb.weight

        def get_extra_state(self):
            return {"vocab": ["a", "b"]}

        def set_extra_state(self, state):
            self.loaded_extra = state

    acc = Accelerator()
    torch.manual_seed(0)
    model = acc.prepare(Tied())
    acc.save_state(tmp_path / "c")
    acc2 = Accelerator()
    torch.manual_seed(1)
    model2 = acc2.prepare(Tied())
    acc2.load_state(tmp_path / "c")
    assert torch.equal(model2.emb.weight, model.emb.weight)
    assert model2.out.weight is model2.emb.weight  # still tied
    assert model2.loaded_extra == {"vocab": ["a", "b"]}


# ------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------


def test_missing_directory_names_the_path(tmp_path):
    acc = _setup(0)[0]
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        acc.load_state(tmp_path / "nope")


def test_incomplete_or_damaged_checkpoints_say_what_is_missing(tmp_path):
    acc = _setup(0)[0]
    acc.save_state(tmp_path / "c")
    (tmp_path / "c" / "optimizer.bin").unlink()
    with pytest.raises(CheckpointError, match=r"c is damaged: optimizer.bin is missing"):
        _setup(1)[0].load_state(tmp_path / "c")

    acc.save_state(tmp_path / "d")
    data = (tmp_path / "d" / "model.safetensors").read_bytes()
    (tmp_path / "d" / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors has \d+ bytes, the manifest says \d+"):
        _setup(1)[0].load_state(tmp_path / "d")

    acc.save_state(tmp_path / "e")
    (tmp_path / "e" / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'e'} is not a complete anyaccel checkpoint: {MANIFEST}"):
        _setup(1)[0].load_state(tmp_path / "e")


def test_mismatched_objects_are_reported(tmp_path):
    acc = _setup(0)[0]
    acc.save_state(tmp_path / "c")
    other = Accelerator()
    other.prepare(torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match="optimizers: checkpoint has 1, this Accelerator has 0"):
        other.load_state(tmp_path / "c")


def test_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious.txt").write_text("x")
    acc = _setup(0)[0]
    with pytest.raises(CheckpointError, match="not an anyaccel checkpoint"):
        acc.save_state(tmp_path / "data")
    assert (tmp_path / "data" / "precious.txt").read_text() == "x"
    assert sorted(os.listdir(tmp_path)) == ["data"]
    (tmp_path / "empty").mkdir()
    acc.save_state(tmp_path / "empty")  # an empty directory is fine


def test_files_added_next_to_a_checkpoint_survive_the_next_save(tmp_path):
    acc = _setup(0)[0]
    acc.save_state(tmp_path / "c")
    (tmp_path / "c" / "tokenizer.json").write_text("{}")
    acc.save_state(tmp_path / "c")
    assert (tmp_path / "c" / "tokenizer.json").read_text() == "{}"


# ------------------------------------------------------------------------------------------
# SIGKILL during save_state
# ------------------------------------------------------------------------------------------


def _load_after_kill(out, ckpt):
    acc, model, opt, loader, sched, progress = _setup(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc.load_state(ckpt)
    weights = tc.weights(acc, model)
    which = "A" if _same(weights, torch.load(out / "a.pt")) else "B" if _same(weights, torch.load(out / "b.pt")) else "?"
    assert progress.step == {"A": 5, "B": 10, "?": -1}[which]  # registered state matches the weights
    # the next save into the same directory works and tidies up what the killed one left
    acc.save_state(ckpt)
    assert sorted(os.listdir(out)) == ["a.pt", "b.pt", "ckpt"]
    return which


@pytest.mark.parametrize("point,expected", [
    ("write:1", "A"),    # random_states file half written
    ("write:2", "A"),    # model.safetensors half written
    ("manifest", "A"),   # manifest half written
    ("rename:1", "A"),   # new checkpoint complete, nothing renamed yet
    ("rename:2", "A"),   # previous moved aside, new not yet in place
    ("cleanup", "B"),    # new in place, previous not yet deleted
])
def test_sigkill_during_save_state_leaves_a_loadable_checkpoint(tmp_path, point, expected):
    ckpt = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "train_kill_save.py"), str(tmp_path), str(ckpt), point],
                          capture_output=True, text=True, timeout=120, env=tc.child_env())
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert _load_after_kill(tmp_path, ckpt) == expected


# ------------------------------------------------------------------------------------------
# automatic naming, skip_first_batches
# ------------------------------------------------------------------------------------------


def test_automatic_naming_with_retention_and_load_latest(tmp_path):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(project_config=config)
    model = acc.prepare(torch.nn.Linear(2, 2))
    saved = []
    for i in range(4):
        with torch.no_grad():
            model.weight.fill_(i)
        saved.append(acc.save_state())
    assert [os.path.basename(p) for p in saved] == ["checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3"]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_2", "checkpoint_3"]

    fresh_config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    acc2 = Accelerator(project_config=fresh_config)
    model2 = acc2.prepare(torch.nn.Linear(2, 2))
    assert acc2.load_state().endswith("checkpoint_3")
    assert torch.all(model2.weight == 3)
    assert os.path.basename(acc2.save_state()) == "checkpoint_4"  # numbering continues, no clash

    with pytest.raises(ValueError, match="needs output_dir"):
        Accelerator().save_state()


def test_skip_first_batches_then_later_epochs_are_complete():
    from anyaccel.data import DataLoaderConfiguration

    seedable = DataLoaderConfiguration(use_seedable_sampler=True)  # set_epoch(0) in a fresh loader replays epoch 0
    acc = Accelerator(dataloader_config=seedable)
    loader = acc.prepare(torch.utils.data.DataLoader(list(range(12)), batch_size=3, shuffle=True))
    epoch0 = [b.tolist() for b in loader]
    epoch1 = [b.tolist() for b in loader]
    fresh = Accelerator(dataloader_config=seedable)
    torch.manual_seed(0)
    loader2 = fresh.prepare(torch.utils.data.DataLoader(list(range(12)), batch_size=3, shuffle=True))
    loader2.load_state_dict(loader.state_dict())  # same seed; at the end of epoch 1
    loader2.set_epoch(0)
    acc.skip_first_batches(loader2, 2)
    assert [b.tolist() for b in loader2] == epoch0[2:]
    assert [b.tolist() for b in loader2] == epoch1  # the next epoch is whole and is epoch 1


# ------------------------------------------------------------------------------------------
# save_model
# ------------------------------------------------------------------------------------------


def test_save_model_shards_with_an_index_and_round_trips(tmp_path):
    from safetensors.torch import load_file

    acc = Accelerator()
    torch.manual_seed(0)
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 100)))
    acc.save_model(model, tmp_path / "m", max_shard_size="50KB")  # each weight is 40 KB
    files = sorted(os.listdir(tmp_path / "m"))
    assert "model.safetensors.index.json" in files and "model-00001-of-00002.safetensors" in files
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in model.parameters())
    loaded = {}
    for name in set(index["weight_map"].values()):
        loaded.update(load_file(tmp_path / "m" / name))
    assert _same(loaded, dict(model.state_dict()))

    acc.save_model(model, tmp_path / "m")  # one file now: the shards and the index are removed
    assert sorted(os.listdir(tmp_path / "m")) == ["model.safetensors"]
    assert _same(load_file(tmp_path / "m" / "model.safetensors"), dict(model.state_dict()))


def test_parse_size():
    assert parse_size("10GB") == 10**10 and parse_size("2MiB") == 2 * 2**20 and parse_size(123) == 123
    with pytest.raises(ValueError, match="max_shard_size='ten'"):
        parse_size("ten")


def test_loader_position_saved_with_two_processes_converts_to_one():
    acc = Accelerator()
    loader = acc.prepare(torch.utils.data.DataLoader(list(range(24)), batch_size=3, shuffle=True))
    initial, rng = loader.state_dict(), torch.get_rng_state()  # before epoch 0 (the order's seed is drawn from it)
    order = [i for b in loader for i in b.tolist()]  # epoch 0, one process
    state = dict(initial, epoch=0, position=2, finished_epoch=False, num_replicas=2, batch_size=3)
    loader.load_state_dict(state)  # 2 processes x 2 batches x 3 = 12 samples of epoch 0 were consumed
    torch.set_rng_state(rng)
    assert [i for b in loader for i in b.tolist()] == order[12:]
    with pytest.warns(UserWarning, match="not a whole number of rounds"):
        loader.load_state_dict(dict(state, batch_size=2, position=1))  # 4 samples: 1 batch of 3, 1 seen twice
    torch.set_rng_state(rng)
    assert [i for b in loader for i in b.tolist()] == order[3:]


def test_state_that_needs_full_unpickling_loads_with_a_warning_naming_the_file(tmp_path):
    import datetime

    class Holder:
        def __init__(self, value):
            self.value = value

        def state_dict(self):
            return {"when": self.value}

        def load_state_dict(self, state):
            self.value = state["when"]

    acc = Accelerator()
    acc.register_for_checkpointing(Holder(datetime.date(2024, 1, 2)))
    acc.save_state(tmp_path / "c")
    acc2 = Accelerator()
    holder = Holder(None)
    acc2.register_for_checkpointing(holder)
    with pytest.warns(UserWarning, match=r"custom_checkpoint_0.pkl holds objects that weights_only loading refuses"):
        acc2.load_state(tmp_path / "c")
    assert holder.value == datetime.date(2024, 1, 2)


def test_save_and_load_pre_hooks_can_take_over_a_model(tmp_path):
    def save_hook(models, weights, output_dir):
        torch.save(weights.pop(0), os.path.join(output_dir, "my_model.pt"))  # written into the atomic checkpoint

    def load_hook(models, input_dir):
        models.pop(0).load_state_dict(torch.load(os.path.join(input_dir, "my_model.pt")))

    acc = Accelerator()
    torch.manual_seed(0)
    model = acc.prepare(torch.nn.Linear(3, 3))
    acc.register_save_state_pre_hook(save_hook)
    acc.save_state(tmp_path / "c")
    assert "my_model.pt" in os.listdir(tmp_path / "c") and "model.safetensors" not in os.listdir(tmp_path / "c")
    acc2 = Accelerator()
    model2 = acc2.prepare(torch.nn.Linear(3, 3))
    acc2.register_load_state_pre_hook(load_hook)
    acc2.load_state(tmp_path / "c")
    assert torch.equal(model2.weight, model.weight)


def test_a_project_dir_that_a_process_cannot_see_is_named_before_any_save(tmp_path):
    # what a process on another machine with a node-local project_dir meets at resume(): process 0's file is not there
    from anyaccel.checkpoint.agreement import _check_shared
    from anyaccel.checkpoint.training_state import TrainingState
    from anyaccel.errors import CheckpointError

    state = TrainingState([], [], [], [], [], None, None)
    _check_shared(state, str(tmp_path), None)  # process 0 could not write its file: the first save will say so
    with pytest.raises(CheckpointError, match="is not shared: process 0 on .* cannot see a file"):
        _check_shared(state, str(tmp_path), str(tmp_path / ".anyaccel-shared-elsewhere"))
