"""The small shared pieces: the one tree walker, the one atomic writer, the one error family."""

import collections
import os
import stat

import pytest
import torch

from anyaccel import errors, fileio, tree

Pair = collections.namedtuple("Pair", "x y")


class Batch(dict):
    """A dict subclass (like a Hugging Face batch) that must come back as itself."""


def test_map_and_flatten_keep_every_container_type():
    data = {"a": [torch.ones(1), (torch.zeros(2), Pair(torch.ones(3), "label"))], "b": Batch(t=torch.ones(1)), "n": 3}
    doubled = tree.map_tensors(lambda t: t * 2, data)
    assert isinstance(doubled["a"][1][1], Pair) and doubled["a"][1][1].y == "label"
    assert isinstance(doubled["b"], Batch) and doubled["n"] == 3
    assert torch.equal(doubled["a"][1][1].x, torch.full((3,), 2.0))

    nested = {"a": [torch.ones(1), (torch.zeros(2), Pair(torch.ones(3), torch.zeros(1)))], "b": Batch(t=torch.ones(1))}
    leaves, build, sig = tree.flatten(nested)
    assert len(leaves) == 5
    rebuilt = build([t + 1 for t in leaves])
    assert isinstance(rebuilt["a"][1][1], Pair) and isinstance(rebuilt["b"], Batch)
    assert torch.equal(rebuilt["a"][1][0], torch.ones(2))
    # the signature tells layouts apart, not values
    assert tree.flatten({"a": [torch.ones(9)], "b": torch.ones(1)})[2] != tree.flatten({"a": (torch.ones(9),), "b": torch.ones(1)})[2]
    assert tree.flatten(torch.ones(2))[2] == "T"


def test_flatten_refuses_what_collectives_cannot_send():
    with pytest.raises(TypeError, match="found str. Use gather_object"):
        tree.flatten({"a": torch.ones(1), "b": "text"})


def test_atomic_write_replaces_or_leaves_the_old_file(tmp_path):
    path = tmp_path / "sub" / "f.txt"
    fileio.atomic_write_text(path, "one")
    os.chmod(path, 0o600)
    fileio.atomic_write_text(path, "two")
    assert path.read_text() == "two" and stat.S_IMODE(os.stat(path).st_mode) == 0o600  # permissions kept

    def broken(tmp):
        with open(tmp, "w") as fh:
            fh.write("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        fileio.atomic_write(path, broken)
    assert path.read_text() == "two" and os.listdir(path.parent) == ["f.txt"]  # no temporary left


def test_every_error_has_one_base_and_keeps_its_builtin():
    assert issubclass(errors.ConfigError, ValueError) and issubclass(errors.CheckpointError, RuntimeError)
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.AnyaccelError)
    from anyaccel import CheckpointError, ShapeMismatchError, WorkerFailedError
    from anyaccel.config.schema import ConfigError
    from anyaccel.launch.notebook import LauncherError

    assert (CheckpointError, ShapeMismatchError, WorkerFailedError, ConfigError, LauncherError) == (
        errors.CheckpointError, errors.ShapeMismatchError, errors.WorkerFailedError, errors.ConfigError,
        errors.LauncherError)
