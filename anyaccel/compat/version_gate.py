"""Which Accelerate version anyaccel stands for, and the version gates a rewrite could turn.

Scripts written for Accelerate gate code on its version: diffusers registers the hooks that save
``unet/`` and ``unet_ema/`` only ``if version.parse(accelerate.__version__) >= version.parse("0.16.0")``.
After the documented swap the name ``accelerate`` is :mod:`anyaccel.as_accelerate`, whose
``__version__`` is :data:`ACCELERATE_VERSION`, so such a gate takes the branch it takes under
Accelerate 1.15. Replacing *every* word ``accelerate`` by ``anyaccel`` instead turns the gate into a
comparison with ``anyaccel.__version__`` (anyaccel's own version, 0.1.0), which silently takes
the branch written for an old Accelerate — checkpoints without the EMA weights.

:func:`check_script` (``Accelerator()`` calls it) looks for such a comparison in the running script
and warns (:class:`VersionGateWarning`, naming the line and the documented swap); it never raises,
because a script written for anyaccel may gate on anyaccel's own version on purpose. Cost: a
substring test of the script's text; the text is parsed (:mod:`ast`, imported then) only when it
contains both ``anyaccel`` and ``__version__``, once per file and process. Comments and strings
never match: only comparisons in the code are read. Local.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, List, Optional, Set, Tuple

__all__ = ["ACCELERATE_VERSION", "VersionGateWarning", "check_script", "check_source"]

#: The Accelerate release whose API anyaccel follows: ``accelerate.__version__`` after the
#: documented swap (tests/compat/test_as_accelerate.py compares it with the installed Accelerate).
ACCELERATE_VERSION = "1.15.0"

_checked: Set[str] = set()


class VersionGateWarning(UserWarning):
    """A comparison of ``anyaccel.__version__`` takes another branch than the same comparison of
    ``accelerate.__version__`` under Accelerate :data:`ACCELERATE_VERSION` would."""


def _release(text: str) -> Tuple[int, ...]:
    """``"0.17.0.dev0"`` → ``(0, 17, 0)``: the release numbers, enough to order gates."""
    numbers: List[int] = []
    for part in text.split("."):
        digits = len(part) - len(part.lstrip("0123456789"))
        if not digits:
            break
        numbers.append(int(part[:digits]))
        if digits != len(part):
            break
    return tuple(numbers) + (0,) * (3 - len(numbers))


def _holds(left: Tuple[int, ...], op: str, right: Tuple[int, ...]) -> bool:
    return {"<": left < right, "<=": left <= right, ">": left > right, ">=": left >= right,
            "==": left == right, "!=": left != right}[op]


_MIRROR = {">=": "<=", "<=": ">=", ">": "<", "<": ">", "==": "==", "!=": "!="}


def _unwrap(node: Any, ast: Any) -> Any:
    """``version.parse(x)``, ``Version(x)``, ``str(x)`` → ``x`` (calls of one argument)."""
    while isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords:
        node = node.args[0]
    return node


def _lines_to_read(source: str) -> Optional[List[int]]:
    """The lines a gate on anyaccel's version can be on (sorted): those naming ``__version__``
    and ``anyaccel`` together (``anyaccel.__version__``), or, when the script imports
    ``anyaccel as`` another name, every line naming ``__version__``; None when every statement
    must be read (``from anyaccel import __version__`` binds a name the gate uses elsewhere).
    Empty: nothing to parse. A substring scan, linear in the text."""
    alias = "import anyaccel as " in source
    lines: List[int] = []
    start, line, counted = 0, 1, 0
    while True:
        at = source.find("__version__", start)
        if at < 0:
            return lines
        begin, end = source.rfind("\n", 0, at) + 1, source.find("\n", at)
        end = len(source) if end < 0 else end
        text = source[begin:end]
        if "from anyaccel import" in text:
            return None
        if alias or "anyaccel" in text:
            line += source.count("\n", counted, at)
            counted = at
            lines.append(line)
        start = end


def _gates(source: str, filename: str, lines: Optional[List[int]]) -> List[Tuple[int, str, str]]:
    """``(line, operator, literal)`` of every comparison of anyaccel's ``__version__`` with a
    version literal in ``source``, written as ``anyaccel.__version__ OP "x.y"`` (either side,
    possibly inside ``version.parse(...)``), among the statements that span one of ``lines``
    (the others are not visited; None: all). A file that does not parse has none."""
    import ast  # here: only scripts that name anyaccel's __version__ pay for it
    from bisect import bisect_left

    try:
        tree = ast.parse(source, filename)
    except (SyntaxError, ValueError):
        return []
    modules, versions, compares = {"anyaccel"}, set(), []
    stack = list(tree.body)
    while stack:  # one walk: the imports that name anyaccel, and the comparisons
        node = stack.pop()
        if lines is not None and isinstance(node, ast.stmt):
            i = bisect_left(lines, node.lineno)
            if (i == len(lines) or lines[i] > (node.end_lineno or node.lineno)) and not isinstance(node, ast.Import):
                continue  # spans no line that could hold a gate
        if isinstance(node, ast.Import):
            modules.update(a.asname for a in node.names if a.name == "anyaccel" and a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == "anyaccel" and not node.level:
            versions.update(a.asname or a.name for a in node.names if a.name == "__version__")
        elif isinstance(node, ast.Compare):
            compares.append(node)
        stack.extend(ast.iter_child_nodes(node))
    ops = {ast.Gt: ">", ast.GtE: ">=", ast.Lt: "<", ast.LtE: "<=", ast.Eq: "==", ast.NotEq: "!="}

    def own(node: Any) -> bool:
        node = _unwrap(node, ast)
        if isinstance(node, ast.Attribute):
            return node.attr == "__version__" and isinstance(node.value, ast.Name) and node.value.id in modules
        return isinstance(node, ast.Name) and node.id in versions

    def literal(node: Any) -> Optional[str]:
        node = _unwrap(node, ast)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value[:1].isdigit():
            return node.value
        return None

    found = []
    for node in compares:
        operands = [node.left, *node.comparators]
        for (left, right), op in zip(zip(operands, operands[1:]), node.ops):
            symbol = ops.get(type(op))
            if symbol is not None and own(left) and literal(right) is not None:
                found.append((node.lineno, symbol, literal(right)))
            elif symbol is not None and own(right) and literal(left) is not None:
                found.append((node.lineno, _MIRROR[symbol], literal(left)))
    return sorted(found)


def check_source(source: str, filename: str, own_version: str) -> Optional[str]:
    """The warning for the comparisons of ``anyaccel.__version__`` with a version literal in
    ``source`` that hold under ``own_version`` but not under Accelerate's :data:`ACCELERATE_VERSION`
    (or the other way round), naming the first one's line; None when there is none. Only code
    is read (comments and strings never match); cheap unless ``source`` contains both
    ``anyaccel`` and ``__version__``. Local."""
    found = _finding(source, filename, own_version)
    return None if found is None else found[1]


def _finding(source: str, filename: str, own_version: str) -> Optional[Tuple[int, str]]:
    if "__version__" not in source or "anyaccel" not in source:
        return None
    lines = _lines_to_read(source)
    if lines == []:
        return None
    own, accelerate = _release(own_version), _release(ACCELERATE_VERSION)
    differ = [(line, literal) for line, op, literal in _gates(source, filename, lines)
              if _holds(own, op, _release(literal)) != _holds(accelerate, op, _release(literal))]
    if not differ:
        return None
    (line, literal), more = differ[0], [str(n) for n, _ in differ[1:]]
    also = f" (also line{'s' if len(more) > 1 else ''} {', '.join(more)})" if more else ""
    return line, (
        f"{filename}:{line} compares anyaccel.__version__ (anyaccel's own version, {own_version}) with "
        f"{literal!r}{also}: it takes the other branch than the same comparison of accelerate.__version__ "
        f"under Accelerate {ACCELERATE_VERSION}, whose API anyaccel follows. If the script was written for "
        "Accelerate and every word `accelerate` was replaced by `anyaccel`, swap the imports as "
        "docs/guides/accelerate.md says instead (`import accelerate` becomes `import anyaccel.as_accelerate as "
        f"accelerate`, whose __version__ is {ACCELERATE_VERSION}) or write `anyaccel.as_accelerate.__version__` "
        "on that line. If the gate is about anyaccel itself, nothing is wrong: silence this with "
        "warnings.filterwarnings('ignore', category=anyaccel.compat.version_gate.VersionGateWarning)")


def check_script(own_version: str, is_main_process: bool = True) -> None:
    """Warn (:class:`VersionGateWarning`, attributed to the script's line) when the running script
    (``__main__``'s file) compares ``anyaccel.__version__`` as only a rewritten Accelerate gate
    would; never raises. Each file is read once per process; in a launched job only the main
    process (``is_main_process``) warns (every rank runs the same script). Local."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or path in _checked or not path.endswith(".py"):
        return
    _checked.add(path)
    if not is_main_process:
        return
    try:
        with open(path, encoding="utf-8") as fh:
            source = fh.read()
    except (OSError, UnicodeDecodeError):
        return
    found = _finding(source, os.path.relpath(path), own_version)
    if found is not None:
        warnings.warn_explicit(found[1], VersionGateWarning, path, found[0], module="__main__")
