"""The single-process tests; the multi-process ones (real launches, marked slow) are in tests/accelerate_compat/test_accelerate_compat_multiprocess.py.

Accelerate 1.15's own distributed test scripts pass on anyaccel with only their imports changed.

The harness (tests/accelerate_compat) loads the scripts from the installed ``accelerate`` package,
rewrites their import lines as ``sed s/accelerate/anyaccel/`` would (accelerate.test_utils included) and runs each test call of their ``main()`` on 2 CPU
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
    """Only the import lines (and quoted module paths) change, ``accelerate`` → ``anyaccel`` with
    the submodule path kept, Accelerate's test helpers included; the spared variant keeps
    ``accelerate.test_utils``; ``main()``'s test calls are routed."""
    import ast

    from accelerate_compat import worker

    text = worker.sed_imports(SCRIPT)
    assert "from anyaccel import Accelerator, PartialState" in text
    assert "from anyaccel.utils.operations import gather" in text
    assert [a for a, b in zip(SCRIPT.splitlines(), text.splitlines()) if a != b] == [
        "from accelerate import Accelerator, PartialState", "from accelerate.utils.operations import gather",
        "from accelerate.test_utils import RegressionModel"]
    assert "from anyaccel.test_utils import RegressionModel" in text
    spared = worker.sed_imports(SCRIPT, swap="spare_test_utils")
    assert "from accelerate.test_utils import RegressionModel" in spared  # Accelerate's helpers stay
    assert worker.sed_imports("    import accelerate.utils as u\nx = accelerate_thing\n") == \
        "    import anyaccel.utils as u\nx = accelerate_thing\n"
    assert worker.sed_imports('log = loggers["accelerate.accelerator"]; name = "accelerate"\n') == \
        'log = loggers["anyaccel.accelerator"]; name = "accelerate"\n'
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
