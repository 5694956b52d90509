"""The two seams (Backend per device, Strategy per way of wrapping) and the rules they keep.

Single-process tests: registries, selection, extension by a user, and the architectural rule that
only backends know devices (checked on the source, so a regression is caught where it is written).
"""

import ast
import dataclasses
import os
import pathlib

import pytest
import torch

import anyaccel
from anyaccel import Accelerator, backends, strategies
from anyaccel.backends.base import Backend
from anyaccel.detectors import Detector, detectors, register_detector
from anyaccel.environment import Environment, resolve_environment
from anyaccel.strategies.base import Strategy

PACKAGE = pathlib.Path(anyaccel.__file__).parent


# ------------------------------------------------------------------------------------------
# Backends
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device_type, name", [("cpu", "CpuBackend"), ("cuda", "CudaBackend"), ("mps", "MpsBackend")])
def test_each_device_type_has_one_backend_class(device_type, name):
    cls = backends.backend_class(device_type)
    assert cls.__name__ == name and cls.device_type == device_type and issubclass(cls, Backend)


def test_unknown_device_type_names_the_known_ones():
    with pytest.raises(ValueError, match="no anyaccel backend for device type 'npu'; known: cpu, cuda, mps, xla"):
        backends.backend_class("npu")


def test_the_accelerator_gets_its_backend_and_strategy_from_the_environment():
    acc = Accelerator(cpu=True)
    assert type(acc.backend).__name__ == "CpuBackend" and acc.backend.device == acc.device == torch.device("cpu")
    assert acc.strategy.name == "single"


def test_a_new_device_is_one_class_and_one_registration(monkeypatch):
    """What adding a device takes: a Backend subclass, registered with its runtime probe."""
    import sys
    import types

    class FakeBackend(Backend):
        device_type = "cpu"  # it runs on the CPU underneath; only its identity is new
        autocast_device_type = "cpu"
        seeded = []

        @classmethod
        def manual_seed(cls, seed):
            cls.seeded.append(seed)

    module = types.ModuleType("fake_device_backend")
    module.FakeBackend = FakeBackend
    monkeypatch.setitem(sys.modules, "fake_device_backend", module)
    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))
    backends.register_backend("fakedev", "fake_device_backend:FakeBackend", lambda: True)
    assert backends.backend_class("fakedev") is FakeBackend
    anyaccel.set_seed(5)  # per-process work reaches every started backend
    assert FakeBackend.seeded == [5]
    env = dataclasses.replace(resolve_environment({}), device_type="fakedev")
    backend = backends.create_backend(env)
    assert isinstance(backend, FakeBackend)
    assert strategies.create_strategy(env, backend).name == "single"


# ------------------------------------------------------------------------------------------
# Strategies
# ------------------------------------------------------------------------------------------


def _env(world):
    return Environment(world_size=world, rank=0, local_world_size=world, source="test", backend="gloo")


def test_strategy_selection():
    cpu = backends.backend_class("cpu")
    assert strategies.create_strategy(_env(1), cpu(_env(1))).name == "single"
    assert strategies.create_strategy(_env(2), cpu(_env(2))).name == "ddp"
    assert strategies.create_strategy(_env(1), cpu(_env(1)), "ddp").name == "ddp"

    class OwnDefault(cpu):
        default_strategy = "single"

    assert strategies.create_strategy(_env(2), OwnDefault(_env(2))).name == "single"  # e.g. XLA's "xla"
    with pytest.raises(ValueError, match="strategy='zero3' is unknown; choose one of auto, single, ddp, fsdp"):
        strategies.create_strategy(_env(1), cpu(_env(1)), "zero3")


def test_a_new_strategy_is_one_class_and_one_registration(monkeypatch):
    import sys
    import types

    class Doubled(Strategy):
        name = "doubled"

        def wrap(self, model):
            return torch.nn.Sequential(model)

        def unwrap(self, model):
            return model[0] if isinstance(model, torch.nn.Sequential) else model

    module = types.ModuleType("doubled_strategy")
    module.Doubled = Doubled
    monkeypatch.setitem(sys.modules, "doubled_strategy", module)
    monkeypatch.setattr(strategies, "_REGISTRY", dict(strategies._REGISTRY))
    strategies.register_strategy("doubled", "doubled_strategy:Doubled")
    cpu = backends.backend_class("cpu")(_env(1))
    cpu.setup()
    strategy = strategies.create_strategy(_env(1), cpu, "doubled")
    inner = torch.nn.Linear(2, 2)
    wrapped = strategy.prepare_model(inner, device_placement=True, evaluation_mode=False)
    assert isinstance(wrapped, torch.nn.Sequential) and strategy.unwrap(wrapped) is inner
    assert set(strategy.model_state_dict(wrapped)) == {"weight", "bias"}  # user's keys, no wrapper prefix


def test_unwrap_sees_through_compile_wrappers_without_compiling():
    inner = torch.nn.Linear(2, 2)
    compiled = torch.compile(inner)  # building the wrapper does not compile anything yet
    strategy = Strategy(_env(1), None)
    assert strategy.unwrap(compiled) is inner
    assert set(strategy.model_state_dict(compiled)) == {"weight", "bias"}


# ------------------------------------------------------------------------------------------
# Detectors
# ------------------------------------------------------------------------------------------


def test_a_user_detector_is_asked_in_order(monkeypatch):
    monkeypatch.setattr("anyaccel.detectors._DETECTORS", list(detectors()))

    class Sched(Detector):
        name = "mysched"

        def detect(self, env):
            if "MYSCHED_RANK" not in env:
                return None
            return dict(source=self.name, rank=int(env["MYSCHED_RANK"]), world_size=int(env["MYSCHED_SIZE"]),
                        local_rank=0, local_world_size=1, main_address="head", main_port=29500)

    register_detector(Sched(), before="slurm")
    assert [d.name for d in detectors()] == ["torchrun", "mysched", "slurm", "mpi", "xla"]
    env = resolve_environment({"MYSCHED_RANK": "3", "MYSCHED_SIZE": "4", "SLURM_JOB_ID": "1", "SLURM_PROCID": "0"})
    assert (env.source, env.rank, env.world_size, env.main_address) == ("mysched", 3, 4, "head")
    with pytest.raises(ValueError, match="no such detector; known"):
        register_detector(Sched(), before="pbs")


# ------------------------------------------------------------------------------------------
# The rule behind the seams, read from the source
# ------------------------------------------------------------------------------------------

# Device knowledge lives in backends/ and in environment/devices.py (the low half of the device seam, which the
# environment reads); strategy knowledge in strategies/. Everywhere else a device or strategy name
# is a string constant that must not appear (docstrings aside): not compared with, not listed in a
# tuple, set or dict. Plain text in messages rarely *equals* a name, so it passes.
DEVICE_NAMES = {"cuda", "xla", "mps", "xpu", "npu", "hpu"}
STRATEGY_NAMES = {"ddp", "fsdp"}
DEVICE_HOMES = ("backends/", "environment/devices.py")
STRATEGY_HOMES = ("strategies/",)

# (module, name) found outside its home, each with why it is there. Shrink it; never grow it
# without a reason a reviewer accepts.
KNOWN = {
    # user-facing vocabulary, for good
    ("environment/detectors.py", "xla"): "the XLA launcher's detector names its source; DeviceFacts(selected_by=...) refers to it",
    ("strategies/__init__.py", "xla"): "the XLA strategy's registration (a strategy bound to one device)",
    ("strategies/xla.py", "xla"): "the XLA strategy's name and device (a strategy bound to one device)",
    ("compat/utils/dataclasses.py", "cuda"): "Accelerate's RNGType enum values (Accelerate's user-facing vocabulary)",
    ("compat/utils/dataclasses.py", "npu"): "Accelerate's RNGType enum values (Accelerate's user-facing vocabulary)",
    ("compat/utils/dataclasses.py", "xla"): "Accelerate's RNGType enum values (Accelerate's user-facing vocabulary)",
    ("compat/utils/dataclasses.py", "xpu"): "Accelerate's RNGType enum values (Accelerate's user-facing vocabulary)",
    ("compat/utils/dataclasses.py", "hpu"): "Accelerate's RNGType enum values (Accelerate's user-facing vocabulary)",
    ("test_utils/testing.py", "cuda"): "Accelerate's require_cuda/require_single_gpu/... test decorators (its "
                                       "test vocabulary); counts come from the device registry",
    ("test_utils/testing.py", "xpu"): "Accelerate's require_xpu/require_non_xpu/... test decorators",
    ("test_utils/testing.py", "hpu"): "Accelerate's require_non_hpu test decorator",
    ("compat/utils/imports.py", "xpu"): "Accelerate's is_xpu_available name; the answer comes from the backend registry",
    ("compat/utils/imports.py", "npu"): "Accelerate's is_npu_available name; the answer comes from the backend registry",
    ("compat/utils/imports.py", "hpu"): "Accelerate's is_hpu_available name; the answer comes from the backend registry",
    # Accelerate's plugin slot: `state.fsdp_plugin` / `accelerator.state.fsdp_plugin` hold the user's
    # FullyShardedDataParallelPlugin under the key "fsdp"; which strategy runs is decided in
    # compat/arguments.resolve_options and reported by Strategy.distributed_type, not here.
    ("accelerator.py", "fsdp"): "Accelerate's plugin slot name (the fsdp_plugin the user passed)",
    ("compat/state.py", "fsdp"): "Accelerate's plugin slot name (state.fsdp_plugin)",
    ("launch/plan.py", "xla"): "LaunchPlan.mode 'xla' names torch-xla's own launcher (runner._run_xla); "
                               "which device it applies to is DeviceFacts.owns_processes",
    ("cli/env_report.py", "torch.version.cuda"): "`anyaccel env`'s PyTorch line: the CUDA version torch was built "
                                             "with (a property of the wheel, not a device)",
}


def _docstrings(tree):
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def _torch_path(node):
    """``"torch.backends.mps"`` for an attribute chain rooted at the name ``torch``, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join(["torch"] + parts[::-1]) if isinstance(node, ast.Name) and node.id == "torch" else None


def seam_leaks(relative, tree):
    """(line, name) of every device or strategy name outside its home in one module's ``tree``: a
    string constant equal to one (compared, listed in a tuple/list/set/dict, passed, returned) or
    naming one of its devices (``"cuda:0"``), a ``torch.<...>.<device>`` attribute, an import of
    ``torch.<device>`` or ``torch.backends.<device>``."""
    device_home, strategy_home = relative.startswith(DEVICE_HOMES), relative.startswith(STRATEGY_HOMES)
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if (node.value in DEVICE_NAMES and not device_home) or (node.value in STRATEGY_NAMES and not strategy_home):
                yield node.lineno, node.value
            elif not device_home and node.value.partition(":")[0] in DEVICE_NAMES and node.value.partition(":")[2].isdigit():
                yield node.lineno, node.value
        if device_home:
            continue
        if isinstance(node, ast.Attribute) and node.attr in DEVICE_NAMES and _torch_path(node):
            yield node.lineno, _torch_path(node)
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        for module in modules:
            parts = module.split(".")
            if parts[0] == "torch" and DEVICE_NAMES & set(parts):
                yield node.lineno, module


def _leaks():
    found, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for line, name in seam_leaks(relative, ast.parse(path.read_text())):
            if (relative, name) in KNOWN:
                used.add((relative, name))
            else:
                found.append(f"{relative}:{line} {name!r}")
    return found, used


def test_only_backends_know_devices_and_only_strategies_know_strategies():
    found, used = _leaks()
    assert not found, ("device or strategy names outside anyaccel/backends (+ devices.py) and anyaccel/strategies; "
                       "ask the backend or strategy registry: " + "; ".join(found))
    stale = sorted(set(KNOWN) - used)
    assert not stale, f"KNOWN lists leaks that are gone; delete these entries: {stale}"


def test_the_seam_scan_catches_lists_comparisons_and_torch_attributes():
    source = """
\"\"\"A docstring may say cuda.\"\"\"
_TYPES = ("torch", "cuda", "generator")
_BY = {"mps": 1}
if kind == "xla": pass
if strategy in {"ddp"}: pass
ONE_PROCESS = ["mps", "cpu"]
device = torch.device("cuda:0")
torch.cuda.synchronize()
ok = torch.backends.mps.is_available()
from torch.cuda import amp
import torch.backends.mps
message = f"cannot run on {device}"
"""
    leaks = sorted(name for _, name in seam_leaks("kwargs.py", ast.parse(source)))
    assert leaks == ["cuda", "cuda:0", "ddp", "mps", "mps", "torch.backends.mps", "torch.backends.mps",
                     "torch.cuda", "torch.cuda", "xla"]
    assert sorted(name for _, name in seam_leaks("strategies/ddp.py", ast.parse(source))) == [
        "cuda", "cuda:0", "mps", "mps", "torch.backends.mps", "torch.backends.mps", "torch.cuda", "torch.cuda", "xla"]
    assert list(seam_leaks("backends/cuda.py", ast.parse(source))) == [(6, "ddp")]  # a device's home knows devices


def test_the_seam_scan_covers_the_modules_that_spoke_device_names():
    """The config file's device vocabulary, the launch planner's device rules, ``anyaccel env`` and
    the self-test ask the backend registry now; their old spellings are what the scan reports."""
    old = {
        "config/schema.py": 'choices = ("auto", "cpu", "gpu", "tpu", "mps")\nbad = cfg.device == "mps" and n > 1\n',
        "config/wizard.py": 'detected = {"gpus": 0, "tpu": False, "mps": True}\n',
        "launch/plan.py": 'if device in ("cpu", "gpu", "tpu", "mps"): pass\n',
        "cli/env_report.py": "n = torch.cuda.device_count()\n",
        "cli/selftest_worker.py": 'if want in ("cpu", "mps"): pass\nok = device.type == "cuda"\n',
    }
    for relative, source in old.items():
        assert (PACKAGE / relative).exists(), relative
        assert list(seam_leaks(relative, ast.parse(source))), f"{relative}: the scan missed {source!r}"


def test_only_the_xla_backend_imports_torch_xla():
    importers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "torch_xla" or n.startswith("torch_xla.") for n in names):
                importers.append(str(path.relative_to(PACKAGE)))
    assert sorted(set(importers)) == [os.path.join("backends", "xla.py")]


def test_only_the_mesh_object_builds_device_meshes():
    """One object knows the mesh (issue 38): ``init_device_mesh`` is called in
    anyaccel/strategies/mesh.py only; everything else asks ``strategy.process_mesh``."""
    callers = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                     if any(isinstance(node, ast.Name) and node.id == "init_device_mesh" or
                            isinstance(node, ast.Attribute) and node.attr == "init_device_mesh" or
                            isinstance(node, ast.alias) and node.name == "init_device_mesh"
                            for node in ast.walk(ast.parse(path.read_text()))))
    assert callers == [os.path.join("strategies", "mesh.py")]


def test_modules_stay_small_or_say_why():
    """A module over ~450 lines usually holds two ideas; the exceptions say why at their top."""
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 450:
            head = ast.get_docstring(ast.parse(text)) or ""
            assert "longer than" in head, f"{path.relative_to(PACKAGE)} has {text.count(chr(10))} lines and no reason"


#: The option table (core) names three objects of the Accelerate layer, loaded on first use: the
#: config file's fsdp_config and deepspeed_config sections are Accelerate's formats, checked by
#: building the plugin they describe. import-linter sees imports, not these names; no more may come.
KNOWN_COMPAT_REFS = {"anyaccel.compat.plugins:fsdp_plugin_from_dict",
                     "anyaccel.compat.utils.deepspeed:deepspeed_plugin_from_settings",
                     "anyaccel.compat.plugins:FSDP_STATE_DICT_TYPES"}


def test_the_core_names_no_more_of_the_accelerate_layer_than_the_known_section_checks():
    import re

    core = [path for path in PACKAGE.rglob("*.py") if "compat" not in path.parts and path.parent.name != "utils"]
    named = {m for path in core for m in re.findall(r'"(anyaccel\.compat[\w.]*:\w+)"', path.read_text())}
    assert named <= KNOWN_COMPAT_REFS, f"core modules name the Accelerate layer by string: {named - KNOWN_COMPAT_REFS}"
    for ref in KNOWN_COMPAT_REFS:  # each still exists (the Ref would fail at first use otherwise)
        from anyaccel.optionspec import Ref

        assert Ref(ref).load() is not None


def test_functions_stay_short_or_say_why():
    """A function over ~60 lines usually does two things (issue 30); the exceptions say why in
    their docstring ("longer than 60 lines: ...")."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                if "longer than 60 lines" not in (ast.get_docstring(node) or "").lower():
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} "
                                f"({node.end_lineno - node.lineno + 1} lines)")
    assert not long, f"functions over 60 lines without a reason: {long}"


class _FakeGpus:
    """Two visible GPUs' generator states, in a process whose own GPU is ``current`` (no CUDA
    here: only CudaBackend's rule for which generator takes which saved state is checked)."""

    def __init__(self, current, states):
        self.current, self.states = current, list(states)

    def install(self, monkeypatch):
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "device_count", lambda: len(self.states))
        monkeypatch.setattr(cuda, "get_rng_state_all", lambda: list(self.states))
        monkeypatch.setattr(cuda, "set_rng_state_all", lambda states: self.states.__setitem__(slice(None), states))
        monkeypatch.setattr(cuda, "set_rng_state", lambda s: self.states.__setitem__(self.current, s))


def test_cuda_rng_state_from_rank_0_lands_on_the_gpu_rank_1_draws_from(monkeypatch):
    # synchronize_rng_state("cuda"): rank 1 (cuda:1) adopts rank 0's state; rank 0 drew from cuda:0
    from anyaccel.backends.cuda import CudaBackend

    rank0 = _FakeGpus(current=0, states=["r0-used", "r0-untouched"])
    rank0.install(monkeypatch)
    sent = CudaBackend.get_rng_state()
    rank1 = _FakeGpus(current=1, states=["r1-untouched", "r1-used"])
    rank1.install(monkeypatch)
    CudaBackend.set_rng_state(sent)
    assert rank1.states[1] == "r0-used"  # before: "r0-untouched", so the ranks drew different numbers


def test_cuda_rng_state_restored_by_the_same_rank_puts_every_generator_back(monkeypatch):
    from anyaccel.backends.cuda import CudaBackend

    gpus = _FakeGpus(current=1, states=["a", "b"])
    gpus.install(monkeypatch)
    saved = CudaBackend.get_rng_state()
    gpus.states[:] = ["x", "y"]
    CudaBackend.set_rng_state(saved)
    assert gpus.states == ["a", "b"]
    one = _FakeGpus(current=0, states=["z"])  # restored where only this rank's GPU is visible
    one.install(monkeypatch)
    CudaBackend.set_rng_state(saved)
    assert one.states == ["b"]  # the saving rank's own GPU (cuda:1), not cuda:0's state
    CudaBackend.set_rng_state(["old-list-0", "old-list-1"])  # a checkpoint of the earlier list format
    assert one.states == ["old-list-0"]
