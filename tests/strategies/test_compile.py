"""torch.compile through the Accelerator really compiles: Dynamo compiles >= 1 frame (its counters,
not only equal losses) for torch.nn containers, user subclasses, a torchvision-style ResNet and
models the user compiled, in 1 process and under DDP and FSDP2 (2 real processes); the user's
object and parameter names are kept; a model Dynamo compiled nothing for warns once.

Whether frames compile is checked with the cheap "eager"/"aot_eager" backends; inductor (the real
thing, ~10-25 s per compile here) runs in one single-process slow test."""

import copy
import importlib.util
import pickle
import warnings

import pytest
import torch

from conftest import SCRIPTS

pytestmark = pytest.mark.torch_versions  # Dynamo's internals: make test-wheel runs these on torch 2.9

_spec = importlib.util.spec_from_file_location("compile_checks", SCRIPTS / "compile_checks.py")
checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checks)


def _assert_compiled(res, same_object=True):
    assert res["frames"] >= 1 and res["graphs"] >= 1, res  # Dynamo compiled the model, not eager
    assert res["compiled"] == pytest.approx(res["eager"], rel=1e-5)
    assert res["warnings"] == []
    assert res["unwrap_is_users"] and res["param_names_kept"]
    assert res["same_object"] is same_object


@pytest.mark.parametrize("kind", sorted(checks.MODELS))
def test_every_model_kind_compiles_in_one_process(kind):
    res = checks.check("default", kind, "eager")
    _assert_compiled(res)
    assert res["keys"] == res["expected_keys"]  # no `_orig_mod.` in state dicts and checkpoints


def _prepare(model, backend="eager"):
    from anyaccel import Accelerator

    return Accelerator(dynamo_backend=backend).prepare(model) if backend else Accelerator().prepare(model)


class _Disabled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    @torch._dynamo.disable
    def forward(self, x):
        return self.fc(x)


def _compile_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if "compiled nothing" in str(w.message)]


def test_a_model_dynamo_cannot_compile_warns_once_with_class_and_reason():
    torch._dynamo.reset()
    model = _prepare(_Disabled())
    x = torch.randn(2, 4)
    first = _compile_warnings(lambda: model(x))
    assert len(first) == 1 and "_Disabled" in first[0] and "runs eager" in first[0] and "disable" in first[0]
    assert _compile_warnings(lambda: (model(x), model(x))) == []  # once per model
    assert model.__dict__["_compiled_call_impl"].__name__ != "first_call"  # the check removed itself


def test_module_compile_on_a_container_warns_and_is_compiled_again_when_compile_is_on():
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    seq.compile(backend="eager")  # torch: compiles the skipped _call_impl, so nothing
    msgs = _compile_warnings(lambda: _prepare(seq, backend=None)(torch.randn(2, 4)))
    assert len(msgs) == 1 and "Sequential" in msgs[0] and "nn.Module.compile()" in msgs[0]

    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    seq.compile(backend="eager")
    before = checks.dynamo_counts()
    assert _compile_warnings(lambda: _prepare(seq)(torch.randn(2, 4))) == []
    assert checks.dynamo_counts()[1] > before[1]


def test_a_model_prepared_twice_is_compiled_once_without_a_warning():
    torch._dynamo.reset()
    model = _prepare(checks.sequential())
    model(torch.randn(2, 8))
    before = checks.dynamo_counts()
    assert _prepare(model) is model
    assert _compile_warnings(lambda: model(torch.randn(2, 8))) == []
    assert checks.dynamo_counts() == before  # the same compiled frame, from its cache


def test_no_warning_when_the_graph_is_already_cached():
    torch._dynamo.reset()
    a, b = checks.Net(), checks.Net()  # same class: the second one's first call hits the cache
    _prepare(a)(torch.randn(2, 8))
    assert _compile_warnings(lambda: _prepare(b)(torch.randn(2, 8))) == []


def test_compiled_model_keeps_hooks_modes_pickling_and_copies():
    model = _prepare(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)))
    x = torch.randn(8, 4)
    model(x)
    seen = []
    handle = model.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    model(x)
    assert seen == [torch.Size([8, 4])]  # hooks run eagerly around the compiled forward
    handle.remove()
    model.eval()
    assert torch.equal(model(x), model(x))  # eval(): dropout off (Dynamo recompiled for it)
    assert "forward" not in model.__dict__  # nothing left on the instance between calls
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert list(copied.state_dict()) == ["0.weight", "0.bias"]
        assert torch.equal(copied(x), model(x))


def test_a_container_compiles_under_bf16_autocast():
    # mixed precision puts an autocast wrapper on the instance's forward after compile: the
    # compiled frame must run it (autocast inside the graph, float32 out)
    from anyaccel import Accelerator

    torch._dynamo.reset()
    before = checks.dynamo_counts()
    model = Accelerator(cpu=True, mixed_precision="bf16", dynamo_backend="eager").prepare(checks.sequential())
    out = model(torch.randn(4, 8))
    assert checks.dynamo_counts()[1] > before[1]
    assert out.dtype == torch.float32 and "forward" in model.__dict__  # the autocast wrapper stays


def _frames():
    return checks.dynamo_counts()[0]


@pytest.mark.parametrize("via", ["unwrap_model", "extract_model_from_parallel"])
def test_unwrap_without_torch_compile_gives_a_plain_module_sharing_parameters(via):
    from anyaccel import Accelerator
    from anyaccel.utils import extract_model_from_parallel

    acc = Accelerator(dynamo_backend="eager")
    model = acc.prepare(checks.sequential())
    x = torch.randn(2, 8)
    model(x)
    plain = (acc.unwrap_model(model, keep_torch_compile=False) if via == "unwrap_model"
             else extract_model_from_parallel(model, keep_torch_compile=False))
    assert plain.__dict__.get("_compiled_call_impl") is None
    traced = torch.jit.trace(plain, x)  # fails on a dynamo-optimized module
    assert torch.equal(traced(x), model(x))
    assert all(a is b for a, b in zip(plain.parameters(), model.parameters()))  # shared, like _orig_mod
    assert acc.unwrap_model(model) is model  # keep_torch_compile=True (default): the user's object
    torch._dynamo.reset()
    before = _frames()
    model(x)
    assert _frames() > before  # the prepared model is still compiled


def test_unwrap_without_torch_compile_reaches_compiled_blocks():
    from anyaccel.strategies.compile import compile_in_place, without_compile

    model = checks.transformer()
    compile_in_place(model.layers[0], {"backend": "eager"}, watch=False)  # as compile_block does
    plain = without_compile(model)
    assert plain is not model and plain.layers[0] is not model.layers[0] and plain.layers[1] is model.layers[1]
    assert not any(m.__dict__.get("_compiled_call_impl") for m in plain.modules())
    assert model.layers[0].__dict__.get("_compiled_call_impl") is not None
    assert without_compile(checks.sequential()) is not None


def test_calls_from_two_threads_leave_the_instance_unmodified():
    import threading

    torch._dynamo.reset()
    model = _prepare(checks.sequential())
    barrier = threading.Barrier(2, timeout=60)
    seen = []

    def pre_hook(mod, args):
        seen.append(mod.__dict__.get("forward"))
        barrier.wait()  # both threads are inside the call at once

    handle = model.register_forward_pre_hook(pre_hook)
    x = torch.randn(2, 8)
    errors = []

    def call():
        try:
            model(x)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    handle.remove()
    assert errors == []
    assert seen == [None, None]  # a hook sees the module as it is, no temporary forward
    assert "forward" not in model.__dict__
    assert torch.equal(pickle.loads(pickle.dumps(model))(x), model(x))


@pytest.mark.parametrize("kind", ["sequential", "transformer"])
def test_torch_nn_containers_still_compile_frames(kind):
    torch._dynamo.reset()
    build, _, shape = checks.MODELS[kind]
    before = _frames()
    _prepare(build())(torch.randn(*shape))
    assert _frames() > before


class _FailsFirst(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.calls = 0

    @torch._dynamo.disable
    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            raise ValueError("first call fails")
        return self.fc(x)


def test_the_check_survives_a_first_call_that_raises():
    torch._dynamo.reset()
    model = _prepare(_FailsFirst())
    x = torch.randn(2, 4)
    with pytest.raises(ValueError):
        model(x)
    msgs = _compile_warnings(lambda: (model(x), model(x)))
    assert len(msgs) == 1 and "_FailsFirst" in msgs[0]


@pytest.mark.parametrize("kind", ["sequential", "subclass"])
def test_a_deepcopy_of_a_prepared_model_is_compiled_too(kind):
    build, _, shape = checks.MODELS[kind]
    model = _prepare(build())
    x = torch.randn(*shape)
    model(x)
    torch._dynamo.reset()
    ema = copy.deepcopy(model)
    before = _frames()
    assert _compile_warnings(lambda: ema(x)) == []
    assert _frames() > before  # the copy's first call compiled it, not eager
    assert torch.equal(ema(x), model(x))
    assert all(a is not b for a, b in zip(ema.parameters(), model.parameters()))
    assert _prepare(ema) is ema and "forward" not in ema.__dict__


@pytest.mark.parametrize("kind", ["sequential", "transformer"])
def test_later_calls_of_a_container_do_not_recompile(kind):
    # torch 2.9: a forward bound anew per call invalidated the cache entry at each call
    torch._dynamo.reset()
    build, _, shape = checks.MODELS[kind]
    model = _prepare(build())
    x = torch.randn(*shape)
    model(x)
    before = checks.dynamo_counts()
    for _ in range(3):
        model(x)
    assert checks.dynamo_counts() == before


def test_a_torch_without_wrap_top_frame_is_supported(monkeypatch):
    # torch._dynamo.config.wrap_top_frame is recent: a torch without it must not raise AttributeError
    import types

    from anyaccel.strategies import compile as compiling

    monkeypatch.setattr(torch._dynamo, "config", types.SimpleNamespace())
    assert compiling._skipped_by_dynamo(checks.sequential()) is True
    assert compiling._skipped_by_dynamo(checks.Net()) is False
