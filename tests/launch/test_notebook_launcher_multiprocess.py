"""`notebook_launcher` / `debug_launcher`: forked workers that really train as 2 CPU ranks.

A notebook session is played in a fresh Python process (tests/launch/launch_notebook_session.py),
so the pytest process's own state (threads, other tests' objects) cannot leak into the fork.
"""

import json
import subprocess
import sys

import pytest

from conftest import SCRIPTS, clean_env

pytestmark = pytest.mark.torch_versions  # torch's elastic agent forks the workers: one session, every test


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    out = tmp_path_factory.mktemp("notebook")
    proc = subprocess.run([sys.executable, str(SCRIPTS / "launch_notebook_session.py"), str(out)],
                          capture_output=True, text=True, timeout=240, env=clean_env())  # fmt: skip
    assert proc.returncode == 0, f"STDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}"
    results = json.loads((out / "session.json").read_text())
    results["ranks"] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    results["stdout"], results["stderr"] = proc.stdout, proc.stderr
    return results


@pytest.mark.slow
def test_a_closure_trains_as_two_real_cpu_ranks(session):
    r0, r1 = session["ranks"]
    assert (r0["rank"], r1["rank"], r0["world"], r1["world"]) == (0, 1, 2, 2)
    assert session["parent_pid"] not in (r0["pid"], r1["pid"]) and r0["pid"] != r1["pid"]
    # 37 samples, 2 ranks x batch 4: 4 full rounds, then 5 samples split 3 + 3 with one padding sample
    assert len(r0["seen"]) == len(r1["seen"]) == 19
    assert len(set(r0["seen"]) & set(r1["seen"])) == 1, "disjoint shares apart from the one padding sample"
    assert set(r0["seen"]) | set(r1["seen"]) == set(range(37))
    assert sorted(r0["gathered"]) == sorted(r1["gathered"]) == list(range(37)), "each sample counted once"
    assert r0["device"] == "cpu" and r0["mixed_precision"] == "bf16"
    assert "Launching on 2 CPU process(es)" in session["stdout"]
    # what every worker's Accelerator() reads first was made once in the kernel, not again after the fork
    assert all(r0["made_in_kernel"].values()) and all(r1["made_in_kernel"].values()), r0["made_in_kernel"]


@pytest.mark.slow
def test_rank_zero_return_value_comes_back(session):
    assert session["returned"] == {"rank0_says": "hello", "world": 2, "rank": 0}


@pytest.mark.slow
def test_a_worker_exception_is_reraised_with_rank_and_traceback(session):
    failure = session["failure"]
    assert failure["type"] == "WorkerFailedError" and failure["rank"] == 1
    assert failure["original"] == "ValueError('bad value x on rank 1')" == failure["cause"]
    message = failure["message"]
    assert "rank 1 of 2 failed" in message and "traceback of rank 1" in message
    assert 'in failing' in message and "ValueError: bad value x on rank 1" in message
    assert "anyaccel/launch" not in message, "the launcher's own frames are hidden"
    assert failure["stopped_after"] < 10, "rank 0 (waiting in a collective) was stopped within seconds"
    assert session["children_left"] == [] and session["children_at_end"] == []
    assert session["sigint_handler_restored"], ("Ctrl-C in the notebook is KeyboardInterrupt again; SIGINT's "
                                                f"handler is {session.get('sigint_handler')}")


@pytest.mark.slow
def test_debug_launcher_runs_cpu_ranks_and_restores_the_environment(session):
    assert session["debug"] == {"world": 2, "device": "cpu", "use_cpu": "1"}
    assert session["env_restored"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, expected",
    [
        ("too_many", "num_processes=2 but this machine has 1 visible GPU"),
        ("cuda_initialized", "CUDA is already initialised in this process"),
        ("accelerator_in_parent", "an Accelerator already exists in this process"),
        ("accelerator_in_parent_debug", "move `accelerator = Accelerator()` inside the training function"),
    ],
)
def test_mistakes_are_refused_before_anything_starts(session, case, expected):
    refused = session[case]
    assert refused is not None and refused["type"] == "LauncherError"
    assert expected in refused["message"]
    assert refused["seconds"] < 2
    assert session["one_process_runs_here"]
