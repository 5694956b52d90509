"""Every name of Accelerate 1.15's ``accelerate.utils`` is in ``anyaccel.utils`` — real, or refused
with its reason — unless this file's table says why it is absent; and the module paths scripts
import from (``accelerate.utils.operations``, ``accelerate.state``, ``accelerate.data_loader``, ...)
exist under ``anyaccel``, so that ``sed s/accelerate/anyaccel/`` on import lines is enough.

Accelerate's names are read from the installed ``accelerate/utils/__init__.py`` (its ``from .x
import ...`` lines), so a new Accelerate version that adds a name makes
:func:`test_every_accelerate_utils_name_is_offered_or_explained` fail until the name is offered or
explained here. Where anyaccel implements a helper, its result is compared with Accelerate's own
function on the same input.
"""

from __future__ import annotations

import collections.abc
import ast
import importlib
import importlib.util
import inspect
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                reason="needs accelerate==1.15.0 (the test extra)")

# Refused: importable from anyaccel.utils (and its submodule of Accelerate's name), raising
# NotImplementedError when used; the reason (anyaccel.utils._refuse.WHY[kind]) names the anyaccel way.
REFUSED = {
    # DeepSpeedPlugin, DummyOptim, DummyScheduler, HfDeepSpeedConfig, ... are real (the deepspeed strategy)
    "deepspeed": ["DeepSpeedSequenceParallelConfig", "compile_regions_deepspeed"],
    "deepspeed_internal": ["DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper", "DeepSpeedSchedulerWrapper"],
    "megatron": ["MegatronLMPlugin"],
    # AORecipeKwargs, TERecipeKwargs, FP8RecipeKwargs, torchao_required and accelerate.utils.ao's helpers are real
    "msamp": ["MSAMPRecipeKwargs"],
    "bnb": ["BnbQuantizationConfig"],
    "tp": ["TorchContextParallelConfig", "TorchTensorParallelConfig",
           "TorchTensorParallelPlugin", "get_model_tp_size"],
    # big-model helpers that anyaccel.big_modeling does not offer (yet); the rest are re-exported from it
    "big_model": ["align_module_device", "calculate_maximum_sizes", "check_tied_parameters_in_config",
                  "check_tied_parameters_on_same_device", "find_tied_parameters", "has_offloaded_params",
                  "id_tensor_storage", "load_offloaded_weights", "load_state_dict", "retie_parameters",
                  "clean_state_dict_for_safetensors"],
    "amp": ["get_grad_scaler", "get_mixed_precision_context_manager"],
    "fsdp_internal": ["disable_fsdp_ram_efficient_loading", "enable_fsdp_ram_efficient_loading",
                      "ensure_weights_retied", "fsdp2_apply_ac", "fsdp2_canonicalize_names",
                      "fsdp2_load_full_state_dict", "fsdp2_prepare_model", "fsdp2_switch_optimizer_parameters",
                      "get_fsdp2_grad_scaler", "load_fsdp_model", "load_fsdp_optimizer", "save_fsdp_model",
                      "save_fsdp_optimizer"],
    "compile_regions": ["compile_regions", "compile_regions_fsdp2"],
    "write_basic_config": ["write_basic_config"],
}

_MEGATRON = "Megatron-LM's training-step classes and engine: anyaccel has no Megatron-LM integration"
_LAUNCH = "Accelerate's launcher internals (building torchrun/DeepSpeed/TPU commands); anyaccel launch replaces them"
_FP8 = ("Transformer Engine's conversion helpers: Accelerator(mixed_precision=\"fp8\", kwargs_handlers="
        "[TERecipeKwargs(...)]) converts and wraps in prepare (anyaccel/precision_te.py); fp8 capability: "
        "accelerator.backend.fp8_support()")
_BNB = "bitsandbytes quantized loading: anyaccel has no quantization integration"
# Absent on purpose: `from anyaccel.utils import X` raises ImportError. Each with its reason.
ABSENT = {
    **dict.fromkeys(["AbstractTrainStep", "BertTrainStep", "GPTTrainStep", "T5TrainStep", "MegatronEngine",
                     "MegatronLMDummyDataLoader", "MegatronLMDummyScheduler", "MegatronLMOptimizerWrapper",
                     "MegatronLMSchedulerWrapper", "avg_losses_across_data_parallel_group",
                     "gather_across_data_parallel_groups", "megatron_lm_initialize",
                     "megatron_lm_prepare_data_loader", "megatron_lm_prepare_model_optimizer_scheduler",
                     "megatron_lm_prepare_optimizer", "megatron_lm_prepare_scheduler",
                     "add_model_config_to_megatron_parser"], _MEGATRON),
    **dict.fromkeys(["PrepareForLaunch", "_filter_args", "prepare_deepspeed_cmd_env", "prepare_multi_gpu_env",
                     "prepare_sagemager_args_inputs", "prepare_simple_launcher_cmd_env", "prepare_tpu",
                     "TORCH_LAUNCH_PARAMS"], _LAUNCH),
    **dict.fromkeys(["apply_fp8_autowrap", "contextual_fp8_autocast", "convert_model",
                     "has_transformer_engine_layers", "check_cuda_fp8_capability"], _FP8),
    **dict.fromkeys(["has_4bit_bnb_layers", "load_and_quantize_model"], _BNB),
    "TORCH_DISTRIBUTED_OPERATION_TYPES": "Accelerate's list of its own distributed types that run collectives; "
                                         "anyaccel's DistributedType has no such grouping",
    "get_current_device_type": "Accelerate's device probe for its launcher; anyaccel: "
                               "anyaccel.resolve_environment().device_type",
    "get_cpu_distributed_information": "Accelerate's CPU/MPI probe for its launcher; anyaccel launch resolves the "
                                       "job once (anyaccel.resolve_environment())",
    "get_gpu_info": "Accelerate's launcher probe; anyaccel: anyaccel env (the environment report)",
    "check_cuda_p2p_ib_support": "Accelerate's launcher probe for consumer GPUs (sets NCCL_P2P_DISABLE); not needed "
                                 "by anyaccel launch",
    "set_numa_affinity": "Accelerate's launcher option; anyaccel launch does not pin processes to NUMA nodes",
    "purge_accelerate_environment": "a test decorator that clears ACCELERATE_* variables; anyaccel is configured "
                                    "by its launcher's arguments, not by ACCELERATE_* variables",
    "install_xla": "installs torch-xla with pip on Colab; install torch-xla as its documentation says",
}

# Accelerate's module paths that user code and Accelerate's scripts import from, with anyaccel's.
MODULE_PATHS = ["utils", "utils.ao", "utils.dataclasses", "utils.operations", "utils.random", "utils.memory", "utils.modeling",
                "utils.imports", "utils.other", "utils.constants", "utils.environment", "utils.versions",
                "utils.tqdm", "utils.deepspeed", "utils.offload", "utils.fsdp_utils", "data_loader", "state",
                "accelerator", "logging", "optimizer", "scheduler", "launchers", "tracking", "hooks", "big_modeling"]


def _accelerate_utils_names():
    """``{name: submodule}`` from the installed accelerate/utils/__init__.py's imports."""
    spec = importlib.util.find_spec("accelerate")
    path = os.path.join(os.path.dirname(spec.origin), "utils", "__init__.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            for alias in node.names:
                names[alias.asname or alias.name] = node.module
    return names


def _refused_kind(value):
    return getattr(value, "anyaccel_refused", None)


def test_every_accelerate_utils_name_is_offered_or_explained():
    from anyaccel import utils

    names = _accelerate_utils_names()
    assert len(names) > 200, "could not read accelerate.utils' names"
    refused = {name: kind for kind, group in REFUSED.items() for name in group}
    assert not set(refused) & set(ABSENT), "a name is listed both as refused and as absent"
    stale = (set(refused) | set(ABSENT)) - set(names)
    assert not stale, f"listed here but not in Accelerate's accelerate.utils: {sorted(stale)}"
    unexplained = sorted(n for n in names if not hasattr(utils, n) and n not in ABSENT)
    assert not unexplained, f"accelerate.utils names anyaccel.utils neither offers nor explains: {unexplained}"
    now_present = sorted(n for n in ABSENT if hasattr(utils, n))
    assert not now_present, f"offered now: remove from ABSENT: {now_present}"
    wrong = {n: (_refused_kind(getattr(utils, n)), k) for n, k in refused.items()
             if _refused_kind(getattr(utils, n, None)) != k}
    assert not wrong, f"refused with another reason than the table says (got, table): {wrong}"
    unlisted = sorted(n for n in names if hasattr(utils, n) and _refused_kind(getattr(utils, n)) and n not in refused)
    assert not unlisted, f"refused but not in REFUSED: {unlisted}"


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_refused_names_raise_with_the_reason(kind):
    from anyaccel import utils
    from anyaccel.utils._refuse import WHY

    for name in REFUSED[kind]:
        with pytest.raises(NotImplementedError) as info:
            getattr(utils, name)()
        assert str(info.value) == f"{name}: {WHY[kind]}"
    if kind == "big_model":
        assert "anyaccel.big_modeling" in WHY[kind]


def test_accelerates_module_paths_exist_with_the_same_names():
    """``from accelerate.X import N`` → ``from anyaccel.X import N`` works for every name
    Accelerate's ``accelerate.utils`` takes from submodule X and for the names Accelerate's
    scripts and user code import from state, data_loader, accelerator, logging, optimizer,
    scheduler, launchers and tracking."""
    names = _accelerate_utils_names()
    for path in MODULE_PATHS:
        module = importlib.import_module(f"anyaccel.{path}")
        if path.startswith("utils."):
            sub = path.split(".", 1)[1]
            missing = [n for n, m in names.items() if m == sub and n not in ABSENT and not hasattr(module, n)]
            assert not missing, f"anyaccel.{path} lacks {missing}"
    expected = {"state": ["PartialState", "AcceleratorState", "GradientState"],
                "data_loader": ["prepare_data_loader", "skip_first_batches", "SeedableRandomSampler",
                                "DataLoaderShard", "DataLoaderDispatcher"],
                "accelerator": ["Accelerator", "DataLoaderConfiguration", "GradientAccumulationPlugin",
                                "ProjectConfiguration", "DistributedType", "AcceleratorState", "GradientState"],
                "logging": ["get_logger", "MultiProcessAdapter"],
                "optimizer": ["AcceleratedOptimizer"], "scheduler": ["AcceleratedScheduler"],
                "launchers": ["notebook_launcher", "debug_launcher"],
                "tracking": ["GeneralTracker", "TensorBoardTracker", "WandBTracker", "MLflowTracker"]}
    for path, wanted in expected.items():
        module = importlib.import_module(f"anyaccel.{path}")
        assert [n for n in wanted if not hasattr(module, n)] == [], path


def test_one_home_per_name():
    """Re-exports are the same objects as their homes (no second copy)."""
    import anyaccel
    from anyaccel import data_loader, errors, memory, state, utils
    from anyaccel.accumulation import GradientState
    from anyaccel.data import accelerate_names

    assert utils.find_executable_batch_size is memory.find_executable_batch_size is anyaccel.find_executable_batch_size
    assert utils.release_memory is memory.release_memory
    assert state.GradientState is GradientState is anyaccel.GradientState
    assert data_loader.prepare_data_loader is accelerate_names.prepare_data_loader
    from anyaccel import launchers, optimizer, scheduler, stepping
    from anyaccel.launch import notebook

    assert optimizer.AcceleratedOptimizer is stepping.AcceleratedOptimizer
    assert scheduler.AcceleratedScheduler is stepping.AcceleratedScheduler
    assert launchers.notebook_launcher is notebook.notebook_launcher is anyaccel.notebook_launcher
    assert utils.operations.gather is utils.gather
    assert utils.DistributedOperationException is errors.ShapeMismatchError


def _accelerate_signature_defaults(name, submodule):
    """Accelerate's defaults of ``accelerate.utils.<name>``, read from the submodule it is imported
    from (``accelerate.utils`` imports some names only when an extra such as DeepSpeed is there)."""
    import accelerate.utils as a

    found = getattr(a, name, None)
    if found is None and submodule:
        found = getattr(importlib.import_module(f"accelerate.utils.{submodule}"), name, None)
    try:
        return {k: p.default for k, p in inspect.signature(found).parameters.items()}
    except (TypeError, ValueError):
        return None


def test_real_functions_take_accelerates_arguments_with_its_defaults():
    """Every function anyaccel.utils really implements accepts Accelerate's parameters, with
    Accelerate's default values."""
    from anyaccel import utils

    differ = {}
    for name, submodule in _accelerate_utils_names().items():
        ours = getattr(utils, name, None)
        if ours is None or _refused_kind(ours) or not inspect.isfunction(ours):
            continue
        theirs = _accelerate_signature_defaults(name, submodule)
        if theirs is None:
            continue
        mine = {k: p.default for k, p in inspect.signature(ours).parameters.items()}
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(ours).parameters.values())
        for param, default in theirs.items():
            if param in ("args", "kwargs"):
                continue
            if param not in mine and not has_var_kw:
                differ[name] = f"no parameter {param!r}"
            elif param in mine and mine[param] != default and not (
                    inspect.isfunction(default) and getattr(mine[param], "__name__", None) == default.__name__):
                differ[name] = f"{param}={mine[param]!r}, Accelerate {default!r}"
    assert not differ, differ


class _Frozen(collections.abc.Mapping):
    """A mapping that is not a dict (as some libraries' batch types are)."""

    def __init__(self, items):
        self._items = dict(items)

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


def _same(a, b):
    import dataclasses

    if dataclasses.is_dataclass(a):
        return dataclasses.astuple(a) == dataclasses.astuple(b)
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.device == b.device
                and (a.device.type == "meta" or torch.equal(a, b)))
    if isinstance(a, collections.abc.Mapping):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_nested_helpers_answer_as_accelerates():
    """The local helpers give what Accelerate's own functions give on the same nested data."""
    import collections

    import accelerate.utils as theirs

    from anyaccel import utils as ours

    Point = collections.namedtuple("Point", "x y")
    data = {"a": torch.arange(6.0).reshape(3, 2),
            "b": [torch.ones(3, dtype=torch.bfloat16), Point(torch.zeros(3, 1), 5)], "c": "text"}
    batches = [{"a": torch.ones(2, 2) * i, "b": (torch.arange(2) + i,)} for i in range(3)]
    # nested mappings that are not dicts, keys to skip at every depth
    moving = {"x": torch.ones(2), "keep": torch.ones(2), "inner": _Frozen({"keep": torch.zeros(1), "y": torch.zeros(1)}),
              "l": [_Frozen({"keep": torch.ones(1), "z": torch.ones(1)})]}
    cases = [
        ("find_batch_size", (data,), {}), ("ignorant_find_batch_size", ("x",), {}), ("listify", (data,), {}),
        ("slice_tensors", (data, slice(0, 2)), {}), ("concatenate", (batches,), {}), ("concatenate", (["x"],), {}),
        ("find_device", (data,), {}), ("convert_to_fp32", (data,), {}), ("is_namedtuple", (Point(1, 2),), {}),
        ("recursively_apply", (lambda t: t * 2, data), {}),
        ("pad_input_tensors", ({"x": torch.ones(3, 4)}, 3, 4), {}),
        ("pad_input_tensors", (torch.ones(5, 2), 5, 2), {}),
        ("convert_bytes", (3 * 1024 ** 3,), {}), ("get_pretty_name", (torch.nn.Linear(1, 1),), {}),
        ("merge_dicts", ({"a": {"b": 1}}, {"a": {"c": 2}}), {}),
        ("recursive_getattr", (torch.nn.Sequential(torch.nn.Linear(1, 2)), "0.out_features"), {}),
        ("str_to_bool", ("Yes",), {}), ("str_to_bool", ("off",), {"to_bool": True}),
        ("compare_versions", ("torch", ">=", "2.0"), {}), ("is_torch_version", ("<", "1.0"), {}),
        ("convert_dict_to_env_variables", ({"A": "1", "B C": "2"},), {}),
        ("send_to_device", (moving, "meta"), {}), ("send_to_device", (moving, "meta"), {"skip_keys": "keep"}),
        ("send_to_device", (moving, "meta"), {"skip_keys": ["keep", "y"]}),
        ("send_to_device", ([_Frozen({"a": torch.ones(1)}), Point(torch.ones(1), 2)], "meta"), {}),
    ]
    for name, args, kwargs in cases:
        assert _same(getattr(ours, name)(*args, **kwargs), getattr(theirs, name)(*args, **kwargs)), name
    structure = ours.get_data_structure(data)
    assert _same(structure, theirs.get_data_structure(data))
    assert [t.shape for t in ours.initialize_tensors(structure)["b"][:1]] == [torch.Size([3])]
    model = torch.nn.Sequential(torch.nn.Linear(1, 2), torch.nn.Sequential(torch.nn.ReLU()))
    assert ours.get_module_children_bottom_up(model, True) == theirs.get_module_children_bottom_up(model, True)
    for bad in ([], {"a": "x"}):
        for fn in (ours.find_batch_size, theirs.find_batch_size):
            with pytest.raises((ValueError, TypeError)):
                fn(bad)
    with pytest.raises(TypeError):
        ours.recursively_apply(lambda t: t, {"a": "x"}, error_on_other_type=True)


def test_enums_and_environment_helpers_match_accelerates():
    import os

    import accelerate.utils as theirs

    from anyaccel import utils as ours

    for enum_name in ("PrecisionType", "RNGType", "DynamoBackend", "DDPCommunicationHookType", "ComputeEnvironment",
                      "SageMakerDistributedType", "CustomDtype"):
        a, b = getattr(ours, enum_name), getattr(theirs, enum_name)
        assert [(m.name, m.value) for m in a] == [(m.name, m.value) for m in b], enum_name
    assert ours.PrecisionType.list() == theirs.PrecisionType.list() and "bf16" in ours.PrecisionType
    assert str(ours.RNGType.TORCH) == "torch" and "nope" not in ours.RNGType
    os.environ["ANYACCEL_TEST_KEEP"] = "old"
    with ours.patch_environment(anyaccel_test_keep=1, anyaccel_test_new="x"):
        assert os.environ["ANYACCEL_TEST_KEEP"] == "1" and os.environ["ANYACCEL_TEST_NEW"] == "x"
        with ours.clear_environment():
            assert "ANYACCEL_TEST_KEEP" not in os.environ
        assert ours.parse_flag_from_env("ANYACCEL_TEST_KEEP") is True
    assert os.environ.pop("ANYACCEL_TEST_KEEP") == "old" and "ANYACCEL_TEST_NEW" not in os.environ
    assert ours.get_int_from_env(["ANYACCEL_UNSET_X"], 7) == 7

    @ours.find_executable_batch_size(starting_batch_size=8)
    def run(batch_size):
        if batch_size > 2:
            raise RuntimeError("CUDA out of memory")
        return batch_size

    assert run() == 2


def test_kwargs_handler_and_constants():
    import dataclasses

    import accelerate.utils as theirs

    from anyaccel import utils as ours

    @dataclasses.dataclass
    class MyKwargs(ours.KwargsHandler):
        a: int = 1
        b: str = "x"

    assert MyKwargs(a=2).to_kwargs() == {"a": 2}
    for name in ours.constants.__all__:
        assert getattr(ours, name) == getattr(theirs, name), name


def test_integrations_anyaccel_lacks_answer_false():
    from anyaccel import utils

    for name in ("is_megatron_lm_available", "is_bnb_available", "is_msamp_available",
                 "is_transformer_engine_mxfp8_available", "is_xpu_available", "is_npu_available", "is_hpu_available"):
        assert getattr(utils, name)() is False, name
    # fp8 is an integration anyaccel has (torchao, Transformer Engine): the checks say what is installed
    has = {m: importlib.util.find_spec(m) is not None for m in ("torchao", "transformer_engine")}
    assert utils.is_torchao_available() is has["torchao"]
    assert utils.is_transformer_engine_available() is has["transformer_engine"]
    assert utils.is_fp8_available() is (has["torchao"] or has["transformer_engine"])
    assert utils.is_pytest_available() is True and utils.is_torchvision_available() is (
        importlib.util.find_spec("torchvision") is not None)
    # DeepSpeed is an integration anyaccel has: the check says whether it is installed
    assert utils.is_deepspeed_available() is (importlib.util.find_spec("deepspeed") is not None)


# Module paths of Accelerate that anyaccel does not have (see docs/guides/accelerate.md, "absent").
ABSENT_MODULES = {"anyaccel.inference", "anyaccel.commands"}


def test_every_shipped_script_imports_after_sed():
    """The import lines of every test script Accelerate ships, rewritten by ``sed``, import —
    except those naming a module listed in ABSENT_MODULES."""
    import glob

    from accelerate_compat import worker

    root = worker.scripts_dir()
    paths = sorted(glob.glob(os.path.join(root, "*.py")) + glob.glob(os.path.join(root, "external_deps", "*.py")))
    assert len(paths) > 10
    failures, skipped = [], set()
    for path in paths:
        with open(path) as f:
            tree = ast.parse(worker.sed_imports(f.read()))
        for node in ast.walk(tree):
            module = node.module if isinstance(node, ast.ImportFrom) else \
                node.names[0].name if isinstance(node, ast.Import) else None
            if not module or not module.startswith("anyaccel"):
                continue
            if any(module == m or module.startswith(m + ".") for m in ABSENT_MODULES):
                skipped.add(module.split(".")[1])
                continue
            try:
                exec(compile(ast.Module([node], []), path, "exec"), {})
            except ImportError as exc:
                failures.append(f"{os.path.relpath(path, root)}: {ast.unparse(node)}: {exc}")
    assert not failures, failures
    assert skipped == {m.split(".")[1] for m in ABSENT_MODULES}, "an ABSENT_MODULES entry is no longer needed"


def test_set_seed_device_specific_uses_the_launchers_rank_before_an_accelerator():
    """Accelerate's set_seed(device_specific=True) adds AcceleratorState().process_index, which
    is the launcher's rank even before any process group exists; it leaves PYTHONHASHSEED alone."""
    import subprocess
    import sys

    from conftest import clean_env

    script = ("import os, torch\nfrom anyaccel.utils import set_seed\nset_seed(10, device_specific=True)\n"
              "drawn = torch.rand(3)\ntorch.manual_seed(11)\n"
              "print(torch.equal(drawn, torch.rand(3)), 'PYTHONHASHSEED' in os.environ)\n")
    env = clean_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT="29555")
    env.pop("PYTHONHASHSEED", None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]
