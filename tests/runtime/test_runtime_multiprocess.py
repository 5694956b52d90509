"""The multi-process tests (real launches, marked slow); the single-process ones are in tests/runtime/test_runtime.py.

What an Accelerator starts is owned by its Runtime and released by end_training() or garbage
collection: doctor subscriptions, signal handlers; two accelerators keep their own hang_timeout."""

from __future__ import annotations


import pytest

from conftest import launch_checks


@pytest.mark.slow
def test_accelerators_in_a_real_job_release_their_doctor_subscriptions(tmp_path):
    """2 ranks through `anyaccel launch`: two accelerators keep hang_timeouts 5 and 50; collecting
    one, ten more in a loop, then end_training() leave no subscription and no handler."""
    for report in launch_checks("runtime_checks.py", tmp_path):
        assert report["both"] == [5, 50] and report["own"] == [5, 50] and report["effective"] == 5
        assert report["after_gc"] == [50] and report["effective_after_gc"] == 50
        assert report["most_in_loop"] == 2  # `second` and the loop's current one, never more
        assert report["after_loop_gc"] == [50]
        assert report["handler_installed"] and report["handler_after_end_training"]
        assert report["after_end_training"] == []
