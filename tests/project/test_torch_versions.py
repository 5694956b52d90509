"""The code that depends on torch's version, and the tests that run it on the oldest torch.

`make test-wheel` does not run the whole suite a second time on torch 2.9 (`make test` runs it on
2.13): it runs the tests marked ``torch_versions`` (scripts/test_wheel.sh). This file keeps that
selection honest. A scan of ``anyaccel/`` finds every place that reads torch's version, imports a
private torch module (``torch._dynamo``, ``torch.distributed.tensor._utils``, ...), reads a
private attribute of torch's process groups, or looks at a signature or the source of a torch
function; ``anyaccel/launch/agent.py`` (torch's elastic agent, subclassed) counts as a whole. Each
place must be listed below, in one of three tables:

* :data:`RUN_ON_OLDEST` — the tests, marked ``torch_versions``, that run it (found by tracing the
  unit suite, 2026-11-28): `make test-wheel` runs them on torch 2.9;
* :data:`MULTI_PROCESS_ONLY` — only multi-process jobs of `make test` reach it, on torch 2.13: the
  known gap of the wheel step (its launch tests are the only jobs it starts);
* :data:`NOT_VERSION_DEPENDENT` — what the scan finds but is not a torch-version difference, and why.

A new version check, private import or signature test fails here until it is placed (and, for
``RUN_ON_OLDEST``, a test that runs it is marked); a place that moves or goes fails until its row
follows it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[2]

#: what makes a line torch-version dependent (comments and docstrings are not read)
PATTERN = re.compile(
    r"torch\.__version__|is_torch_version\(|\btorch(?:\.[a-z_]+)*\._[a-z]|from torch(?:\.[a-z_]+)*\._[a-z]|"
    r"import torch(?:\.[a-z_]+)*\._[a-z]|distributed_c10d\._|(?:getattr|hasattr)\((?:torch|dist)(?:\.[a-z_]+)*, |"
    r"inspect\.(?:signature|getsource)\(")
#: modules that are torch internals as a whole (their own contract test names each member they use)
WHOLE_MODULES = ("anyaccel/launch/agent.py",)

_ELASTIC = "tests/launch/test_elastic.py"
_LAUNCH = "tests/launch/test_launch_multiprocess.py"
_NOTEBOOK = "tests/launch/test_notebook_launcher_multiprocess.py"
_COMPILE = "tests/strategies/test_compile.py"

RUN_ON_OLDEST: Dict[str, List[str]] = {
    "anyaccel/launch/agent.py": [_ELASTIC, f"{_LAUNCH}::test_a_raising_rank_stops_the_job_and_is_reported_once",
                                 f"{_LAUNCH}::test_max_restarts_restarts_the_whole_group",
                                 "tests/process/test_preemption_multiprocess.py::"
                                 "test_sigterm_to_the_launcher_checkpoints_exits_75_without_restart_and_resumes_bitwise"],
    "anyaccel/backends/transport.py:<module>": [_NOTEBOOK],
    # (the launch tests that also reach these two are not rerun on torch 2.9 for them: the notebook's
    # jobs run the same functions, and the c10d test below forms a group of two machines)
    "anyaccel/backends/transport.py:_all_gather_single": [_NOTEBOOK],
    "anyaccel/process/process_group.py:ensure_process_group": [
        _NOTEBOOK, f"{_LAUNCH}::test_two_machines_on_the_c10d_rendezvous_meet_at_the_main_address"],
    "anyaccel/process/process_group.py:keep_all": [_NOTEBOOK],
    "anyaccel/process/process_group.py:_has_gloo_group": [_NOTEBOOK, f"{_LAUNCH}::test_a_killed_rank_stops_the_others_within_seconds"],
    "anyaccel/training/memory.py:should_reduce_batch_size": ["tests/training/test_memory.py"],
    "anyaccel/strategies/compile.py:dynamo_counts": [_COMPILE],
    "anyaccel/strategies/compile.py:_call_impl_with_forward": [_COMPILE],
    "anyaccel/strategies/compile.py:_skipped_by_dynamo": [_COMPILE],
    "anyaccel/strategies/compile.py:_cached": [_COMPILE],
    "anyaccel/strategies/compile.py:_graph_break_reasons": [_COMPILE],
    "anyaccel/strategies/compile.py:_why_nothing": [_COMPILE],
    "anyaccel/big_modeling/sharded_load.py:local_index": [
        "tests/strategies/test_ties.py::test_a_meta_model_keeps_its_tie_and_is_filled_once_like_an_eager_build"],
    "anyaccel/compat/utils/versions.py:<module>": ["tests/compat/test_compat_api.py::test_accelerates_version_helpers_read_this_torch"],
    "anyaccel/compat/utils/versions.py:is_torch_version": [
        "tests/compat/test_compat_api.py::test_accelerates_version_helpers_read_this_torch"],
    "anyaccel/test_utils/testing.py:require_torch_min_version": [
        "tests/compat/test_compat_api.py::test_accelerates_version_helpers_read_this_torch"],
    "anyaccel/compat/utils/other.py:is_compiled_module": [
        "tests/compat/test_compat_api.py::test_accelerates_version_helpers_read_this_torch"],
}

MULTI_PROCESS_ONLY: Dict[str, str] = {
    "anyaccel/strategies/ddp.py:register_comm_hook": "tests/compat/test_compat_features_multiprocess.py (DDP communication hooks)",
    "anyaccel/strategies/ddp.py:_batched_power_sgd_works": "tests/compat/test_compat_features_multiprocess.py (batched PowerSGD)",
    "anyaccel/strategies/nd/pipeline/schedule.py:compile_settings": "tests/strategies/nd/pipeline/test_pipeline_multiprocess.py (pipeline with compile)",
    "anyaccel/fault_tolerance/transport.py:_transport_class": "tests/fault_tolerance/test_fault_tolerance_multiprocess.py (a heal over "
                                                                "torchft's HTTP transport, which reads torch's private "
                                                                "_streaming_load; torchft is not in the wheel step)",
}

NOT_VERSION_DEPENDENT: Dict[str, str] = {
    "anyaccel/strategies/nd/expert/parallelize.py:_attention_mask": "the signature of the user's model's forward "
                                                                      "(where its attention_mask argument is), not torch's",
    "anyaccel/big_modeling/commands.py:_estimate": "a dtype the user names (getattr(torch, name))",
    "anyaccel/big_modeling/loading.py:load_checkpoint_in_model": "a dtype the user names",
    "anyaccel/big_modeling/offload.py:_dtype": "a dtype named in an offload index",
    "anyaccel/strategies/fsdp/sharding.py:_dtype": "a dtype the user names",
    "anyaccel/compat/utils/imports.py:is_rocm_available": "torch.version.hip: absent from CPU and CUDA builds of every torch",
    "anyaccel/environment/devices.py:cuda_initialized": "torch.cuda.is_initialized exists in every supported torch (a build guard)",
    "anyaccel/environment/devices.py:mps_available": "torch.backends.mps: absent from some builds, not versions",
    "anyaccel/cli/env_report.py:collect": "prints the version, branches on none",
    "anyaccel/training/memory.py:_check_call": "the signature of the user's function",
    "anyaccel/strategies/nd/pipeline/split.py:_is_transformers": "the signature of a transformers model's forward",
    "anyaccel/lazyclass.py:__get__": "inspect.signature of an anyaccel dataclass made on first use, not torch's",
    "anyaccel/strategies/nd/sequence/transformers.py:_accepts_use_cache": "the signature of a transformers model's forward",
    "anyaccel/test_utils/testing.py:get_backend": "a device module by its name (torch.cuda, torch.xpu): by build",
    "anyaccel/test_utils/testing.py:_count": "a device module by its name: by build",
    "anyaccel/test_utils/testing.py:<module>": "Accelerate's requirement decorators: torch >= 2.3 / 2.5, below the oldest supported",
    "anyaccel/big_modeling/checkpoints.py:<module>": "safetensors' dtype names; the float8 dtypes exist since torch 2.1",
    "anyaccel/checkpoint/training_state.py:begin_save": "writes the version into the manifest, branches on none",
    "anyaccel/strategies/compile.py:_warn_eager": "names torch._dynamo's counters in a message",
    "anyaccel/training/precision_fp8.py:_torchao": "names torch's version in the message when torchao cannot be imported "
                                          "(torchao 0.18 needs torch 2.11: fp8 is not offered on torch 2.9)",
}


def _docstring_lines(tree: ast.AST) -> Set[int]:
    lines: Set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            lines.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    return lines


def scan() -> Set[str]:
    """``{"path:function"}`` (``path:<module>`` for module level; ``path`` for :data:`WHOLE_MODULES`)."""
    found: Set[str] = set()
    for path in sorted((ROOT / "anyaccel").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in WHOLE_MODULES:
            found.add(rel)
            continue
        source = path.read_text()
        tree = ast.parse(source)
        skip = _docstring_lines(tree)
        functions = [(n.lineno, n.end_lineno or n.lineno, n.name) for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for number, line in enumerate(source.splitlines(), 1):
            code = line.split("#", 1)[0]
            if number in skip or not PATTERN.search(code):
                continue
            inner = [f for f in functions if f[0] <= number <= f[1]]
            found.add(f"{rel}:{min(inner, key=lambda f: f[1] - f[0])[2] if inner else '<module>'}")
    return found


def test_every_torch_version_dependent_place_is_placed_and_every_row_is_still_found():
    found = scan()
    tables = {**RUN_ON_OLDEST, **MULTI_PROCESS_ONLY, **NOT_VERSION_DEPENDENT}
    assert len(tables) == len(RUN_ON_OLDEST) + len(MULTI_PROCESS_ONLY) + len(NOT_VERSION_DEPENDENT), "a place in two tables"
    unplaced = sorted(found - set(tables))
    assert not unplaced, (
        f"torch-version dependent code that no table of {__file__} places: {unplaced}. Mark a test that runs it "
        "@pytest.mark.torch_versions (make test-wheel runs those on torch 2.9) and add its row to RUN_ON_OLDEST, or say "
        "why not (MULTI_PROCESS_ONLY, NOT_VERSION_DEPENDENT)")
    stale = sorted(set(tables) - found)
    assert not stale, f"rows whose place the scan no longer finds (moved, renamed or gone): {stale}"


def _marked(test_file: Path, name: str) -> bool:
    """The test function ``name`` of ``test_file`` (or, without a name, the file) is marked
    ``torch_versions``: by the module's ``pytestmark``, a decorator, or a ``pytest.param`` of it."""
    tree = ast.parse(test_file.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets) \
                and "torch_versions" in ast.unparse(node.value):
            return True
    if not name:
        return False
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return any("torch_versions" in ast.unparse(d) for d in node.decorator_list)
    raise AssertionError(f"{test_file.relative_to(ROOT)} has no test {name!r}")


def test_the_tests_that_run_them_exist_and_are_marked_for_the_oldest_torch():
    for place, tests in RUN_ON_OLDEST.items():
        for test in tests:
            file, _, name = test.partition("::")
            assert (ROOT / file).exists(), f"{place}: {file} does not exist"
            assert _marked(ROOT / file, name), f"{place}: {test} is not marked @pytest.mark.torch_versions"
