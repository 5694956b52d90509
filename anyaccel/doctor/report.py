"""The hang doctor's words: the report of where every rank is and its verdict, and the user's
stack (``file:line`` of a call, library frames left out) that the report and the collectives'
errors name. Pure functions of the states the doctor collected; local to the calling process.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any, Dict, List, Optional

from .tracker import BACKWARD_SYNC

__all__ = ["user_stack", "call_site", "library_frame", "format_report", "verdict", "sure_mismatch"]

#: anyaccel's own directory (this file is ``anyaccel/doctor/report.py``): its frames are library frames
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def library_frame(filename: str) -> bool:
    """Whether ``filename`` is anyaccel's, torch's or the interpreter's (left out of user stacks)."""
    if filename.startswith("<frozen"):
        return True
    name = os.path.abspath(filename)
    return (name.startswith(_PACKAGE_DIR) or f"{os.sep}torch{os.sep}" in name or f"{os.sep}threading.py" in name
            or name.startswith("<frozen") or f"{os.sep}runpy.py" in name)


def user_stack(frame: Any = None, limit: int = 6) -> List[Dict[str, Any]]:
    """The Python stack at ``frame`` (default: the caller's), innermost first, library frames
    (anyaccel, torch, runpy) left out: ``[{"file", "line", "func", "code"}, ...]``. Local."""
    frame = frame if frame is not None else sys._getframe(1)
    out = []
    for fs in reversed(traceback.extract_stack(frame)):
        if library_frame(fs.filename):
            continue
        out.append({"file": os.path.relpath(fs.filename) if not fs.filename.startswith("<") else fs.filename,
                    "line": fs.lineno, "func": fs.name, "code": (fs.line or "").strip()})
        if len(out) >= limit:
            break
    return out


def call_site(frame: Any = None) -> str:
    """``file:line`` of the innermost frame of the user's code (``"?"`` when there is none)."""
    stack = user_stack(frame if frame is not None else sys._getframe(1), limit=1)
    return f"{stack[0]['file']}:{stack[0]['line']}" if stack else "?"


def _where(state: Dict[str, Any]) -> str:
    top = (state.get("stack") or [{}])[0]
    if not top:
        return "outside the user's code"
    code = f"`{top['code']}` " if top.get("code") else ""
    return f"{code}({top['file']}:{top['line']})"


def format_report(states: Dict[int, Dict[str, Any]], world: int, timeout: float) -> str:
    """The report printed when a collective waited longer than ``timeout``: one line per rank of
    the ``world`` (from ``states``: rank -> what it published, or ``missing``) and the verdict."""
    lines = [f"a collective has waited longer than hang_timeout={timeout:g} s; where every rank is:"]
    for r in range(world):
        s = states[r]
        if s.get("missing"):
            left = s.get("left")
            why = f"left the job (exit code {left['code']}; {left['how']}) after collective #{left['seq']}" if left \
                else "not answering (its host is unreachable, the process died or is stopped, or its main thread holds " \
                     "the GIL)"
            where = f" ({s['host']}, pid {s['pid']})" if s.get("host") else ""
            lines.append(f"  rank {r}{where}: {why}")
            continue
        where = f"waiting {s['waited']:g} s in {s['op']} (collective #{s['seq']})" if s.get("op") else \
            f"not in a collective (last was #{s['seq']})"
        lines.append(f"  rank {r} ({s['host']}, pid {s['pid']}): {where}")
        for f in s.get("stack", [])[:4]:
            lines.append(f"      {f['file']}:{f['line']} in {f['func']}: {f['code']}")
    lines.append("verdict: " + verdict(states, world))
    return "\n".join(lines)


def verdict(states: Dict[int, Dict[str, Any]], world: int) -> str:
    """One sentence saying which rank is elsewhere than the one that waits longest, or that the
    collective itself is stuck."""
    present = [states[r] for r in range(world) if not states[r].get("missing")]
    waiting = [s for s in present if s.get("op")]
    if not waiting:
        return "no rank is in a collective any more"
    w = max(waiting, key=lambda s: s["waited"])
    site = _where(w).rsplit("(", 1)[-1].rstrip(")") if w.get("stack") else "?"
    parts = []
    for r in range(world):
        s = states[r]
        if s.get("missing"):
            left = s.get("left")
            on = f" on {s['host']}" if s.get("host") else ""
            parts.append(f"rank {r}{on} left the job (exit code {left['code']})" if left else f"rank {r}{on} does not answer")
        elif not s.get("op"):
            parts.append(f"rank {r} has not reached {w['op']} ({site}) that rank {w['rank']} has waited in for "
                         f"{w['waited']:g} s; rank {r} is in {_where(s)}")
        elif (s["op"], s["seq"]) != (w["op"], w["seq"]):
            parts.append(f"rank {r} waits in {s['op']} {_where(s)} (collective #{s['seq']}) while rank {w['rank']} "
                         f"waits in {w['op']} ({site}, #{w['seq']})")
    if not parts:
        return (f"every rank waits in {w['op']} (#{w['seq']}, {site}) — the collective itself is stuck (network, or "
                "a collective of another process group in between)")
    return "; ".join(parts)


def sure_mismatch(states: Dict[int, Dict[str, Any]], world: int, timeout: float) -> Optional[str]:
    """The sentence for a mismatch that can never resolve itself, else None: a rank that has
    waited ``timeout`` seconds in an anyaccel collective while another is inside the gradient
    all-reduce of ``accelerator.backward`` (a step that synchronises gradients). Each needs the
    other in *its* collective, so neither completes. The rank in backward must have been there
    half the timeout too: a backward that long is not local work finishing (a manual ``no_sync``
    backward would end by itself)."""
    present = [states[r] for r in range(world) if not states[r].get("missing")]
    stuck = [s for s in present if s.get("op") and s.get("counted") and s.get("waited", 0) >= timeout]
    in_backward = [s for s in present if s.get("op") == BACKWARD_SYNC and s.get("waited", 0) >= timeout / 2]
    if not stuck or not in_backward:
        return None
    a, b = stuck[0], in_backward[0]
    return (f"rank {b['rank']} is inside the gradient all-reduce of accelerator.backward {_where(b)} while rank "
            f"{a['rank']} waits in {a['op']} {_where(a)} (collective #{a['seq']}): each waits for the other in a different "
            f"collective, so neither can ever complete. Every rank must call the same collectives in the same order: look "
            f"at why rank {a['rank']} called {a['op']} where rank {b['rank']} went on training (a collective or save_state "
            "under `if accelerator.is_main_process:`?)")
