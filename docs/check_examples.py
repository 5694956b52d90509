"""Run every code block in the docs that is a complete script (part of `make docs`).

A ```python block counts as a complete script when its first line of code is an import. Each runs in
a fresh interpreter, in a temporary directory, with this checkout's anyaccel importable, one process,
on the CPU; it must exit 0 within the time limit.

A block that starts with imports but must not run here says why on its first line:

    # not run: <the reason>

Blocks that do not start with an import (fragments, side-by-side mappings) are not run; give those a
`# not run:` line too when a reader could take them for a script.

A script that shows what happens when a run is interrupted says so on its first line:

    # interrupted: SIGKILL after "<text it prints>", then run again

It runs three times: once to the end (the reference); at the same time, in a second directory, until
it prints that text, when it gets the signal (it must not have finished: the interruption is real); then again
in that directory, where it must finish and its last line of output must equal the reference's (so
print something that differs when a resumed run does not continue exactly, such as a checksum of
the weights). Both marker lines are hidden on the site (`docs/conf.py`).

Every script runs with `HOME` and the `XDG_*` directories in its temporary directory, so nothing
lands in your home directory.

The scripts run ``--jobs`` at a time (default: the number of CPUs plus one), each printed as it
passes; the failures are listed at the end.

    python docs/check_examples.py [--jobs N] [FILE.md ...]      # default: every docs/**/*.md
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Optional, Tuple

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
MARKER = "# not run:"
INTERRUPT = re.compile(r'^# interrupted: (SIG[A-Z0-9]+) after "([^"]+)", then run again')
TIMEOUT = 180
JOBS = (os.cpu_count() or 1) + 1  # scripts at the same time (--jobs)
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
    """'run', 'interrupt' (first line `# interrupted: SIG... after "...", then run again`), 'marked' (first
    line is `# not run: reason`) or 'fragment' (does not start with an import)."""
    stripped = [line.strip() for line in code.splitlines() if line.strip()]
    if stripped and stripped[0].startswith(MARKER):
        if not stripped[0][len(MARKER):].strip():
            raise ValueError(f"'{MARKER}' needs a reason after it")
        return "marked"
    if stripped and stripped[0].startswith("# interrupted:"):
        if not INTERRUPT.match(stripped[0]):
            raise ValueError('write the first line as: # interrupted: SIGKILL after "<printed text>", then run again')
        return "interrupt"
    code_lines = [line for line in stripped if not line.startswith("#")]
    if code_lines and re.match(r"(import|from)\s+\w", code_lines[0]):
        return "run"
    return "fragment"


def _env(tmp: str) -> dict:
    """A clean environment for one script: this checkout importable, one process on the CPU, and a
    home directory of its own inside ``tmp`` (caches and configuration files land there)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ANYACCEL_", "SLURM_", "OMPI_", "PMI_", "XDG_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONUNBUFFERED"] = "1"  # an interrupted script's output arrives as it is printed
    home = Path(tmp) / ".home"
    home.mkdir(exist_ok=True)
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), XDG_CONFIG_HOME=str(home / ".config"),
               MPLCONFIGDIR=str(home / ".config" / "matplotlib"))
    return env


def run_block(code: str, tmp: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run ``code`` as a script in ``tmp`` (default: a fresh temporary directory)."""
    if tmp is None:
        with tempfile.TemporaryDirectory(prefix="anyaccel-docs-") as fresh:
            return run_block(code, fresh)
    script = Path(tmp) / "snippet.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], cwd=tmp, env=_env(tmp), capture_output=True, text=True,
                          timeout=TIMEOUT)


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def run_interrupted(code: str) -> Tuple[Optional[str], str]:
    """Run a `# interrupted:` script: to the end and, at the same time in a second directory,
    interrupted, then again there. (None, what happened) if all is well, else (what went wrong, "")."""
    m = INTERRUPT.match(next(line.strip() for line in code.splitlines() if line.strip()))
    assert m is not None
    signum, text = getattr(signal, m.group(1)), m.group(2)
    with tempfile.TemporaryDirectory(prefix="anyaccel-docs-") as ref_dir, \
            tempfile.TemporaryDirectory(prefix="anyaccel-docs-") as tmp, ThreadPoolExecutor(1) as pool:
        uninterrupted = pool.submit(run_block, code, ref_dir)  # the reference, beside the interrupted run
        script = Path(tmp) / "snippet.py"
        script.write_text(code)
        proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp, env=_env(tmp), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        watchdog = threading.Timer(TIMEOUT, proc.kill)  # a script that hangs silently is ended
        watchdog.start()
        seen: list = []
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                seen.append(line)
                if text in line:
                    proc.send_signal(signum)
                    break
            rest = proc.stdout.read()
            proc.wait()
        finally:
            watchdog.cancel()
        reference = uninterrupted.result()
        if reference.returncode != 0:
            return (f"the uninterrupted run exited {reference.returncode}\n{reference.stdout[-1500:]}"
                    f"{reference.stderr[-3000:]}"), ""
        if not any(text in line for line in seen):
            return f"it never printed {text!r}, so it was not interrupted:\n{''.join(seen)[-2000:]}{rest[-1000:]}", ""
        if proc.returncode == 0:
            return (f"it finished before {m.group(1)} reached it (exit 0): interrupt it earlier, or make the run "
                    f"longer\n{''.join(seen)[-1500:]}{rest[-1000:]}"), ""
        again = run_block(code, tmp)
        if again.returncode != 0:
            return f"the run after the interruption exited {again.returncode}\n{again.stdout[-1500:]}{again.stderr[-3000:]}", ""
        if _last_line(again.stdout) != _last_line(reference.stdout):
            return (f"the run after the interruption ended differently from an uninterrupted one:\n"
                    f"  uninterrupted: {_last_line(reference.stdout)!r}\n  interrupted, then again: "
                    f"{_last_line(again.stdout)!r}\n{again.stdout[-1500:]}"), ""
    return None, (f"interrupted by {m.group(1)} (exit {proc.returncode}) after {text!r}; the next run ended like "
                  f"the uninterrupted one: {_last_line(again.stdout)!r}")


def check(where: str, kind: str, code: str) -> Tuple[Optional[str], str]:
    """Run one block: (None, the line to print) when it passed, else (what went wrong, "")."""
    started = time.monotonic()
    try:
        if kind == "interrupt":
            problem, said = run_interrupted(code)
            return problem, f"ran {where} three times ({time.monotonic() - started:.1f} s)\n  {said}"
        proc = run_block(code)
    except subprocess.TimeoutExpired:
        return f"did not finish in {TIMEOUT} s", ""
    if proc.returncode != 0:
        return f"exit status {proc.returncode}\n{proc.stdout[-1500:]}{proc.stderr[-3000:]}", ""
    return None, f"ran {where} ({time.monotonic() - started:.1f} s)"


def _place(where: str) -> Tuple[str, int]:
    path, line = where.rsplit(":", 1)
    return path, int(line)


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="Markdown files (default: every docs/**/*.md)")
    parser.add_argument("--jobs", type=int, default=JOBS,
                        help=f"scripts run at the same time (default {JOBS}: most of a script's time is its "
                             "interpreter starting and importing torch, and one waits while another computes)")
    args = parser.parse_args(argv)
    files = args.files or sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)
    failures, counts, todo = [], {"run": 0, "interrupt": 0, "marked": 0, "fragment": 0}, []
    for path in files:
        for line, code in python_blocks(path.read_text()):
            where = f"{path.relative_to(ROOT) if path.is_absolute() else path}:{line}"
            try:
                kind = classify(code)
            except ValueError as exc:
                failures.append((where, f"{where}: {exc}"))
                continue
            counts[kind] += 1
            if kind in ("run", "interrupt"):
                todo.append((where, kind, code))
    todo.sort(key=lambda job: job[1] != "interrupt")  # the longest (three runs) first
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        running = {pool.submit(check, *job): job[0] for job in todo}
        for done in as_completed(running):
            problem, said = done.result()
            if problem:
                failures.append((running[done], f"{running[done]}: {problem}"))
            else:
                print(f"check_examples: {said}", flush=True)
    print(f"check_examples: {counts['run']} scripts run, {counts['interrupt']} interrupted and run again, "
          f"{counts['marked']} marked '{MARKER} ...', "
          f"{counts['fragment']} fragments (no import first)")
    for _, failure in sorted(failures, key=lambda f: _place(f[0])):  # in the files' order
        print(f"check_examples: FAILED {failure}\n"
              f"  (a block that cannot run here starts with '{MARKER} <why>')", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
