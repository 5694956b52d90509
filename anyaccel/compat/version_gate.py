"""Which Accelerate version anyaccel stands for, and the version gates a rewrite could turn.

Scripts written for Accelerate gate code on its version: diffusers registers the hooks that save
``unet/`` and ``unet_ema/`` only ``if version.parse(accelerate.__version__) >= version.parse("0.16.0")``.
After the documented swap the name ``accelerate`` is :mod:`anyaccel.as_accelerate`, whose
``__version__`` is :data:`ACCELERATE_VERSION`, so such a gate takes the branch it takes under
Accelerate 1.15. Replacing *every* word ``accelerate`` by ``anyaccel`` instead turns the gate into a
comparison with ``anyaccel.__version__`` (anyaccel's own version, 0.1.0), which silently takes
the branch written for an old Accelerate — checkpoints without the EMA weights.
:func:`check_script` finds such a comparison in the running script and raises, naming the line and
the fix, before the script gets there (``Accelerator()`` calls it). Local; reads the script once.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Optional, Set, Tuple

__all__ = ["ACCELERATE_VERSION", "check_script", "check_source"]

#: The Accelerate release whose API anyaccel follows: ``accelerate.__version__`` after the
#: documented swap (tests/unit/test_as_accelerate.py compares it with the installed Accelerate).
ACCELERATE_VERSION = "1.15.0"

_OPS = r"(>=|<=|==|!=|>|<)"
_OWN = r"anyaccel\s*\.\s*__version__\s*\)?"
_LITERAL = r"(?:[\w.]+\s*\(\s*)?[\"']([0-9][^\"']*)[\"']"
# version.parse(anyaccel.__version__) >= version.parse("0.16.0")   and the mirrored form
_GATES = (re.compile(_OWN + r"\s*" + _OPS + r"\s*" + _LITERAL),
          re.compile(_LITERAL + r"\s*\)?\s*" + _OPS + r"\s*(?:[\w.]+\s*\(\s*)?" + _OWN))
_MIRROR = {">=": "<=", "<=": ">=", ">": "<", "<": ">", "==": "==", "!=": "!="}
_checked: Set[str] = set()


def _release(text: str) -> Tuple[int, ...]:
    """``"0.17.0.dev0"`` → ``(0, 17, 0)``: the release numbers, enough to order gates."""
    numbers = []
    for part in text.split("."):
        match = re.match(r"\d+", part)
        if match is None:
            break
        numbers.append(int(match.group()))
        if match.end() != len(part):
            break
    return tuple(numbers) + (0,) * (3 - len(numbers))


def _holds(left: Tuple[int, ...], op: str, right: Tuple[int, ...]) -> bool:
    return {"<": left < right, "<=": left <= right, ">": left > right, ">=": left >= right,
            "==": left == right, "!=": left != right}[op]


def check_source(source: str, filename: str, own_version: str) -> Optional[str]:
    """The error message for the first comparison of ``anyaccel.__version__`` with a version
    literal in ``source`` that holds under ``own_version`` but not under Accelerate's
    :data:`ACCELERATE_VERSION` (or the other way round); None when there is none. Local."""
    if "__version__" not in source or "anyaccel" not in source:
        return None
    own, accelerate = _release(own_version), _release(ACCELERATE_VERSION)
    for mirrored, pattern in enumerate(_GATES):
        for match in pattern.finditer(source):
            op, literal = (match.group(1), match.group(2)) if not mirrored else (_MIRROR[match.group(2)], match.group(1))
            wanted = _release(literal)
            if _holds(own, op, wanted) == _holds(accelerate, op, wanted):
                continue  # the same branch either way
            line = source.count("\n", 0, match.start()) + 1
            return (f"{filename}:{line} compares anyaccel.__version__ (anyaccel's own version, {own_version}) with "
                    f"{literal!r}: as written it takes the other branch than under Accelerate {ACCELERATE_VERSION}, "
                    "whose API anyaccel follows. It was most likely `accelerate.__version__` before every word "
                    "`accelerate` was replaced by `anyaccel`. Rewrite the script's imports with the command in "
                    "docs/guides/accelerate.md instead (`import accelerate` becomes `import anyaccel.as_accelerate as "
                    f"accelerate`, whose __version__ is {ACCELERATE_VERSION}), or write "
                    "`anyaccel.as_accelerate.__version__` on that line")
    return None


def check_script(own_version: str) -> None:
    """Raise ``RuntimeError`` (:func:`check_source`'s message) when the running script (``__main__``'s
    file) compares ``anyaccel.__version__`` as only a rewritten Accelerate gate would. Every process
    raises the same, before any collective. Each file is read once per process. Local."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or path in _checked or not path.endswith(".py"):
        return
    _checked.add(path)
    try:
        with open(path, encoding="utf-8") as fh:
            source = fh.read()
    except (OSError, UnicodeDecodeError):
        return
    message = check_source(source, os.path.relpath(path), own_version)
    if message is not None:
        raise RuntimeError(message)
