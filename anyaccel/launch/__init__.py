"""Starting the processes of a job, on torch's own elastic agent.

* ``command``   — ``anyaccel launch`` (command line → :class:`~anyaccel.launch.plan.LaunchRequest`);
* ``plan``      — flags + config file + detection (+ SLURM) → a frozen ``LaunchPlan`` (pure);
* ``runner``    — runs a plan on torch's elastic agent (``elastic``: one way to run workers;
  ``agent``: the one module that relies on torch elastic's internals, a ``LocalElasticAgent`` subclass);
* ``bootstrap`` — the first code of every worker: runs the user's script, records its failure;
* ``failures``  — worker errors, from the error file to the one message the user reads;
* ``notebook``  — ``notebook_launcher`` / ``debug_launcher`` (forked workers).

Nothing heavy is imported here: workers import this package before the user's script.
"""

from __future__ import annotations

from typing import Any

__all__ = ["notebook_launcher", "debug_launcher"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import notebook

        return getattr(notebook, name)
    raise AttributeError(f"module 'anyaccel.launch' has no attribute {name!r}")
