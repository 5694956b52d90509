"""Accelerate 1.15's own distributed test scripts pass on anyaccel with only their imports changed.

The harness (tests/accelerate_compat) loads the scripts from the installed ``accelerate`` package,
rewrites their import lines as ``sed s/accelerate/anyaccel/`` would (sparing accelerate.test_utils) and runs each test call of their ``main()`` on 2 CPU
processes through ``anyaccel launch``; Accelerate's own results on the same calls are stored in
tests/accelerate_compat/baseline.json. Reproduce the table with ``python -m tests.accelerate_compat``.
"""

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                reason="needs accelerate==1.15.0 (the test extra)")

SCRIPT = """
from accelerate import Accelerator, PartialState
from accelerate.utils.operations import gather
from accelerate.test_utils import RegressionModel

def test_a(x):
    pass

def helper():
    return 1

def main():
    state = PartialState()
    value = helper()
    test_a(value)
    for i in range(2):
        test_a(i)
    state.destroy_process_group()
"""


def test_imports_are_rewritten_as_sed_would():
    """Only the import lines change, ``accelerate`` → ``anyaccel`` with the submodule path kept;
    Accelerate's test helpers stay Accelerate's; ``main()``'s test calls are routed."""
    import ast

    from accelerate_compat import worker

    text = worker.sed_imports(SCRIPT)
    assert "from anyaccel import Accelerator, PartialState" in text
    assert "from anyaccel.utils.operations import gather" in text
    assert "from accelerate.test_utils import RegressionModel" in text  # Accelerate's helpers stay
    assert [a for a, b in zip(SCRIPT.splitlines(), text.splitlines()) if a != b] == [
        "from accelerate import Accelerator, PartialState", "from accelerate.utils.operations import gather"]
    assert worker.sed_imports("    import accelerate.utils as u\nx = accelerate_thing\n") == \
        "    import anyaccel.utils as u\nx = accelerate_thing\n"
    tree = ast.unparse(worker.transform(SCRIPT, "anyaccel"))
    assert "value = helper()" in tree  # set-up code in main() runs as is
    assert tree.count("__compat_call__(test_a") == 2 and "destroy_process_group" not in tree
    assert "anyaccel" not in ast.unparse(worker.transform(SCRIPT, "accelerate"))


def test_main_runs_one_selected_call_and_lists_the_others():
    """Listing skips every test call; selecting ``test_a:1`` runs only the second call, with the
    set-up code before it, and leaves main() right after it."""
    from accelerate_compat import worker

    calls = []
    module = {"__compat_call__": None}
    exec(compile(worker.transform(SCRIPT.replace("pass", "calls.append(x)"), "anyaccel"), "<s>", "exec"), module)
    module["calls"] = calls
    selector = worker._Selector(None)
    module["__compat_call__"] = selector.call
    module["PartialState"] = lambda: type("S", (), {"destroy_process_group": lambda self: None})()
    module["main"]()
    assert selector.seen == ["test_a:0", "test_a:1", "test_a:2"] and calls == []
    selector = worker._Selector("test_a:1")
    module["__compat_call__"] = selector.call
    try:
        module["main"]()
    except worker._Stop:
        pass
    assert calls == [0]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_accelerates_scripts_run_on_anyaccel():
    import accelerate

    from accelerate_compat import harness

    baseline = harness.load_baseline()
    assert accelerate.__version__ == baseline["accelerate_version"], "baseline.json was measured with another version"
    results = harness.run_all("anyaccel", timeout=90, baseline=baseline)
    print(harness.table(baseline, results))
    missing = set()
    for script, report in results["scripts"].items():
        assert report["started"], f"{script} does not start: {report['listing_error']}"
        missing |= set(report["missing"])
    assert not missing, f"names a migrated script needs and anyaccel lacks: {sorted(missing)}"
    s = harness.summary(baseline, results)
    assert s["ratio"] >= 0.93, harness.table(baseline, results)
    failing = {(script, call) for script, b in baseline["scripts"].items() for call, v in b["calls"].items()
               if v["ok"] and not results["scripts"][script]["calls"].get(call, {}).get("ok")}
    assert failing <= KNOWN_DIFFERENCES, \
        f"not explained in docs/guides/accelerate.md: {sorted(failing - KNOWN_DIFFERENCES)}"


# The calls Accelerate passes and anyaccel does not, each explained in docs/guides/accelerate.md
# ("Accelerate's own test scripts, rewritten by `sed`").
KNOWN_DIFFERENCES = {
    ("test_sync.py", "test_gradient_accumulation_with_opt_and_scheduler:0"),  # short last group: mean gradient
    ("test_script.py", "check_seedable_sampler_in_batch_sampler_shard:0"),  # Accelerate's internal classes
    ("test_script.py", "test_reinstantiated_state:0"),  # no process-wide state to reset
}
