"""The suite's warm launcher (tests/scripts/warm_launch.py) gives a worker script what ``anyaccel
launch --num_processes N --cpu`` gives it, and fails, hangs and leftovers show as they would."""

from __future__ import annotations

import json
import time

import pytest

from conftest import alive, alive_after, warm_launch

pytestmark = pytest.mark.slow

SCRIPT = '''
import json, os, sys, time
import torch, torch.distributed as dist
from anyaccel import Accelerator

acc = Accelerator()
what = sys.argv[2]
t = torch.tensor([float(acc.process_index + 1)])
dist.all_reduce(t)
info = {"argv": sys.argv[1:], "name": __name__, "rank": acc.process_index, "world": acc.num_processes,
        "sum": t.item(), "cpu": os.environ.get("ANYACCEL_USE_CPU"), "omp": torch.get_num_threads(),
        "cwd": os.getcwd(), "path0": sys.path[0], "pid": os.getpid()}
with open(os.path.join(sys.argv[1], f"rank{acc.process_index}.json"), "w") as fh:
    json.dump(info, fh)
if what == "raise" and acc.process_index == 1:
    raise RuntimeError("deliberate failure on rank 1")
if what == "hang" and acc.process_index == 1:
    time.sleep(600)
acc.end_training()
'''



@pytest.fixture
def script(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return path


def test_the_script_runs_as_main_on_every_rank_with_the_launchers_variables(tmp_path, script):
    proc = warm_launch(3, script, tmp_path, "ok", "--flag=1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [r["rank"] for r in ranks] == [0, 1, 2] and {r["world"] for r in ranks} == {3}
    assert {r["sum"] for r in ranks} == {6.0}  # a real gloo group of 3 processes
    assert len({r["pid"] for r in ranks}) == 3
    for r in ranks:
        assert r["argv"] == [str(tmp_path), "ok", "--flag=1"] and r["name"] == "__main__"
        assert r["cpu"] == "1" and r["omp"] == 1 and r["cwd"] == str(tmp_path) and r["path0"] == str(tmp_path)


def test_a_failing_rank_fails_the_job_with_its_traceback(tmp_path, script):
    proc = warm_launch(2, script, tmp_path, "raise")
    assert proc.returncode == 1
    assert "deliberate failure on rank 1" in proc.stderr


def test_a_job_past_its_timeout_is_killed_with_its_workers_and_says_so(tmp_path, script):
    start = time.monotonic()
    proc = warm_launch(2, script, tmp_path, "hang", timeout=20)
    assert proc.returncode == -9 and "ran past its timeout (20 s)" in proc.stderr
    assert time.monotonic() - start < 60
    pids = [json.loads((tmp_path / f"rank{r}.json").read_text())["pid"] for r in range(2)]
    time.sleep(0.5)
    assert not alive(pids)


def test_a_wait_interrupted_by_pytest_timeout_ends_the_job_and_the_next_job_gets_its_own_answer(tmp_path, script):
    """pytest-timeout (or Ctrl-C) raises inside the wait: the server, the job and its workers are
    killed (the next request must never read the interrupted job's answer)."""
    import signal

    import warm_launch as wl

    class Interrupted(Exception):
        pass

    hung = tmp_path / "hung"
    hung.mkdir()

    def interrupt(signum, frame):  # once both ranks run (the server may be starting: seconds of imports)
        if not all((hung / f"rank{r}.json").exists() for r in range(2)):
            signal.alarm(1)
            return
        raise Interrupted()

    # (SIGALRM is pytest-timeout's too: its timer is replaced for the rest of this test, which its own
    # bounds keep short: the 10 s wait below, the next job's timeout)
    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(2)
    try:
        with pytest.raises(Interrupted):
            warm_launch(2, script, hung, "hang", timeout=120)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert wl._Server.proc is None
    pids = [json.loads((hung / f"rank{r}.json").read_text())["pid"] for r in range(2)]
    assert not alive_after(pids, within=10)
    proc = warm_launch(2, script, tmp_path, "ok")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((tmp_path / "rank1.json").read_text())["argv"] == [str(tmp_path), "ok"]
