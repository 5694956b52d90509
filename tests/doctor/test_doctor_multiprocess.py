"""The multi-process tests (real launches, marked slow); the single-process ones are in tests/doctor/test_doctor.py.

The hang doctor, through `anyaccel launch` with 2 real CPU processes (tests/doctor/doctor_checks.py),
and its argument checks."""

from __future__ import annotations

import re

import pytest

from test_doctor import CHECKS, launch  # helpers shared with the unit tests


@pytest.mark.slow
def test_a_barrier_against_a_gather_raises_on_both_ranks_with_each_call_site():
    proc = launch("--num_processes", "2", "--cpu", CHECKS, "mismatch_barrier")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for rank in (0, 1):  # (the two ranks share the pipe: their lines may interleave)
        found = re.findall(rf"rank {rank} MISMATCH: (.*?)Every rank must call", proc.stdout)
        assert found, out
        assert "rank 0: barrier() at tests/doctor/doctor_checks.py:26" in found[0]
        assert "rank 1: gather() at tests/doctor/doctor_checks.py:28" in found[0]


@pytest.mark.slow
def test_a_rank_stuck_in_its_own_code_gets_a_report_and_the_timeout_error_is_that_report():
    """hang_timeout=3: rank 0 waits in reduce while rank 1 sleeps. The report names both places
    and repeats; when the process group's 12 s timeout fires, the launcher's failure is the report
    (CollectiveTimeoutError), not gloo's bare timeout."""
    proc = launch("--num_processes", "2", "--cpu", CHECKS, "hang")
    err = proc.stderr
    assert proc.returncode == 1, proc.stdout + err
    assert "a collective has waited longer than hang_timeout=3 s" in err
    assert ("verdict: rank 1 has not reached reduce (tests/doctor/doctor_checks.py:22) that rank 0 has waited in"
            in err)
    assert "rank 1 is in `time.sleep(25)` (tests/doctor/doctor_checks.py:21)" in err
    assert err.count("[anyaccel hang doctor] rank 0:") >= 2  # repeated at growing intervals
    headline = next(l for l in err.splitlines() if l.startswith("anyaccel launch: error:"))
    assert "CollectiveTimeoutError: rank 0 gave up waiting in reduce" in headline
    assert "Timed out waiting" in err  # what torch.distributed said, kept at the end


@pytest.mark.slow
def test_a_rank_that_exits_while_another_waits_is_named_with_its_exit_code():
    proc = launch("--num_processes", "2", "--cpu", CHECKS, "left")
    err = proc.stderr
    assert proc.returncode == 1, proc.stdout + err
    headline = next(l for l in err.splitlines() if l.startswith("anyaccel launch: error:"))
    assert "PeerExitedError: rank 1 left the job with exit code 0 (sys.exit at tests/doctor/doctor_checks.py:36)" \
        in headline
    assert "while rank 0 waited in reduce" in headline and "doctor_checks.py:38" in headline


@pytest.mark.slow
def test_a_rank_in_a_collective_while_another_is_in_backwards_all_reduce_ends_the_job_with_the_report():
    """hang_timeout=3: rank 0 gathers alone while rank 1 goes on into the gradient all-reduce of
    accelerator.backward (the process group's timeout is the default 30 min). Neither can ever
    complete, so the doctor ends the job: the launcher's failure is a CollectiveMismatchError
    carrying the report, instead of a report repeated until the timeout."""
    import time

    start = time.monotonic()
    proc = launch("--num_processes", "2", "--cpu", CHECKS, "backward")
    elapsed = time.monotonic() - start
    err = proc.stderr
    assert proc.returncode == 1, proc.stdout + err
    headline = next(line for line in err.splitlines() if line.startswith("anyaccel launch: error:"))
    assert ("CollectiveMismatchError: the hang doctor ended the job: rank 1 is inside the gradient all-reduce of "
            "accelerator.backward `acc.backward(model(x).sum())` (tests/doctor/doctor_checks.py:45) while rank 0 waits "
            "in gather `acc.gather(x)` (tests/doctor/doctor_checks.py:44)") in headline
    # the report follows the headline; its verdict starts from whichever rank has waited longer
    verdicts = [line for line in err.splitlines() if line.startswith("verdict: ")]
    assert any("rank 0 waits in gather" in v and "backward" in v for v in verdicts) or \
        any("rank 1 waits in backward" in v and "gather" in v for v in verdicts), err
    assert "does not answer" not in err and "exit 69" not in err, err  # both ranks reported at once and still heard each other
    assert elapsed < 120, elapsed  # loose: the doctor's first report (3 s) ends it, not the 30-minute timeout
