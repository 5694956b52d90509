"""The single-process tests; the multi-process ones (real launches, marked slow) are in tests/multiprocess/test_notebook_launcher.py.

`notebook_launcher` / `debug_launcher`: forked workers that really train as 2 CPU ranks.

A notebook session is played in a fresh Python process (tests/scripts/launch_notebook_session.py),
so the pytest process's own state (threads, other tests' objects) cannot leak into the fork.
"""

import os
import sys

import pytest



def test_cuda_error_names_the_cause_and_the_fix(monkeypatch):
    from anyaccel.launch import notebook

    monkeypatch.setattr(notebook, "_live_accelerators", lambda: 0)
    monkeypatch.setattr("anyaccel.devices.cuda_initialized", lambda: True)
    with pytest.raises(notebook.LauncherError) as exc:
        notebook._check_parent(use_cpu=False)
    text = str(exc.value)
    assert "model.cuda()" in text and "restart the kernel" in text
    notebook._check_parent(use_cpu=True)  # CPU-only workers do not care


def test_tpu_goes_through_torch_xla_spawn(monkeypatch):
    """On a TPU the launch is torch-xla's spawn, behind anyaccel.backends.xla.spawn."""
    import types

    import anyaccel.backends  # noqa: F401 - the package is imported before its xla submodule is faked
    from anyaccel.launch import notebook

    calls = []

    class FakeXlaBackend:  # what anyaccel.backends.xla.XlaBackend does with a notebook function
        spawns_processes = True

        def __init__(self, env):
            pass

        def spawn(self, fn, args, nprocs):
            calls.append((fn, args, nprocs, dict(os.environ)))
            return "r0"

    fake = types.SimpleNamespace(XlaBackend=FakeXlaBackend)
    monkeypatch.setitem(sys.modules, "anyaccel.backends.xla", fake)
    monkeypatch.setattr(notebook, "resolve_environment", lambda env: types.SimpleNamespace(device_type="xla"),
                        raising=False)
    monkeypatch.setattr(notebook, "_check_parent", lambda use_cpu: None)

    def fn(x):
        return x

    assert notebook.notebook_launcher(fn, args=(3,), num_processes=8, mixed_precision="bf16") == "r0"
    (called,) = calls
    assert called[:3] == (fn, (3,), 8) and called[3]["ANYACCEL_MIXED_PRECISION"] == "bf16"
    assert "ANYACCEL_MIXED_PRECISION" not in os.environ or os.environ["ANYACCEL_MIXED_PRECISION"] != "bf16"
