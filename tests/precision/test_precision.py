"""Mixed precision on the CPU: bf16 autocast, fp16 with a gradient scaler, clipping, skipped steps."""

from __future__ import annotations

import warnings

import pytest
import torch

from anyaccel import Accelerator, GradScalerKwargs


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def _batches(n=4):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


def _fp16(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Accelerator(mixed_precision="fp16", **kwargs)


def test_bf16_forward_runs_in_bf16_and_returns_fp32():
    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(_model())
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    out = model(torch.randn(4, 8))
    assert seen == [torch.bfloat16] and out.dtype == torch.float32
    assert acc.scaler is None


def test_bf16_training_matches_raw_torch_autocast_bitwise():
    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(_model())
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    raw = _model()
    raw_opt = torch.optim.SGD(raw.parameters(), lr=0.1)
    for x, y in _batches():
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = raw(x)
        torch.nn.functional.mse_loss(out.float(), y).backward()
        raw_opt.step()
        raw_opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), raw.parameters()))


def test_fp16_on_cpu_warns_and_uses_a_real_scaler():
    with pytest.warns(UserWarning, match="fp16.*CPU"):
        acc = Accelerator(mixed_precision="fp16")
    assert isinstance(acc.scaler, torch.amp.GradScaler)
    model = acc.prepare(_model())
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    model(torch.randn(2, 8))
    assert seen == [torch.float16]


def test_fp16_with_clipping_matches_the_raw_amp_recipe_bitwise():
    acc = _fp16(kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    model = acc.prepare(_model())
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    raw = _model()
    raw_opt = torch.optim.SGD(raw.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for x, y in _batches():
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        norm = acc.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()

        with torch.autocast("cpu", dtype=torch.float16):
            out = raw(x)
        scaler.scale(torch.nn.functional.mse_loss(out.float(), y)).backward()
        scaler.unscale_(raw_opt)
        raw_norm = torch.nn.utils.clip_grad_norm_(raw.parameters(), 0.5)
        scaler.step(raw_opt)
        scaler.update()
        raw_opt.zero_grad()
        assert torch.equal(norm, raw_norm)  # the norm of the *unscaled* gradients
        assert not acc.optimizer_step_was_skipped
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), raw.parameters()))
    assert acc.scaler.get_scale() == scaler.get_scale()


def test_overflow_skips_the_optimizer_and_the_scheduler():
    acc = _fp16(kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    model = acc.prepare(_model())
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    sched = acc.prepare(torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5))
    x, y = _batches(1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    acc.backward(torch.nn.functional.mse_loss(model(x), y) * float("inf"))
    acc.clip_grad_value_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad()
    assert acc.optimizer_step_was_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert sched.get_last_lr() == [0.1] and acc.scaler.get_scale() == 512.0

    acc.backward(torch.nn.functional.mse_loss(model(x), y))
    opt.step()
    sched.step()
    assert not acc.optimizer_step_was_skipped
    assert sched.get_last_lr() == [0.05]
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_clip_grad_value_unscales_first():
    acc = _fp16(kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    model = acc.prepare(_model())
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    raw = _model()
    raw_opt = torch.optim.SGD(raw.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = _batches(1)[0]
    acc.backward(torch.nn.functional.mse_loss(model(x), y))
    acc.clip_grad_value_(model.parameters(), 0.01)
    with torch.autocast("cpu", dtype=torch.float16):
        out = raw(x)
    scaler.scale(torch.nn.functional.mse_loss(out.float(), y)).backward()
    scaler.unscale_(raw_opt)
    assert max(p.grad.abs().max().item() for p in raw.parameters()) > 0.01  # something to clip
    torch.nn.utils.clip_grad_value_(raw.parameters(), 0.01)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), raw.parameters()))
    opt.step()  # does not unscale a second time (torch would raise if it tried)


def test_precision_from_the_launcher_environment(monkeypatch):
    monkeypatch.setenv("ANYACCEL_MIXED_PRECISION", "bf16")
    assert Accelerator().mixed_precision == "bf16"
    assert Accelerator(mixed_precision="no").mixed_precision == "no"  # an explicit argument wins


def test_unknown_precision_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match=r"mixed_precision has the value 'fp4'; allowed: one of no, fp16, bf16, fp8"):
        Accelerator(mixed_precision="fp4")


def test_autocast_context_manager():
    acc = Accelerator(mixed_precision="bf16")
    with acc.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == torch.bfloat16
    with acc.autocast(enabled=False):
        assert not torch.is_autocast_enabled("cpu")
    with Accelerator().autocast():
        assert not torch.is_autocast_enabled("cpu")


def test_unwrap_model_can_drop_the_autocast_forward():
    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(_model())
    plain = acc.unwrap_model(model, keep_fp32_wrapper=False)
    seen = []
    plain[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    plain(torch.randn(2, 8))
    assert seen == [torch.float32]


def test_a_prepared_bf16_model_pickles_and_still_autocasts():
    """torch.save(model) / pickle of a prepared model keeps working under mixed precision (the
    autocast forward is an object, not a closure) and the copy still returns float32."""
    import pickle

    acc = Accelerator(cpu=True, mixed_precision="bf16")
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    copy = pickle.loads(pickle.dumps(model))
    x = torch.randn(2, 4)
    assert copy(x).dtype == torch.float32
    assert torch.equal(copy(x), model(x))
    assert copy.forward.__wrapped__.__func__ is torch.nn.Sequential.forward
