"""One process of one compatibility job: load an Accelerate test script, run one of its test calls.

Started twice per job (2 processes) by ``anyaccel launch --num_processes 2 --cpu`` or torchrun;
see :mod:`tests.accelerate_compat.harness` for who starts it and how results are combined.

    python worker.py anyaccel test_ops.py DIR                               # list main()'s test calls
    python worker.py anyaccel test_ops.py DIR test_gather:0 test_reduce_sum:0   # and run these
    python worker.py anyaccel test_ops.py DIR1 KEYS... ++ anyaccel test_sync.py DIR2 KEYS...  # one job, in turn

The script's source is read from the installed ``accelerate`` package (never copied). With
``anyaccel`` as the implementation, its import lines are rewritten as ``sed`` rewrites them
(:func:`sed_imports`): ``accelerate`` becomes ``anyaccel`` at the start of every ``from``/``import``
line, whatever submodule follows (``accelerate.utils.operations`` → ``anyaccel.utils.operations``,
``accelerate.test_utils`` → ``anyaccel.test_utils``), and in quoted module paths (a logger's name);
nothing else changes, and the run never imports accelerate. A module or name anyaccel lacks makes
the script fail to start (an ImportError, as for a user), and is reported. ``ACCEL_COMPAT_SWAP=
spare_test_utils`` (the harness's ``swap``) keeps Accelerate's own ``accelerate.test_utils`` instead,
with ``are_the_same_tensors`` replaced by the same lines on anyaccel (the harness's former variant).

``main()`` is then rewritten so that each bare call of a module-level function in it (``test_x(...)``
as a statement: the script's test functions) goes through :func:`_Selector.call`: listing skips
them all and records their order (``name:occurrence``); running ``KEY`` runs only that one call,
with the rest of ``main()`` (its set-up code, its branches on the distributed type) before it as is,
and stops ``main()`` right after it. Each rank writes ``DIR/rank<r>.jsonl``. Several scripts given
(``++`` between them) run one after the other in the same processes (a job of 2 processes costs ~15
CPU-s of start-up; the harness runs again alone whatever did not pass there).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import os
import re
import sys
import time
import traceback
import types
from typing import Any, Dict, List, Optional

SCRIPT_MODULE = "accelerate_compat_script"
# Modules the metrics script imports at top level but uses only on GPU/TPU paths (MRPC with
# transformers). When they are not installed they are stubbed for that script only.
_STUBBED_IF_MISSING = {"external_deps/test_metrics.py": ("datasets", "evaluate", "transformers")}


class _Stop(Exception):
    """Raised after the selected call returned, to leave ``main()``."""


class _Selector:
    def __init__(self, selected: Optional[str]):
        self.selected = selected
        self.seen: List[str] = []
        self._counts: Dict[str, int] = {}
        self.ran = False

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        name = getattr(fn, "__name__", repr(fn))
        n = self._counts.get(name, 0)
        self._counts[name] = n + 1
        key = f"{name}:{n}"
        self.seen.append(key)
        if key != self.selected:
            return None
        self.ran = True
        fn(*args, **kwargs)
        raise _Stop()


# ``from accelerate... import`` / ``import accelerate...`` at the start of a line: the one edit a
# migrating user makes, as ``sed`` makes it (the spared variant keeps accelerate.test_utils).
_IMPORT_LINE = re.compile(r"^(\s*(?:from|import)\s+)accelerate(?=[\s.])", re.MULTILINE)
_IMPORT_LINE_SPARED = re.compile(r"^(\s*(?:from|import)\s+)accelerate(?=[\s.])(?!\.test_utils\b)", re.MULTILINE)
# a module path of Accelerate's in a string ("accelerate.accelerator", a logger's name), which a
# user's sed rewrites as well
_MODULE_STRING = re.compile(r"""(["'])accelerate(?=\.[a-z_]+[a-z_.]*\1)""")

SWAPS = ("full", "spare_test_utils")


def sed_imports(source: str, swap: str = "full") -> str:
    """``source`` with ``accelerate`` replaced by ``anyaccel`` in its import lines — what
    ``sed -E 's/^(\\s*(from|import)\\s+)accelerate([ .]|$)/\\1anyaccel\\3/'`` does — and in
    quoted module paths (``"accelerate.accelerator"``). ``swap="spare_test_utils"`` keeps
    ``accelerate.test_utils`` imports and strings as they are (the harness's former variant, to
    compare). Nothing else in the script changes."""
    if swap not in SWAPS:
        raise ValueError(f"swap={swap!r}; choose one of {', '.join(SWAPS)}")
    if swap == "spare_test_utils":
        return _IMPORT_LINE_SPARED.sub(r"\1anyaccel", source)
    return _MODULE_STRING.sub(r"\1anyaccel", _IMPORT_LINE.sub(r"\1anyaccel", source))


def _missing_name(exc: BaseException) -> Optional[str]:
    """``module.name`` from ``ImportError: cannot import name 'name' from 'module'``, else None."""
    match = re.search(r"cannot import name '([^']+)' from '([^']+)'", str(exc))
    if match:
        return f"{match.group(2)}.{match.group(1)}"
    return getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None


def _are_the_same_tensors(tensor: Any) -> bool:
    """``accelerate.test_utils.are_the_same_tensors`` with anyaccel's state and gather. (Accelerate's
    reads Accelerate's own ``AcceleratorState`` singleton, which only ``accelerate.Accelerator()``
    fills; the helper checks that every rank holds the same tensor.)"""
    import torch

    from anyaccel.state import PartialState
    from anyaccel.utils import gather

    tensor = tensor[None].clone().to(PartialState().device)
    tensors = gather(tensor).cpu()
    return all(torch.equal(tensors[i], tensor[0].cpu()) for i in range(tensors.shape[0]))


# accelerate.test_utils helpers that read Accelerate's own state: on anyaccel, the same lines on anyaccel.
_HELPERS_ON_ANYACCEL = {"are_the_same_tensors": _are_the_same_tensors}


_TEARDOWN = ("destroy_process_group", "end_training")


class _RouteTestCalls(ast.NodeTransformer):
    """In ``main()``: ``f(args)`` as a statement, ``f`` a module-level function → selector call;
    ``x.destroy_process_group()`` / ``x.end_training()`` as statements → nothing (the worker runs
    ``main()`` once per call and leaves the group itself at exit)."""

    def __init__(self, functions: set):
        self.functions = functions

    def visit_Expr(self, node: ast.Expr) -> Any:
        call = node.value
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in _TEARDOWN:
            return ast.copy_location(ast.Pass(), node)  # main() runs again for the next call; the worker leaves at exit
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in self.functions:
            routed = ast.Call(func=ast.Name(id="__compat_call__", ctx=ast.Load()),
                              args=[call.func] + call.args, keywords=call.keywords)
            return ast.copy_location(ast.Expr(routed), node)
        return node


def transform(source: str, impl: str, filename: str = "<script>", swap: str = "full") -> ast.Module:
    """The script's syntax tree with its import lines rewritten by :func:`sed_imports` (for
    ``impl == "anyaccel"``) and the
    test calls of its ``main()`` routed through ``__compat_call__``."""
    if impl == "anyaccel":
        source = sed_imports(source, swap)
    tree = ast.parse(source, filename=filename)
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name not in ("main", "_mp_fn")}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            _RouteTestCalls(functions).visit(node)
    return ast.fix_missing_locations(tree)


def scripts_dir() -> str:
    """Where the installed accelerate keeps its test scripts — found without importing accelerate
    (an import would register Accelerate's loggers and state in an anyaccel run)."""
    spec = importlib.util.find_spec("accelerate")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("accelerate is not installed (the test extra installs accelerate==1.15.0)")
    return os.path.join(list(spec.submodule_search_locations)[0], "test_utils", "scripts")


def load_script(relpath: str, impl: str, selector: _Selector, missing: List[str],
                swap: str = "full") -> types.ModuleType:
    path = os.path.join(scripts_dir(), relpath)
    with open(path) as f:
        tree = transform(f.read(), impl, path, swap)
    stubbed = []
    for name in _STUBBED_IF_MISSING.get(relpath, ()):
        try:
            importlib.import_module(name)
        except ImportError:
            from unittest import mock

            sys.modules[name] = mock.MagicMock(name=name)
            stubbed.append(name)
    module = types.ModuleType(SCRIPT_MODULE)
    module.__file__ = path
    module.__dict__["__compat_call__"] = selector.call
    sys.modules[SCRIPT_MODULE] = module
    try:
        exec(compile(tree, path, "exec"), module.__dict__)
    except ImportError as exc:  # a module or name the rewritten imports ask for and anyaccel lacks
        name = _missing_name(exc)
        if name:
            missing.append(name)
        raise
    finally:
        for name in stubbed:  # the script keeps its stub; "is datasets installed?" answers no again
            del sys.modules[name]
    if impl == "anyaccel" and swap == "spare_test_utils":  # Accelerate's helpers that read Accelerate's state
        for name, helper in _HELPERS_ON_ANYACCEL.items():
            if name in module.__dict__:
                module.__dict__[name] = helper
    return module


def _error(exc: BaseException) -> Dict[str, Any]:
    text = f"{type(exc).__name__}: {exc}".strip()
    return {"error": text.splitlines()[0][:300] if text else type(exc).__name__,
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]}


def _run_main(module: types.ModuleType, key: Optional[str]) -> Dict[str, Any]:
    """Run the script's ``main()`` with only ``key`` selected (None: none, to list the calls)."""
    selector = _Selector(key)
    module.__dict__["__compat_call__"] = selector.call
    result: Dict[str, Any] = {"key": key, "ok": False}
    start = time.perf_counter()
    try:
        module.main()
    except _Stop:
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported, the harness judges
        result.update(_error(exc))
        if key is not None and not selector.ran:
            result["error"] = f"not reached: main() raised before calling it: {result['error']}"
    else:
        if key is None:
            result["ok"] = True
        else:
            result["error"] = "not reached: main() returned without calling it"
    result.update(seen=selector.seen, seconds=round(time.perf_counter() - start, 2))
    return result


class _Report:
    """This rank's results, one JSON line per run of ``main()``; after each line the rank waits
    for the other ranks' line (a file barrier outside torch.distributed, so that a rank that
    failed inside a collective cannot pair its next call's collectives with a peer's old ones)."""

    def __init__(self, out: str, rank: int, world: int):
        os.makedirs(out, exist_ok=True)
        self.paths = [os.path.join(out, f"rank{r}.jsonl") for r in range(world)]
        self.mine = self.paths[rank]
        self.lines = 0

    def write(self, result: Dict[str, Any]) -> None:
        with open(self.mine, "a") as f:
            f.write(json.dumps(result) + "\n")
        self.lines += 1
        while not all(_count_lines(p) >= self.lines for p in self.paths):
            time.sleep(0.02)


def _count_lines(path: str) -> int:
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Each ``++``-separated part of ``argv`` in turn (:func:`_run_part`), then leave the group."""
    argv = sys.argv[1:] if argv is None else list(argv)
    part: List[str] = []
    for arg in argv + ["++"]:
        if arg != "++":
            part.append(arg)
            continue
        _run_part(part)
        part = []
    sys.stdout.flush()
    _leave_group()
    return 0


def _run_part(argv: List[str]) -> None:
    """One script: list ``main()``'s calls, then run the keys asked for, reporting each."""
    parser = argparse.ArgumentParser()
    # positional only: a launcher (torchrun) must not mistake them for its own options
    parser.add_argument("impl", choices=("accelerate", "anyaccel"))
    parser.add_argument("script")
    parser.add_argument("out")
    parser.add_argument("keys", nargs="*", help="name:occurrence of the calls to run, one main() each")
    args = parser.parse_args(argv)
    swap = os.environ.get("ACCEL_COMPAT_SWAP", "full")  # set by the harness (a flag could reach the launcher)
    report = _Report(args.out, int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
    missing: List[str] = []
    try:
        module = load_script(args.script, args.impl, _Selector(None), missing, swap)
    except BaseException as exc:  # noqa: BLE001 - the script does not even import
        report.write(dict(_error(exc), key=None, ok=False, started=False, seen=[], missing=sorted(set(missing))))
        return
    listing = _run_main(module, None)
    report.write(dict(listing, started=True, missing=sorted(set(missing))))
    for key in args.keys:
        report.write(_run_main(module, key))


def _leave_group() -> None:
    """Leave the process group before exit (a gloo group freed at interpreter teardown can abort)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort; the result is already written
        pass


if __name__ == "__main__":
    sys.exit(main())
