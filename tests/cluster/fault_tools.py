"""Helpers of the fault tests (test_faults.py, test_hsdp_two_hosts.py) that harness.py does not
have: a process's output read line by line as it comes, with the time each line arrived, so that
a test can measure from a fault to a line (a restart's "resumed", an error) instead of only to
the end of the process.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from typing import List, Optional, Tuple

import pytest


class Tail:
    """The output of ``proc`` (text, stdout+stderr) read by a thread: ``lines`` holds
    ``(monotonic time, line)``; :meth:`wait_for` waits for a line that matches."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines: List[Tuple[float, str]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._lock:
                self.lines.append((time.monotonic(), line))

    def text(self) -> str:
        with self._lock:
            return "".join(line for _, line in self.lines)

    def find(self, pattern: str, after: float = 0.0) -> Optional[Tuple[float, "re.Match[str]"]]:
        """The first line that arrived after ``after`` and matches ``pattern``: (time, match)."""
        with self._lock:
            lines = list(self.lines)
        for t, line in lines:
            m = re.search(pattern, line)
            if t >= after and m:
                return t, m
        return None

    def wait_for(self, pattern: str, timeout: float, after: float = 0.0) -> Tuple[float, "re.Match[str]"]:
        """Wait for :meth:`find`; fail the test (with the output) past ``timeout`` or when the
        process ended without such a line."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.find(pattern, after)
            if found is not None:
                return found
            if self.proc.poll() is not None:
                self._thread.join(5)
                found = self.find(pattern, after)
                if found is not None:
                    return found
                pytest.fail(f"ended ({self.proc.returncode}) without a line matching {pattern!r}:\n{self.text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no line matching {pattern!r} after {timeout:.0f} s:\n{self.text()[-4000:]}")
            time.sleep(0.05)

    def end(self, timeout: float) -> Optional[int]:
        """Wait for the process and the reader; the exit status (None: still running)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self._thread.join(10)
        return self.proc.returncode


def end_all(tails: List[Tail], timeout: float, cluster) -> List[str]:
    """Wait for every process (``timeout`` in all); their outputs. Past it, kill every process on
    the cluster's hosts and fail the test with the outputs."""
    deadline = time.monotonic() + timeout
    for tail in tails:
        if tail.end(max(1.0, deadline - time.monotonic())) is None:
            for t in tails:
                if t.proc.poll() is None:
                    os.killpg(t.proc.pid, 9)
            for h in cluster.hosts:
                cluster.kill(h.index, "KILL")
            pytest.fail(f"still running after {timeout:.0f} s; outputs:\n" + "\n----\n".join(t.text()[-3000:] for t in tails))
    return [t.text() for t in tails]


def no_process_left(cluster, within: float = 10.0) -> None:
    """Assert that no process is left on any host (waiting up to ``within`` seconds)."""
    deadline = time.monotonic() + within
    while any(cluster.processes(h.index) for h in cluster.hosts) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {h.name: cluster.processes(h.index) for h in cluster.hosts}
    assert not any(left.values()), f"processes left: {left}"


__all__ = ["Tail", "end_all", "no_process_left"]
