"""Helpers for the two-host cluster tests: the :class:`Cluster` a test drives (see conftest.py).

Kept out of conftest.py so that test modules import it by a name of its own (``harness``) while
the suite's shared helpers (tests/conftest.py) are loaded from their file under another name.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import pytest

_spec = importlib.util.spec_from_file_location("anyaccel_tests_shared", Path(__file__).resolve().parents[1] / "conftest.py")
_shared = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_shared)
ROOT, SCRIPTS, CONSOLE_SCRIPT, clean_env = _shared.ROOT, _shared.SCRIPTS, _shared.CONSOLE_SCRIPT, _shared.clean_env

SCRIPT = ROOT / "scripts" / "cluster.sh"
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Host:
    index: int
    name: str
    addr: str


class Cluster:
    """Hosts of the running cluster and what a test does to them. Local helpers (no state)."""

    def __init__(self, hosts: List[Host]):
        self.hosts = hosts
        self._procs: List[subprocess.Popen] = []

    def _sh(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, check=check)

    def popen(self, host: int, cmd: List[str], env: Optional[dict] = None, **kw) -> subprocess.Popen:
        """Start ``cmd`` on ``host`` (its namespace and host name); stdout+stderr captured as text."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.STDOUT)
        env = {**(env or clean_env()), "ANYACCEL_CLUSTER_PREFIX": _prefix()}  # cluster.sh's host set
        proc = subprocess.Popen(["bash", str(SCRIPT), "on", str(host), *map(str, cmd)], text=True,
                                env=_on_env(env), cwd=str(ROOT), start_new_session=True, **kw)
        self._procs.append(proc)
        return proc

    def run(self, host: int, cmd: List[str], timeout: float = 60, env: Optional[dict] = None) -> subprocess.CompletedProcess:
        env = {**(env or clean_env()), "ANYACCEL_CLUSTER_PREFIX": _prefix()}  # cluster.sh's host set
        return subprocess.run(["bash", str(SCRIPT), "on", str(host), *map(str, cmd)], capture_output=True, text=True,
                              env=_on_env(env), cwd=str(ROOT), timeout=timeout)

    def launch(self, host: int, script: Path, *args, nproc: int = 2, port: int = 29500, extra=(), env=None):
        """``anyaccel launch`` machine ``host`` of a job over every host, ``nproc`` processes per host."""
        cmd = [sys.executable, "-c", CONSOLE_SCRIPT, "launch", "--cpu", "--num_machines", len(self.hosts),
               "--machine_rank", host, "--main_process_ip", self.hosts[0].addr, "--main_process_port", port,
               "--num_processes", nproc * len(self.hosts), *extra, script, *args]
        return self.popen(host, cmd, env=env)

    def link(self, host: int, up: bool) -> None:
        self._sh("link", str(host), "up" if up else "down")

    def slow(self, host: int, rate: str, latency: str) -> None:
        self._sh("slow", str(host), rate, latency)

    def fast(self, host: int) -> None:
        self._sh("fast", str(host))

    def kill(self, host: int, signal: str = "KILL") -> None:
        self._sh("kill", str(host), signal)

    def processes(self, host: int) -> List[int]:
        out = subprocess.run(["ip", "netns", "pids", f"{_prefix()}-h{host}"], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def pids(self, host: int, contains: str) -> List[int]:
        """Processes on ``host`` whose command line contains ``contains``."""
        out = []
        for pid in self.processes(host):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    if contains.encode() in fh.read():
                        out.append(pid)
            except OSError:
                pass
        return out

    def end_started(self) -> None:
        """Kill what :meth:`popen` started (their process groups), nothing else."""
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 9)
                except ProcessLookupError:
                    pass
        self._procs.clear()

    def reset(self) -> None:
        """After a test: links up, no shaping, no process left on any host."""
        self.end_started()
        for h in self.hosts:
            self.link(h.index, True)
            self.fast(h.index)
            self.kill(h.index, "CONT")
            self.kill(h.index, "KILL")


class Slurm:
    """The SLURM over the hosts (``scripts/cluster.sh slurm start``: slurmctld on host 0, one slurmd
    per host). Commands run on a host (default 0) with this cluster's ``SLURM_CONF`` and the venv
    first on ``PATH``; batch jobs inherit that environment (``--export=ALL``). Local helpers."""

    def __init__(self, cluster: Cluster, conf: str):
        self.cluster, self.conf = cluster, conf

    def env(self, **extra: str) -> dict:
        env = clean_env(SLURM_CONF=self.conf, **extra)
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        return env

    def popen(self, cmd: List, host: int = 0) -> subprocess.Popen:
        return self.cluster.popen(host, cmd, env=self.env())

    def run(self, cmd: List, timeout: float = 60, host: int = 0) -> subprocess.CompletedProcess:
        return self.cluster.run(host, cmd, timeout=timeout, env=self.env())

    def cancel_all(self) -> None:
        """Cancel every job of this cluster and wait (up to a minute) until none is left."""
        self.run(["scancel", "--full", "--user", "root"])
        deadline = time.monotonic() + 60
        while self.run(["squeue", "-h"]).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.5)


def slurm_command(action: str) -> subprocess.CompletedProcess:
    """``scripts/cluster.sh slurm ACTION`` (start, stop, status, env) for this cluster's prefix."""
    return subprocess.run(["bash", str(SCRIPT), "slurm", action], capture_output=True, text=True, timeout=300)


def _prefix() -> str:
    return os.environ.get("ANYACCEL_CLUSTER_PREFIX", "aa")


def _on_env(env: Optional[dict]) -> dict:
    """``env`` (default: :func:`clean_env`, which drops ANYACCEL_*) plus this cluster's prefix, so
    that `cluster.sh on` reaches this cluster's hosts (the command sees the prefix too: harmless)."""
    out = dict(env or clean_env())
    for key in ("ANYACCEL_CLUSTER_PREFIX", "ANYACCEL_CLUSTER_HOSTS"):
        if key in os.environ:
            out[key] = os.environ[key]
    return out


def skip_reason() -> Optional[str]:
    if os.name != "posix" or os.geteuid() != 0:
        return "the two-host cluster needs root (network namespaces): run `make test-cluster` as root"
    if shutil.which("ip") is None or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` is not available (iproute2 with network namespaces)"
    status = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True, text=True)
    if status.returncode != 0:
        return "the two-host cluster is not started: `make test-cluster` (or `bash scripts/cluster.sh start`)"
    return None


def wait_all(procs, timeout: float, cluster: Optional[Cluster] = None) -> List[str]:
    """Wait for every process; return their outputs. Fails the test past ``timeout``, killing them
    (and, given ``cluster``, every process on its hosts: workers hold the output pipes too)."""
    deadline = time.monotonic() + timeout
    outs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
            for h in (cluster.hosts if cluster is not None else []):
                cluster.kill(h.index, "KILL")
            rest = []
            for p in procs:
                try:
                    rest.append(p.communicate(timeout=10)[0] or "")
                except subprocess.TimeoutExpired:
                    rest.append("(no output: a process still holds its pipe)")
            pytest.fail(f"still running after {timeout:.0f} s; outputs:\n" + "\n----\n".join(r[-3000:] for r in rest))
        outs.append(out)
    return outs


__all__ = ["Cluster", "Host", "Slurm", "slurm_command", "wait_all", "skip_reason", "ROOT", "SCRIPTS", "HERE",
           "clean_env"]
