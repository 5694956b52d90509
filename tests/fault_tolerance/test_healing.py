"""The healing state (anyaccel/fault_tolerance/healing.py), in one process and without torchft: what a
live group sends, applied to a fresh group, makes it continue exactly where the live one is."""

from __future__ import annotations

import io
import sys

import pytest
import torch

from anyaccel import Accelerator
from anyaccel.errors import FaultToleranceError
from anyaccel.fault_tolerance.healing import HealingState

from conftest import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from train_common import build, train_step  # noqa: E402


def _sent(acc):
    """What a live group sends, as the receiver gets it: serialised and read back (no shared tensors)."""
    buffer = io.BytesIO()
    torch.save(HealingState(acc._training_state, exclude=[]).state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _group(seed):
    acc = Accelerator(cpu=True)
    return acc, build(acc, seed=seed, n=40, batch_size=4)


def _steps(acc, objs, it, n):
    model, opt, _, sched = objs
    for _ in range(n):
        train_step(acc, model, opt, sched, next(it))


def test_a_fresh_group_continues_exactly_where_the_live_one_is():
    live, objs = _group(seed=0)
    it = iter(objs[2])
    _steps(live, objs, it, 3)
    sent = _sent(live)  # at a step boundary
    fresh, mine = _group(seed=1)  # other weights, other RNG
    step = HealingState(fresh._training_state, exclude=[]).load(sent, loaders=True)
    assert step == live.step
    # the next batches, updates, learning rates and dropout masks are the live group's (one process
    # here, one global RNG: each runs from the state that was sent)
    _steps(fresh, mine, iter(mine[2]), 4)
    fresh_rng = torch.get_rng_state()
    torch.set_rng_state(sent["rng"]["torch"])
    _steps(live, objs, it, 4)
    for a, b in zip(objs[0].parameters(), mine[0].parameters()):
        assert torch.equal(a, b)
    assert objs[3].get_last_lr() == mine[3].get_last_lr()
    assert torch.equal(torch.get_rng_state(), fresh_rng)


def test_parameters_travel_by_reference_and_buffers_as_copies():
    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)))
    sent = HealingState(acc._training_state, exclude=[]).state_dict()["models"][0]
    assert sent["0.weight"].data_ptr() == model[0].weight.data_ptr()  # unchanged until the sender's optimizer step
    assert sent["1.running_mean"].data_ptr() != model[1].running_mean.data_ptr()  # a forward updates it


def test_a_group_whose_loader_stands_elsewhere_mid_epoch_is_told_to_call_resume():
    live, objs = _group(seed=0)
    it = iter(objs[2])
    _steps(live, objs, it, 3)
    sent = _sent(live)
    other, mine = _group(seed=0)
    next(iter(mine[2]))  # iterating, one batch in
    with pytest.raises(FaultToleranceError, match=r"epoch 0, batch 3, .* batch 1 .*accelerator.resume\(\)"):
        HealingState(other._training_state, exclude=[]).load(sent, loaders=False)


def test_groups_that_prepared_different_objects_are_refused():
    live, _ = _group(seed=0)
    sent = _sent(live)
    other = Accelerator(cpu=True)
    other.prepare(torch.nn.Linear(2, 2))
    with pytest.raises(FaultToleranceError, match="must run the same script"):
        HealingState(other._training_state, exclude=[]).load(sent, loaders=True)


def _bytes(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def test_the_boundarys_state_read_later_is_byte_for_byte_the_one_taken_whole_at_the_boundary():
    """The replica takes the boundary's state at every step and resolves it (the optimizers' states,
    the RNG states' conversion) only when a peer heals from it, on torchft's quorum thread, while the
    forward pass runs: a forward pass (dropout draws from the RNG, BatchNorm updates its running
    statistics) and the next batch's fetch in between change none of what is sent."""
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5),
                                torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=4)
    model, opt, loader = acc.prepare(model, opt, loader)
    batches = iter(loader)
    healing = HealingState(acc._training_state, exclude=[])
    for _ in range(2):  # optimizer states exist, the loader is mid-epoch
        acc.backward(model(next(batches)[0]).sum())
        opt.step()
        opt.zero_grad()
    whole = _bytes(healing.state_dict())
    boundary = healing.boundary()
    acc.backward(model(next(batches)[0]).sum())  # the step's forward and backward: RNG, buffers, loader move on
    assert _bytes(boundary.resolve()) == whole
    assert boundary.resolve() is boundary.resolve()  # resolved once
    assert _bytes(healing.state_dict()) != whole  # (what moved on would have been sent otherwise)
