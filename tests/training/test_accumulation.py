"""Gradient accumulation: sync pattern, optimizer/scheduler stepping, loss scaling, equality with
one large batch (in one process here, in two real processes in the slow test)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils.data import DataLoader

from conftest import SCRIPTS
sys.path.insert(0, str(SCRIPTS))
import train_common as tc  # noqa: E402

from anyaccel import Accelerator, set_seed  # noqa: E402


def _train(accum, batch, n=44, epochs=2):
    acc = Accelerator(gradient_accumulation_steps=accum)
    set_seed(0)
    model = tc.make_model(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    loader = DataLoader(tc.data(n), batch_size=batch, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    pattern = []
    for _ in range(epochs):
        for xb, yb in loader:
            before = [p.detach().clone() for p in model.parameters()]
            with acc.accumulate(model):
                acc.backward(torch.nn.functional.mse_loss(model(xb), yb))
                opt.step()
                sched.step()
                opt.zero_grad()
            stepped = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
            assert stepped == acc.sync_gradients  # the optimizer steps exactly on sync steps
            pattern.append(acc.sync_gradients)
    return tc.weights(acc, model), pattern, sched


def test_accumulation_equals_one_large_batch_including_a_short_last_group():
    # 44 samples: 11 micro-batches of 4 -> groups 4, 4 and a short 3 (sync forced at the loader's end);
    # large batches of 16 -> 16, 16, 12. The short group's loss is divided by 3, not 4.
    accum, pattern, sched = _train(4, 4)
    large, large_pattern, large_sched = _train(1, 16)
    assert pattern == ([False, False, False, True] * 2 + [False, False, True]) * 2
    assert pattern[:11] == pattern[11:]  # a group never spans two epochs
    assert all(large_pattern) and len(large_pattern) == 6
    assert max((accum[k] - large[k]).abs().max().item() for k in accum) < 1e-5
    assert sched.last_epoch == large_sched.last_epoch == 6  # one scheduler step per optimizer step
    assert sched.get_last_lr() == large_sched.get_last_lr()


def test_gradients_add_up_and_are_scaled_by_one_over_k():
    acc = Accelerator(gradient_accumulation_steps=3)
    torch.manual_seed(0)
    model = acc.prepare(torch.nn.Linear(3, 1))
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    xs = [torch.randn(5, 3) for _ in range(3)]
    for x in xs:
        with acc.accumulate(model):
            acc.backward(model(x).sum())
            if not acc.sync_gradients:
                opt.zero_grad()  # a no-op on micro-steps: gradients keep adding up
                grad = model.weight.grad.clone()
    expected = sum(x.sum(0) for x in xs) / 3
    assert torch.allclose(grad, sum(x.sum(0) for x in xs[:2]) / 3)
    assert torch.allclose(model.weight.grad[0], expected)


def test_scheduler_does_not_step_on_micro_steps_without_accumulate_context():
    acc = Accelerator(gradient_accumulation_steps=2)
    model = acc.prepare(torch.nn.Linear(2, 1))
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=1.0))
    sched = acc.prepare(torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5))
    lrs = []
    for _ in range(4):
        with acc.accumulate(model):
            acc.backward(model(torch.ones(1, 2)).sum())
            opt.step()
            sched.step()
            opt.zero_grad()
        lrs.append(sched.get_last_lr()[0])
    assert lrs == [1.0, 0.5, 0.5, 0.25]


def test_invalid_accumulation_steps():
    with pytest.raises(ValueError, match="gradient_accumulation_steps has the value 0; allowed: an integer >= 1"):
        Accelerator(gradient_accumulation_steps=0)


@pytest.mark.parametrize("divide_by_group_size, expected", [(True, 1.0), (False, 0.5)])
def test_the_short_last_group_is_divided_by_its_size_or_by_num_steps_as_accelerate(divide_by_group_size, expected):
    """3 batches, 2 per group: the last group holds 1 batch. anyaccel divides its loss by 1 (the
    mean gradient of the group); divide_by_group_size=False divides by num_steps=2, as Accelerate."""
    from torch.utils.data import DataLoader

    from anyaccel import Accelerator, GradientAccumulationPlugin

    plugin = GradientAccumulationPlugin(num_steps=2, divide_by_group_size=divide_by_group_size)
    acc = Accelerator(cpu=True, gradient_accumulation_plugin=plugin, preemption_signals="none")
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    model, loader = acc.prepare(model, DataLoader(torch.ones(3, 1), batch_size=1))
    for i, x in enumerate(loader):
        with acc.accumulate(model):
            if i == 2:
                model.zero_grad()
            acc.backward(model(x).sum())
    assert model.weight.grad.item() == pytest.approx(expected)


def _one_cycle_run(make_accelerator, adjust):
    """A OneCycleLR over fewer steps than the loop's micro-steps, under accumulation 3: the
    scheduler's _step_count and learning rate after every micro-step."""
    acc = make_accelerator(adjust)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=10)
    loader = DataLoader(torch.randn(42, 4), batch_size=2)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    seen = []
    for x in loader:
        with acc.accumulate(model):
            acc.backward(model(x).pow(2).mean())
            opt.step()
            sched.step()
            opt.zero_grad()
        seen.append((sched.scheduler._step_count, round(sched.get_last_lr()[0], 10)))
    return seen


@pytest.mark.parametrize("adjust", [True, False])
def test_adjust_scheduler_does_what_accelerates_does(adjust):
    """GradientAccumulationPlugin.adjust_scheduler: Accelerate 1.15 drops the default True in
    to_kwargs() and reads a missing key as False, so its branch never runs; anyaccel's scheduler
    gives the same _step_count and learning rate after every micro-step, for both values, as
    Accelerate's in the same process (a OneCycleLR over fewer steps than the loop takes)."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.utils import GradientAccumulationPlugin as TheirPlugin

    from anyaccel.utils import GradientAccumulationPlugin

    ours = _one_cycle_run(lambda a: Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(
        num_steps=3, adjust_scheduler=a)), adjust)
    theirs = _one_cycle_run(lambda a: accelerate.Accelerator(cpu=True, gradient_accumulation_plugin=TheirPlugin(
        num_steps=3, adjust_scheduler=a)), adjust)
    their_state = accelerate.state.GradientState().adjust_scheduler
    accelerate.state.AcceleratorState._reset_state(True)
    accelerate.state.GradientState._reset_state()
    assert ours == theirs
    assert ours[-1][0] == 8  # 21 micro-steps, 7 optimizer steps: _step_count counts the steps taken (+1)
    assert their_state is False and Accelerator(cpu=True).gradient_state.adjust_scheduler is False
