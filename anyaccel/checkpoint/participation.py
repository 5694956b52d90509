"""Who calls ``save_state`` / ``load_state``: every process, or the main process alone.

Scripts written for Accelerate call ``save_state`` either on every process (transformers'
``*_no_trainer.py``) or inside ``if accelerator.is_main_process:`` (diffusers' ``train_*.py``). The
main process cannot tell the two apart by itself, and guessing wrong either way is a hang: a
collective the others never enter, or others waiting for a main process that went on. So before
anything collective, the processes find out through the job's TCP store (the hang doctor's, under
this run's prefix), without any collective:

* every other process that calls it says so (``ckpt/<n>.<b>/arrived/<rank>``: its counts of
  collectives and of ``backward`` calls, the same on every process at a point they all reach) and
  waits for the main process's answer (``ckpt/<n>.<b>/decision/<rank>``);
* the main process waits until each other process has either said so, or is known to be further
  on — the hang doctor's answer shows it past this point of the script: more collectives, more
  ``backward`` calls or more batches than the main process has, or gone. (A process that called
  it cannot be further on: it waits here.) When every process takes part (the usual case: a few
  milliseconds), the collective protocol of :mod:`.training_state` runs as before; when none does,
  the main process saves or loads alone (about one doctor round, ~1 s); a mixture is an error on
  every process that called.

Alone is possible only where the main process holds the whole state (one process's strategy:
``Strategy.checkpoint_format == "full"`` without collective state dicts: DDP); under FSDP2, ZeRO-3 or
N-D parallelism the main process raises one :class:`~anyaccel.errors.CheckpointError` naming the
call and the fix instead. A process other than the main one that calls it alone raises too,
once it sees the main process further on. Without the job's store (it failed) every process
takes the collective protocol, as before this existed.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, Optional, Tuple

from .. import doctor
from ..doctor import TRACKER
from ..errors import CheckpointError

__all__ = ["alone", "full_state_on_main"]

#: seconds the main process waits for the others to say they take part before it asks the hang
#: doctor where they are, and between two such questions
_FIRST_ASK, _ASK_AGAIN = 0.2, 2.0


def full_state_on_main(strategy: Any) -> bool:
    """Whether the main process holds every model and optimizer state whole, so that it can write
    (and read) a checkpoint without the others: full checkpoints and state dicts that are not
    gathered (one process, DDP, XLA replicas). Local."""
    return strategy.checkpoint_format == "full" and not strategy.collective_state_dict


def alone(what: str, directory: Optional[str], rank: int, world: int, sharded_by: Optional[str]) -> bool:
    """True when this process (the main one) runs ``what`` (``"save_state"``, ``"load_state"``)
    without the others; False when every process takes part (then run the collective protocol).
    ``directory`` is what this process was given (None: automatic), for the messages.
    ``sharded_by``: None when the main process holds the whole state (:func:`full_state_on_main`),
    else the strategy's name, for the message. Raises :class:`CheckpointError`
    when the main process calls alone but cannot save or load alone (sharded states), when only
    some processes call, or (on another process) when the main process does not call. Collective
    in the sense that every process that calls it must be answered; it never enters a collective
    itself, and returns without waiting for a process that does not call."""
    found = doctor.current()
    store = found.store() if found is not None and world > 1 else None
    if store is None:  # one process, or no store: the collective protocol (as before)
        return False
    here = (TRACKER.seq, TRACKER.backwards, TRACKER.batches)
    outer = (TRACKER.op, TRACKER.counted)
    try:
        if rank != 0:
            TRACKER.op, TRACKER.counted, TRACKER.since = f"{what} (waiting for process 0's answer)", False, time.monotonic()
            _follow(found, store, what, directory, rank, here)
            return False
        TRACKER.op, TRACKER.counted, TRACKER.since = f"{what} (finding out which processes call it)", False, time.monotonic()
        return _decide(found, store, what, directory, world, here, sharded_by)
    finally:
        TRACKER.op, TRACKER.counted = outer


def _past(state: Dict[str, Any], here: Tuple[int, int, int]) -> bool:
    """Is the process whose doctor answered ``state`` further on in the script than ``here``?"""
    if state.get("missing"):
        return bool(state.get("left"))
    seq, backwards, batches = here
    return int(state.get("seq", 0)) > seq or int(state.get("backwards", 0)) > backwards or \
        int(state.get("batches", 0)) > batches


def _where(state: Dict[str, Any]) -> str:
    """Where a process further on is, for messages: its operation and its line."""
    if state.get("missing"):
        left = state.get("left") or {}
        return f"it left the job (exit code {left.get('code')}; {left.get('how', '?')})"
    top = (state.get("stack") or [{}])[0]
    line = f" at {top['file']}:{top['line']} (`{top.get('code', '')}`)" if top else ""
    return f"it is in {state['op']}{line}" if state.get("op") else f"it runs its own code{line}"


def _point(here: Tuple[int, int, int]) -> str:
    """The store keys' name for a point of the script: the counts of collectives and ``backward``
    calls (the same on every process there; two calls at different steps never share it)."""
    return f"ckpt/{here[0]}.{here[1]}"


def _decide(found: Any, store: Any, what: str, directory: Optional[str], world: int, here: Tuple[int, int, int],
            sharded_by: Optional[str]) -> bool:
    """The main process's side: wait for every other process to say it calls ``what``, or to be
    seen further on; then answer them."""
    point = _point(here)
    pending = set(range(1, world))
    arrived: Dict[int, Dict[str, Any]] = {}
    away: Dict[int, Dict[str, Any]] = {}
    start = time.monotonic()
    next_ask, generation, pause = start + _FIRST_ASK, None, 0.002
    while pending:
        for r in sorted(pending):
            key = f"{point}/arrived/{r}"
            if store.check([key]):
                arrived[r] = json.loads(store.get(key))
                pending.discard(r)
        if not pending:
            break
        if generation is not None:
            for r, state in found.answers(generation).items():
                if r in pending and _past(state, here):
                    away[r] = state
                    pending.discard(r)
        if pending and time.monotonic() >= next_ask:
            generation, next_ask = found.ask(), time.monotonic() + _ASK_AGAIN
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    for r in arrived:
        store.delete_key(f"{point}/arrived/{r}")
    problem = _problem(what, directory, arrived, away, sharded_by)
    for r in arrived:
        store.set(f"{point}/decision/{r}", json.dumps({"error": problem}))
    if problem is not None:
        raise CheckpointError(problem)
    return not arrived


def _problem(what: str, directory: Optional[str], arrived: Dict[int, Dict[str, Any]], away: Dict[int, Dict[str, Any]],
             sharded_by: Optional[str]) -> Optional[str]:
    """Why the call cannot go on (every process that called raises it), or None."""
    call = f"{what}({directory!r})" if directory is not None else f"{what}()"
    others = [r for r, a in arrived.items() if a.get("what") != what]  # (directories: the protocol checks them)
    if others:
        listing = "; ".join(f"process {r}: {arrived[r].get('what')}({arrived[r].get('directory')!r})" for r in others)
        return (f"process 0 called {call} while other processes called something else at the same point ({listing}): "
                "every process must make the same call")
    if arrived and away:
        where = "; ".join(f"process {r}: {_where(s)}" for r, s in sorted(away.items()))
        return (f"{call} was called by processes {', '.join(str(r) for r in [0, *sorted(arrived)])} but not by the others "
                f"({where}): call it on every process, or on the main process alone (`if accelerator.is_main_process:`)")
    if away and sharded_by is not None:
        where = "; ".join(f"process {r}: {_where(s)}" for r, s in sorted(away.items()))
        return (f"{call} was called by the main process alone (under `if accelerator.is_main_process:`), but the "
                f"{sharded_by!r} strategy keeps the model and optimizer state sharded over every process, so every "
                "process must write and read its part. Call it on every process: move the call "
                "out of the `if accelerator.is_main_process:` block (diffusers' scripts do this for DeepSpeed: `if "
                "accelerator.is_main_process or accelerator.distributed_type == DistributedType.DEEPSPEED:`). The "
                f"other processes did not call it ({where})")
    return None


def _follow(found: Any, store: Any, what: str, directory: Optional[str], rank: int, here: Tuple[int, int, int]) -> None:
    """Another process's side: say it calls ``what`` and wait for the main process's answer;
    raise when the main process is seen further on without having answered."""
    point = _point(here)
    arrived = f"{point}/arrived/{rank}"
    store.set(arrived, json.dumps({"what": what, "directory": directory}))
    key = f"{point}/decision/{rank}"
    next_ask, generation, pause = time.monotonic() + _FIRST_ASK, None, 0.002
    while True:
        if store.check([key]):
            answer = json.loads(store.get(key))
            store.delete_key(key)
            if answer.get("error"):
                raise CheckpointError(f"{answer['error']} (raised on process {rank} too)")
            return
        if generation is not None:
            main = found.answers(generation).get(0)
            if main is not None and _past(main, here) and not store.check([key]):  # it answered, then went on
                store.delete_key(arrived)  # a later call of the main process at this point must not see it
                call = f"{what}({directory!r})" if directory is not None else f"{what}()"
                raise CheckpointError(
                    f"{call} was called on process {rank} but not on the main process ({_where(main)}). Call it on "
                    "every process, or on the main process alone (`if accelerator.is_main_process:`); no other "
                    "process can save or load alone")
        if time.monotonic() >= next_ask:
            generation, next_ask = found.ask(), time.monotonic() + _ASK_AGAIN
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
