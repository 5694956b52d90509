"""What each rank of a launched checks script reports to its test: one JSON file per job and rank,
``OUT/<job>_rank<r>.json`` (written by the worker, read back by the test in rank order)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple


def write(out, job: str, rank: int, result) -> None:
    """Worker side: this rank's ``result`` (JSON-able) for ``job``. Local: each rank its own file."""
    with open(os.path.join(out, f"{job}_rank{rank}.json"), "w") as f:
        json.dump(result, f)


def read(out, job: str, n: int) -> List[dict]:
    """Test side: what ranks 0 .. ``n`` - 1 wrote for ``job``, in rank order."""
    return [json.loads((Path(out) / f"{job}_rank{r}.json").read_text()) for r in range(n)]


def run_layouts(check: Callable[[str], Tuple[int, dict]], argv: Optional[Sequence[str]] = None) -> None:
    """``main()`` of a checks script run as ``SCRIPT OUT LAYOUT...``: ``check(layout)`` (returning
    this rank and its result) for each layout in turn, each result written as job ``layout``.
    Collective as far as ``check`` is: every rank runs the same layouts in the same order."""
    out, *layouts = sys.argv[1:] if argv is None else argv
    for layout in layouts:
        rank, result = check(layout)
        write(out, layout, rank, result)
