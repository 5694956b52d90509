"""The XLA path, run for real on torch-xla's CPU device (``PJRT_DEVICE=CPU``, one replica).

Run with ``make test-xla`` (``scripts/setup_xla_venv.sh`` then ``.venv-xla/bin/python -m pytest
tests/xla -m xla``). Skipped in the main environment, which has no torch-xla. (No conftest.py in
this directory on purpose: a second ``conftest`` module would shadow ``tests/conftest.py`` for the
``from conftest import ...`` lines of the main suite.)

What is real here: the XLA device, lazy tensors and compiled graphs, torch-xla's parallel loader
thread feeding the device, XLA collectives (all-gather, all-reduce, collective broadcast,
rendezvous) over one replica, torch-xla's RNG, bf16 autocast on XLA.

The simulation boundary (``test_multi_replica_math_*``): several replicas cannot be started on
this machine (``xmp.spawn`` over 2 CPU devices hangs inside XLA's own rendezvous). Those tests
tell torch-xla the world has 2 replicas (``runtime.world_size``) and force its all-reduce to be
compiled and executed anyway (``XLA_ALWAYS_ALLREDUCE=1``): the reduction then really runs in XLA
over the one replica that exists, so the *scaling* (divide by the world size exactly once) is
checked through the real collective; that the other replica's values are summed in is torch-xla's
own job and is not exercised here.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("torch_xla") is not None:
    # Before torch_xla is imported (it would pick a default itself): torch-xla's CPU client, one
    # device. Run this directory on its own (``pytest tests/xla -m xla``): importing torch_xla
    # exports PJRT_DEVICE, which makes every later Accelerator in the process choose XLA.
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("CPU_NUM_DEVICES", "1")

torch_xla = pytest.importorskip("torch_xla")

import torch  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

from anyaccel import Accelerator  # noqa: E402
from anyaccel.backends import xla  # noqa: E402

pytestmark = pytest.mark.xla


def _regression(n=64, features=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = x @ torch.randn(features, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def _indexed(n):
    """Samples are their own index, so batches can be compared exactly."""
    return torch.utils.data.TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1))


def _train_epoch(acc, model, opt, loader):
    losses = []
    for x, y in loader:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        losses.append(loss.detach())
    return [float(v) for v in torch.stack(losses).cpu()]


# ------------------------------------------------------------------------------------------
# Device, environment, training
# ------------------------------------------------------------------------------------------


def test_accelerator_uses_the_xla_device():
    acc = Accelerator()
    env = acc.environment
    assert acc.device.type == "xla" and str(acc.device) == "xla:0"
    assert acc.distributed_type.value == "XLA"
    assert (acc.num_processes, acc.process_index, acc.is_main_process) == (1, 0, True)
    assert (env.backend, env.source, env.device) == ("xla", "xla", "xla:0")
    assert not torch.distributed.is_initialized()  # torch-xla, not a torch process group, owns replicas


def test_training_on_xla_optimizer_built_before_prepare():
    acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)  # the usual order: optimizer before prepare
    loader = torch.utils.data.DataLoader(_regression(), batch_size=16, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)

    assert all(p.device.type == "xla" for p in model.parameters())
    # The optimizer updates the parameters the model uses (not stale CPU copies).
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    batch = next(iter(loader))
    assert all(t.device.type == "xla" for t in batch)

    first = _train_epoch(acc, model, opt, loader)
    for _ in range(4):
        last = _train_epoch(acc, model, opt, loader)
    assert sum(last) / len(last) < 0.2 * sum(first) / len(first), (first, last)


def test_cpu_flag_overrides_xla():
    acc = Accelerator(cpu=True)
    assert acc.device.type == "cpu"
    assert acc.distributed_type.value == "NO"


# ------------------------------------------------------------------------------------------
# The device loader: end of data, accumulation, positions, resume
# ------------------------------------------------------------------------------------------


def test_end_of_data_seen_at_the_last_batch_despite_prefetching():
    # 7 batches, all prefetched by torch-xla's loader thread before the first step.
    acc = Accelerator(gradient_accumulation_steps=3)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(_regression(n=28), batch_size=4)
    model, opt, loader = acc.prepare(model, opt, loader)
    syncs, ends = [], []
    for x, y in loader:
        with acc.accumulate(model):
            ends.append(acc.gradient_state.end_of_dataloader)
            syncs.append(acc.sync_gradients)
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    assert ends == [False] * 6 + [True]
    assert syncs == [False, False, True, False, False, True, True]
    assert acc.gradient_state.active_loader is None  # popped when the loop ended


def test_loader_keeps_the_prepared_loader_interface_and_resumes_exactly():
    from anyaccel import DataLoaderConfiguration

    # seedable order: set_epoch(0) replays epoch 0 (the user's own generator would move on)
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    base = torch.utils.data.DataLoader(_indexed(28), batch_size=4, shuffle=True)
    loader = acc.prepare(base)
    assert len(loader) == 7 and loader.batch_size == 4 and len(loader.dataset) == 28

    loader.set_epoch(0)
    full = [b[0].cpu().flatten().tolist() for b in loader]
    assert sorted(sum(full, [])) == list(range(28))

    loader.set_epoch(0)
    seen = []
    for i, (x,) in enumerate(loader):
        seen.append(x.cpu().flatten().tolist())
        if i == 2:
            state = loader.state_dict()  # the loop consumed 3 batches; the thread read them all
            break
    assert state["position"] == 3 and state["epoch"] == 0 and not state["finished_epoch"]
    assert seen == full[:3]

    loader.load_state_dict(state)
    rest = [b[0].cpu().flatten().tolist() for b in loader]
    assert rest == full[3:]

    loader.set_epoch(0)
    acc.skip_first_batches(loader, 5)
    assert [b[0].cpu().flatten().tolist() for b in loader] == full[5:]


# ------------------------------------------------------------------------------------------
# Collectives with one replica
# ------------------------------------------------------------------------------------------


def test_collectives_world_size_one():
    acc = Accelerator()
    d = acc.device
    t = torch.arange(6, dtype=torch.float32, device=d).reshape(3, 2)

    assert torch.equal(acc.gather(t).cpu(), t.cpu())
    assert acc.gather(torch.tensor(5.0, device=d)).cpu().tolist() == [5.0]  # 0-d -> 1-d
    nested = acc.gather({"a": t, "b": [t[0]]})
    assert torch.equal(nested["b"][0].cpu(), t[0].cpu())

    assert torch.equal(acc.reduce(t, "sum").cpu(), t.cpu())
    assert torch.equal(acc.reduce(t, "mean").cpu(), t.cpu())
    assert torch.equal(acc.reduce(t, "mean", scale=2.0).cpu(), 2 * t.cpu())  # scale applied with 1 replica too
    ints = acc.reduce(torch.tensor([3, 4], device=d), "mean")
    assert ints.dtype == torch.float32 and ints.cpu().tolist() == [3.0, 4.0]

    assert torch.equal(acc.broadcast(t).cpu(), t.cpu())
    assert acc.gather_object({"x": 1}) == [{"x": 1}]
    assert acc.gather_object([1, 2]) == [1, 2]
    assert torch.equal(acc.pad_across_processes(t).cpu(), t.cpu())
    acc.wait_for_everyone()
    assert acc.check_trigger() is False
    acc.set_trigger()
    assert acc.check_trigger() is True and acc.check_trigger() is False


def test_gather_for_metrics_counts_each_sample_once():
    acc = Accelerator()
    loader = acc.prepare(torch.utils.data.DataLoader(_indexed(10), batch_size=4))  # 4, 4, 2
    got = [acc.gather_for_metrics(x).cpu() for (x,) in loader]
    assert torch.cat(got).flatten().tolist() == list(range(10))
    objs = []
    for (x,) in loader:
        objs += acc.gather_for_metrics(x.cpu().flatten().tolist())
    assert objs == list(range(10))


def test_object_collectives_through_xla_rendezvous():
    d = xla.device()
    payload = {"step": 3, "name": "a", "t": torch.ones(2, device=d)}
    (got,) = xla.gather_object(payload)
    assert got["step"] == 3 and got["name"] == "a" and got["t"].device.type == "cpu"
    assert xla.broadcast_object_list([7, "seven"]) == [7, "seven"]
    with pytest.raises(ValueError, match="same length"):
        _length_mismatch()
    xla.rendezvous("anyaccel.test")
    t = torch.arange(5.0, device=d)
    assert xla.gather_sizes(t) == [5]
    assert torch.equal(xla.all_gather_uneven(t).cpu(), t.cpu())
    assert xla.all_gather(torch.tensor(2.0, device=d)).cpu().tolist() == [2.0]


def _length_mismatch():
    """Replica 0 sent 2 objects, this replica expects 3: it must be told, not silently truncated.
    (The other replica is played by replacing the rendezvous' answer.)"""
    import torch_xla.core.xla_model as xm

    real = xm.rendezvous
    try:
        xm.rendezvous = lambda tag, payload=b"": [xla._dumps([1, 2])]
        xla.broadcast_object_list([None, None, None])
    finally:
        xm.rendezvous = real


# ------------------------------------------------------------------------------------------
# Gradient reduction: one replica for real, several through the documented seam
# ------------------------------------------------------------------------------------------


def _grads_after_backward(d):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).to(d)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 3, device=d)).sum().backward()
    return model, opt, [p.grad.detach().cpu().clone() for p in model.parameters()]


def test_reduce_gradients_single_replica_leaves_gradients_alone():
    d = xla.device()
    model, opt, before = _grads_after_backward(d)
    xla.reduce_gradients_early(opt)  # e.g. before clipping
    xla.reduce_gradients(opt)  # the optimizer wrapper's pre-step hook: must not reduce again
    after = [p.grad.cpu() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert "_anyaccel_xla_gradients_reduced" not in opt.__dict__  # flag consumed by the step


@pytest.fixture
def two_replicas_simulated(monkeypatch):
    """torch-xla believes there are 2 replicas and compiles its all-reduce although only one
    exists (see the module docstring for what this does and does not prove)."""
    monkeypatch.setattr(xr, "world_size", lambda: 2)
    monkeypatch.setenv("XLA_ALWAYS_ALLREDUCE", "1")


def test_multi_replica_math_gradients_averaged_once(two_replicas_simulated):
    d = xla.device()
    model, opt, before = _grads_after_backward(d)
    xla.reduce_gradients(opt)
    after = [p.grad.cpu() for p in model.parameters()]
    assert all(torch.allclose(a, b / 2) for a, b in zip(after, before))  # sum over replicas / 2

    model, opt, before = _grads_after_backward(d)
    xla.reduce_gradients_early(opt)
    xla.reduce_gradients_early(opt)  # idempotent until the step
    xla.reduce_gradients(opt)  # the step's hook: already reduced
    after = [p.grad.cpu() for p in model.parameters()]
    assert all(torch.allclose(a, b / 2) for a, b in zip(after, before))


def test_multi_replica_math_reduce_mean_and_scale(two_replicas_simulated):
    d = xla.device()
    t = torch.tensor([2.0, 4.0], device=d)
    assert xla.all_reduce(t, "sum").cpu().tolist() == [2.0, 4.0]
    assert xla.all_reduce(t, "mean").cpu().tolist() == [1.0, 2.0]
    assert xla.all_reduce(t, "mean", scale=3.0).cpu().tolist() == [3.0, 6.0]
    assert t.cpu().tolist() == [2.0, 4.0]  # input untouched


def test_optimizer_step_reduces_gradients_through_the_wrapper(two_replicas_simulated):
    # The prepared optimizer calls xla.reduce_gradients before stepping (xm.optimizer_step).
    acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = acc.prepare(model, opt)
    w0 = model.weight.detach().cpu().clone()
    model(torch.ones(1, 3, device=acc.device)).sum().backward()
    grad = model.weight.grad.detach().cpu().clone()
    opt.step()
    assert torch.allclose(model.weight.detach().cpu(), w0 - grad / 2)


def test_optimizer_over_parameters_off_the_device_is_an_error_not_a_silent_no_op():
    acc = Accelerator()
    stray = torch.nn.Linear(2, 1)  # never prepared: its parameters stay on the CPU
    opt = acc.prepare(torch.optim.SGD(stray.parameters(), lr=0.1))
    stray(torch.ones(1, 2)).sum().backward()
    with pytest.raises(RuntimeError, match="not on the XLA device"):
        opt.step()


# ------------------------------------------------------------------------------------------
# Mixed precision
# ------------------------------------------------------------------------------------------


def test_bf16_autocast_on_xla():
    acc = Accelerator(mixed_precision="bf16")
    assert acc.scaler is None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(_regression(), batch_size=16, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    seen = []
    acc.unwrap_model(model)[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype) and None)
    x, _ = next(iter(loader))
    out = model(x)
    assert seen[-1] == torch.bfloat16  # the Linear ran in bf16 on the XLA device
    assert out.dtype == torch.float32  # outputs come back in fp32
    with acc.autocast():
        assert acc.unwrap_model(model)[0](x).dtype == torch.bfloat16
    first = _train_epoch(acc, model, opt, loader)
    for _ in range(4):
        last = _train_epoch(acc, model, opt, loader)
    assert sum(last) < 0.3 * sum(first), (first, last)


def test_fp16_is_refused_on_xla_with_advice():
    with pytest.raises(ValueError, match="bf16"):
        Accelerator(mixed_precision="fp16")


# ------------------------------------------------------------------------------------------
# Saving
# ------------------------------------------------------------------------------------------


def test_save_writes_cpu_tensors_atomically(tmp_path):
    acc = Accelerator()
    torch.manual_seed(0)
    model = acc.prepare(torch.nn.Linear(4, 2))
    path = tmp_path / "sub" / "weights.pt"
    acc.save(acc.get_state_dict(model), path)
    assert sorted(os.listdir(tmp_path / "sub")) == ["weights.pt"]  # no temporary file left
    loaded = torch.load(path)
    assert all(v.device.type == "cpu" for v in loaded.values())
    for k, v in acc.get_state_dict(model).items():
        assert torch.equal(loaded[k], v.cpu())

    fresh = torch.nn.Linear(4, 2)
    fresh.load_state_dict(loaded)
    fresh = acc.prepare(fresh)
    x = torch.randn(3, 4).to(acc.device)
    assert torch.equal(fresh(x).cpu(), model(x).cpu())


def test_save_state_and_load_state_resume_exactly(tmp_path):
    acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(_regression(n=48), batch_size=8, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    _train_epoch(acc, model, opt, loader)

    acc.save_state(str(tmp_path / "ckpt"))
    expected = _train_epoch(acc, model, opt, loader)  # epoch 1: new shuffle, dropout masks from the XLA RNG
    weights = [p.detach().cpu().clone() for p in model.parameters()]

    acc.load_state(str(tmp_path / "ckpt"))
    again = _train_epoch(acc, model, opt, loader)
    assert again == expected
    assert all(torch.equal(a, p.detach().cpu()) for a, p in zip(weights, model.parameters()))


# ------------------------------------------------------------------------------------------
# Launching and imports
# ------------------------------------------------------------------------------------------


def _write_marker(path, value):
    with open(path, "w") as fh:
        fh.write(value)


def test_spawn_single_process_and_bad_count(tmp_path):
    marker = tmp_path / "ran"
    xla.spawn(_write_marker, args=(str(marker), "yes"), nprocs=1)  # runs here, without the index
    assert marker.read_text() == "yes"
    with pytest.raises(ValueError, match="num_processes=3"):
        xla.spawn(_write_marker, args=(str(marker), "no"), nprocs=3)


def test_import_anyaccel_does_not_load_torch_xla():
    code = ("import sys, anyaccel; from anyaccel import Accelerator, resolve_environment; "
            "env = resolve_environment(); assert env.device_type == 'xla', env; "
            "assert 'torch_xla' not in sys.modules, 'torch_xla imported'; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PJRT_DEVICE="CPU"))
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]
