"""Run every code block in the docs that is a complete script (part of `make docs`).

A ```python block counts as a complete script when its first line of code is an import. Each runs in
a fresh interpreter, in a temporary directory, with this checkout's anyaccel importable, one process,
on the CPU; it must exit 0 within the time limit.

A block that starts with imports but must not run here says why on its first line:

    # not run: <the reason>

Blocks that do not start with an import (fragments, side-by-side mappings) are not run; give those a
`# not run:` line too when a reader could take them for a script.

    python docs/check_examples.py [FILE.md ...]      # default: every docs/**/*.md
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
MARKER = "# not run:"
TIMEOUT = 180
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)\s*(?P<info>[^\n`]*)$")


def python_blocks(text: str):
    """(first line number, code) of every ```python / ```py fenced block in Markdown ``text``."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info, start = m.group("fence"), m.group("info").strip().lower(), i + 1
        j = start
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        if info.split()[:1] in (["python"], ["py"], ["python3"]):
            yield start + 1, "\n".join(lines[start:j]) + "\n"
        i = j + 1


def classify(code: str) -> str:
    """'run', 'marked' (first line is `# not run: reason`) or 'fragment' (does not start with an import)."""
    stripped = [line.strip() for line in code.splitlines() if line.strip()]
    if stripped and stripped[0].startswith(MARKER):
        if not stripped[0][len(MARKER):].strip():
            raise ValueError(f"'{MARKER}' needs a reason after it")
        return "marked"
    code_lines = [line for line in stripped if not line.startswith("#")]
    if code_lines and re.match(r"(import|from)\s+\w", code_lines[0]):
        return "run"
    return "fragment"


def run_block(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ANYACCEL_", "SLURM_", "OMPI_", "PMI_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["CUDA_VISIBLE_DEVICES"] = ""
    with tempfile.TemporaryDirectory(prefix="anyaccel-docs-") as tmp:
        script = Path(tmp) / "snippet.py"
        script.write_text(code)
        return subprocess.run([sys.executable, str(script)], cwd=tmp, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT)


def main(argv) -> int:
    files = [Path(a) for a in argv] or sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)
    failures, counts = [], {"run": 0, "marked": 0, "fragment": 0}
    for path in files:
        for line, code in python_blocks(path.read_text()):
            where = f"{path.relative_to(ROOT) if path.is_absolute() else path}:{line}"
            try:
                kind = classify(code)
            except ValueError as exc:
                failures.append(f"{where}: {exc}")
                continue
            counts[kind] += 1
            if kind != "run":
                continue
            started = time.monotonic()
            try:
                proc = run_block(code)
            except subprocess.TimeoutExpired:
                failures.append(f"{where}: did not finish in {TIMEOUT} s")
                continue
            took = time.monotonic() - started
            if proc.returncode != 0:
                failures.append(f"{where}: exit status {proc.returncode}\n{proc.stdout[-1500:]}{proc.stderr[-3000:]}")
            else:
                print(f"check_examples: ran {where} ({took:.1f} s)")
    print(f"check_examples: {counts['run']} scripts run, {counts['marked']} marked '{MARKER} ...', "
          f"{counts['fragment']} fragments (no import first)")
    for failure in failures:
        print(f"check_examples: FAILED {failure}\n"
              f"  (a block that cannot run here starts with '{MARKER} <why>')", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
