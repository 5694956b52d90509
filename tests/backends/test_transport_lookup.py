"""The transport lookup every collective makes (``gather``, ``reduce``, ``barrier``, ...): counted, never timed."""

import sys

from anyaccel import backends


def test_a_collectives_transport_lookup_makes_no_python_call_once_the_registry_is_made():
    """Once the backends' registry is made (on first use, not at import: the import budget), asking
    for a transport calls no Python function but the transport's own checks: the step's collectives
    do not pay for the registry being lazy (152 Python calls a step against 150 before, found in review)."""
    backends.transport_for("cpu")  # made (and the transport loaded) here
    calls = []

    def count(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == backends.__file__:
            calls.append(frame.f_code.co_name)

    sys.setprofile(count)
    try:
        backends.transport_for("cpu")
        backends.transport_for("no-such-device")  # (torch.distributed's)
        backends.active_transport()
    finally:
        sys.setprofile(None)
    assert calls and "_registry" not in calls, calls  # (the rest: the lookups themselves, XLA's started check)
