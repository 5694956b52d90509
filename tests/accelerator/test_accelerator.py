"""Accelerator in one process: the façade a script talks to."""


import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from anyaccel import Accelerator, DistributedType
from anyaccel.data import PreparedDataLoader
from anyaccel.stepping import AcceleratedOptimizer, AcceleratedScheduler


@pytest.fixture
def acc(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ANYACCEL_MIXED_PRECISION"):
        monkeypatch.delenv(k, raising=False)
    return Accelerator(cpu=True)


def parts():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = DataLoader(TensorDataset(torch.randn(10, 3), torch.randn(10, 1)), batch_size=4)
    return model, opt, sched, loader


def test_properties(acc):
    assert acc.device == torch.device("cpu")
    assert (acc.process_index, acc.local_process_index, acc.num_processes) == (0, 0, 1)
    assert acc.is_main_process and acc.is_local_main_process
    assert acc.distributed_type is DistributedType.NO and acc.distributed_type == "NO"
    assert acc.mixed_precision == "no"


def test_prepare_any_order_and_count(acc):
    model, opt, sched, loader = parts()
    s2, l2, m2, o2 = acc.prepare(sched, loader, model, opt)
    assert isinstance(s2, AcceleratedScheduler) and isinstance(l2, PreparedDataLoader)
    assert isinstance(o2, AcceleratedOptimizer) and m2 is model
    assert s2.optimizers == [o2]
    # the torch API is kept
    assert o2.param_groups is opt.param_groups and o2.state_dict()["param_groups"]
    assert isinstance(o2, torch.optim.Optimizer)
    # prepare again (e.g. an eval loader), one object in → one object out
    eval_loader = acc.prepare(DataLoader(TensorDataset(torch.zeros(3, 3)), batch_size=2))
    assert isinstance(eval_loader, PreparedDataLoader) and len(eval_loader) == 2


def test_prepare_rejects_unknown_objects_by_type(acc):
    with pytest.raises(TypeError, match=r"argument 1 is a builtins\.object"):
        acc.prepare(torch.nn.Linear(1, 1), object())
    with pytest.raises(TypeError, match="dict"):
        acc.prepare({"model": 1})


def test_training_step_matches_plain_pytorch(acc):
    torch.manual_seed(0)
    model, opt, sched, loader = parts()
    ref = torch.nn.Linear(3, 1)
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    data = list(loader)
    model, opt, sched = acc.prepare(model, opt, sched)
    for xb, yb in data:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        ref_loss = torch.nn.functional.mse_loss(ref(xb), yb)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    sched.step()
    assert sched.get_last_lr() == [0.05]


def test_single_process_collectives_are_identities(acc):
    t = torch.arange(4)
    assert torch.equal(acc.gather(t), t)
    assert acc.gather(torch.tensor(3.0)).shape == (1,)
    assert torch.equal(acc.reduce(t, "sum"), t)
    assert acc.gather_object(["a"]) == ["a"] and acc.gather_object(5) == [5]
    assert torch.equal(acc.pad_across_processes(t), t)
    acc.wait_for_everyone()
    with acc.split_between_processes([1, 2, 3]) as part:
        assert part == [1, 2, 3]


def test_unwrap_model_and_a_compile_wrapper(acc):
    model = torch.nn.Linear(2, 2)
    compiled = torch.compile(model)
    assert acc.unwrap_model(compiled) is compiled  # Accelerate's default: keep_torch_compile=True
    assert acc.unwrap_model(compiled, keep_torch_compile=False) is model
    assert set(acc.get_state_dict(compiled)) == {"weight", "bias"}  # never `_orig_mod.` in what is saved


def test_save_is_atomic_and_main_only(acc, tmp_path):
    path = tmp_path / "sub" / "w.pt"
    acc.save({"a": torch.ones(1)}, path)
    assert torch.load(path)["a"].item() == 1.0
    assert [p.name for p in path.parent.iterdir()] == ["w.pt"]


def test_failed_save_leaves_previous_file(acc, tmp_path):
    path = tmp_path / "w.pt"
    acc.save({"v": 1}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        acc.save({"v": Unpicklable()}, path)
    assert torch.load(path) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.pt"]


def test_main_process_helpers(acc, capsys):
    calls = []
    acc.on_main_process(lambda: calls.append(1))()
    acc.on_process(lambda: calls.append(2), process_index=1)()
    acc.print("hello")
    with acc.main_process_first():
        calls.append(3)
    assert calls == [1, 3]
    assert "hello" in capsys.readouterr().out


def test_second_accelerator_is_independent(acc):
    other = Accelerator(cpu=True, gradient_accumulation_steps=4)
    assert other.gradient_accumulation_steps == 4 and acc.gradient_accumulation_steps == 1
    assert other.device == acc.device and other.gradient_state is not acc.gradient_state


def test_launcher_variables_reach_a_plain_accelerator(monkeypatch):
    monkeypatch.setenv("ANYACCEL_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("ANYACCEL_GRADIENT_ACCUMULATION_STEPS", "3")
    acc = Accelerator()
    assert acc.mixed_precision == "bf16" and acc.gradient_accumulation_steps == 3
    assert Accelerator(mixed_precision="no").mixed_precision == "no", "an explicit argument wins"


def test_bad_mixed_precision_names_the_value():
    with pytest.raises(ValueError, match="fp7"):
        Accelerator(mixed_precision="fp7")


def test_prepare_model_given_an_optimizer_says_what_it_got_and_what_it_takes(tmp_path):
    """issue 29: it raised a bare AttributeError."""
    acc = Accelerator(cpu=True, preemption_signals="none", project_dir=str(tmp_path))
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match=r"prepare_model\(\) takes the model \(a torch.nn.Module\); got "
                                        r"torch.optim.adamw.AdamW. Pass optimizers, schedulers and DataLoaders to "
                                        r"prepare\(\)"):
        acc.prepare_model(optimizer)
    with pytest.raises(TypeError, match=r"prepare_optimizer\(\) takes a torch.optim.Optimizer; got "
                                        r"torch.nn.modules.linear.Linear"):
        acc.prepare_optimizer(model)


def test_resume_told_nowhere_to_look_says_what_to_pass(tmp_path, monkeypatch):
    """issue 29: without automatic checkpoint naming or project_dir, resume() returned (0, 0, None)
    silently while save_state() said what it needs; now it says it too."""
    from anyaccel import ProjectConfiguration

    monkeypatch.chdir(tmp_path)  # ./checkpoints: nothing there
    acc = Accelerator(cpu=True, preemption_signals="none")
    acc.prepare(torch.nn.Linear(2, 1))
    with pytest.raises(ValueError, match=r"resume\(\) found no checkpoint under ./checkpoints and was told of no "
                                         r"other place: .*automatic_checkpoint_naming=True, project_dir=...\)"):
        acc.resume()
    with pytest.raises(ValueError, match=r"save_state\(\) needs output_dir"):  # the same advice as save_state's
        acc.save_state()
    told = Accelerator(cpu=True, preemption_signals="none", project_config=ProjectConfiguration(
        project_dir=str(tmp_path / "p"), automatic_checkpoint_naming=True))
    assert tuple(told.resume()) == (0, 0, None)  # a first run: nothing yet, and that is fine
