"""Per-step fault tolerance on torchft: training that goes on when a replica group dies, and a
restarted group that heals from a live peer instead of a checkpoint.

With ``fault_tolerance`` on, the outermost data-parallel dimension is made of **replica groups**
(one process each, or several that split the model with FSDP2 or DDP inside the group; the
job's :class:`~anyaccel.strategies.mesh.ProcessMesh` knows its group) that share nothing but
their averaged gradients. Each step,
the live groups agree on who takes part (a quorum, at torchft's Lighthouse); a step commits only
when the groups in it finished; a group that dies is left out of the next quorum and the others
go on; a group that (re)joins behind the others receives their state over HTTP and continues
exactly where they are. Guide: ``docs/guides/fault-tolerance.md``.

Modules (one idea each):

* :mod:`.settings` — the option's value and the launcher's variables, resolved once;
  ``require_torchft`` (torchft is the optional, pinned ``ft`` extra);
* :mod:`.replica` — :class:`Replica`, the group's side of each step: quorum, gradient average,
  commit; owned by the runtime and asked by the ``Accelerator`` at the step's boundaries;
* :mod:`.healing` — what a joining group receives from a peer (weights, optimizer, schedulers,
  scaler, loader positions, registered objects, RNG, step) and how it is applied;
* :mod:`.transport` — torchft's HTTP transfer, counted; its gloo group, kept instead of destroyed;
* :mod:`.store` — where the group's ranks find torchft's TCP store (rank 0 serves one when the
  launcher's listens on 127.0.0.1 only), under a key the group's ranks agree on;
* :mod:`.shards` — what one FSDP2 rank holds of a sharded tensor: each rank averages and heals
  its own shards with the same rank of the other groups;
* :mod:`.lighthouse` — the Lighthouse in the launcher's process;
* :mod:`.lineage` — a fingerprint of a group's committed history, compared by the groups of each
  new quorum, so that groups at one step count with different weights are found and healed.

Semantics, decided:

* a step averages the gradients of the groups **in its quorum**, divided by their number;
* each group reads its own share of every epoch (the loader shards over ``groups x processes``
  whether or not the others live): the share of a group that is away is **skipped**, not
  redistributed, and a step that does not commit skips the batches of every group in it. Group
  ``g`` sees, at step ``s``, the same samples whether or not another group died, so a run's data
  order never depends on when failures happened;
* collectives of the script (``gather``, ``reduce``, ``wait_for_everyone``) and
  ``is_main_process`` stay within a replica group: each group is a job of its own that shares
  gradients, and logs, prints and checkpoints its own (under ``project_dir/replica_group_<g>``).

Nothing here is imported by ``import anyaccel``; torchft is imported when a group first joins.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FaultToleranceSettings", "Replica", "HealReport", "HealingState", "Lighthouse", "resolve_settings",
           "require_torchft"]

_HOME = {"FaultToleranceSettings": "settings", "resolve_settings": "settings", "require_torchft": "settings",
         "Replica": "replica", "HealReport": "replica", "HealingState": "healing", "Lighthouse": "lighthouse"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
