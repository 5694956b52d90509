"""Every process of a launch ends with it: the launch id, the sweep, and the guardian.

``anyaccel launch`` gives its workers a launch id of their own (``ANYACCEL_LAUNCH_ID``, a random
hex string) in their environment; every process below them inherits it — DataLoader workers,
``multiprocessing`` children, programs started with ``subprocess`` — whatever session or process
group it moved to. So the processes of a launch are exactly the live processes whose environment
carries that id (read from ``/proc/PID/environ``: the environment a process started with).

* :func:`end_processes` SIGKILLs them: the launcher calls it each time its agent has stopped the
  workers (the job finished, a worker failed, before a restart, on a signal). torch's agent only
  signals a worker's process group while the worker itself lives; a forked DataLoader worker once
  outlived its job by 73 minutes.
* :func:`start_guardian` starts a small process (the standard library only, this file run by path)
  that waits on a pipe from the launcher. The pipe closes when the launcher ends however it ends —
  SIGKILL included — and the guardian then ends the launch's processes and itself. The workers
  also die with the launcher by themselves (``PR_SET_PDEATHSIG``, :mod:`anyaccel.launch.bootstrap`);
  the guardian catches what they started.

Linux only (``/proc``); elsewhere both do nothing. Called by the launching process (Local).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from typing import List, Optional, Sequence

__all__ = ["LAUNCH_ID", "new_launch_id", "processes_of", "end_processes", "start_guardian"]

LAUNCH_ID = "ANYACCEL_LAUNCH_ID"  # declared in anyaccel.envvars too (this file imports no anyaccel module)


def new_launch_id() -> str:
    """A fresh launch id (random: two launches on one machine never share one)."""
    return uuid.uuid4().hex


def processes_of(launch_id: str, exclude: Sequence[int] = ()) -> List[int]:
    """The pids of the live processes whose environment carries ``launch_id`` (zombies excluded)."""
    if not launch_id or not os.path.isdir("/proc"):
        return []
    wanted = f"{LAUNCH_ID}={launch_id}".encode()
    skip = {os.getpid(), *exclude}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in skip:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if wanted not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile, or not ours to read
            continue
        if stat[stat.rindex(")") + 2:].split()[0] != "Z":
            found.append(int(entry))
    return found


def end_processes(launch_id: str, exclude: Sequence[int] = (), patience: float = 5.0) -> List[int]:
    """SIGKILL every process of the launch (but ``exclude``) until none is left or ``patience``
    seconds passed (a process may fork while it is being killed); reap those that are this
    process's children. Returns the pids killed."""
    killed: List[int] = []
    deadline = time.monotonic() + patience
    while True:
        left = processes_of(launch_id, exclude)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
        _reap(left)
        if not left or time.monotonic() > deadline:
            return killed
        time.sleep(0.05)


def _reap(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not this process's child
            pass


def start_guardian(launch_id: str) -> Optional[int]:
    """Start the guardian of the launch (module docstring); returns the write end of its pipe,
    which the caller keeps open for as long as the launch runs (closing it ends the guardian after
    a last sweep). None where there is no ``/proc``."""
    if not os.path.isdir("/proc"):
        return None
    read_end, write_end = os.pipe()  # both close-on-exec: no worker inherits the write end
    try:
        env = {k: v for k, v in os.environ.items() if k != LAUNCH_ID}  # not one of the processes it ends
        subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), launch_id, str(read_end)],
                         pass_fds=(read_end,), start_new_session=True,  # a Ctrl-C on the terminal is not for it
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    except OSError:
        os.close(write_end)
        return None
    finally:
        os.close(read_end)
    return write_end


def _guard(launch_id: str, fd: int) -> None:
    """The guardian's life: wait for the launcher's end (the pipe's end of file), then sweep."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            if not os.read(fd, 64):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    end_processes(launch_id, patience=5.0)


if __name__ == "__main__":  # python -I -S reaper.py LAUNCH_ID FD (start_guardian)
    _guard(sys.argv[1], int(sys.argv[2]))
