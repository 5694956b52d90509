"""anyaccel/launch/reaper.py: the processes of a launch are those that carry its id, whatever
session they moved to; the sweep ends exactly those, and the guardian does it when its pipe closes."""

import os
import subprocess
import sys
import time

import pytest

from anyaccel.launch import reaper

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")


def _sleeper(launch_id=None, new_session=False):
    env = dict(os.environ)
    env.pop(reaper.LAUNCH_ID, None)
    if launch_id:
        env[reaper.LAUNCH_ID] = launch_id
    return subprocess.Popen(["sleep", "60"], env=env, start_new_session=new_session)


def test_the_sweep_ends_the_processes_of_the_launch_and_no_other():
    launch_id = reaper.new_launch_id()
    ours = [_sleeper(launch_id), _sleeper(launch_id, new_session=True)]
    other = _sleeper(reaper.new_launch_id())
    try:
        assert sorted(reaper.processes_of(launch_id)) == sorted(p.pid for p in ours)
        killed = reaper.end_processes(launch_id)
        assert sorted(set(killed)) == sorted(p.pid for p in ours)
        for p in ours:
            p.wait(timeout=10)  # (reaped by the sweep already: they were this process's children)
            with pytest.raises(ProcessLookupError):
                os.kill(p.pid, 0)
        assert other.poll() is None and reaper.processes_of(launch_id) == []
    finally:
        for p in ours + [other]:
            p.kill()
            p.wait()


def test_the_guardian_sweeps_when_its_launcher_is_gone():
    launch_id = reaper.new_launch_id()
    child = _sleeper(launch_id, new_session=True)
    try:
        pipe = reaper.start_guardian(launch_id)
        assert pipe is not None
        time.sleep(0.5)
        assert child.poll() is None  # the launcher (this process) still runs
        os.close(pipe)  # what its end, however it ends, does
        assert child.wait(timeout=30) == -9
    finally:
        child.kill()
        child.wait()
