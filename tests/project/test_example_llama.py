"""examples/llama_tp_fsdp.py read in one process: its migration docstring and its TP plan; the
4-process run is in tests/examples/test_example_llama_multiprocess.py."""

import ast
import importlib.util

from conftest import ROOT

EXAMPLE = ROOT / "examples" / "llama_tp_fsdp.py"


def example_module():
    """The example imported as a module (its model class and PLAN), without running it."""
    spec = importlib.util.spec_from_file_location("llama_tp_fsdp", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_docstring_shows_the_migration():
    doc = ast.get_docstring(ast.parse(EXAMPLE.read_text()))
    assert "# before" in doc and "# after" in doc and "ModelParallelStrategy" in doc


def test_plan_cuts_heads_and_mlp_and_matches_every_projection():
    from fnmatch import fnmatch

    example = example_module()
    model = example.TinyLlama(width=32, n_heads=4, hidden=64, layers=2)
    for pattern in example.PLAN:  # every pattern matches a module of each layer (a typo would replicate it)
        assert sum(fnmatch(name, pattern) for name, _ in model.named_modules()) == 2, pattern
