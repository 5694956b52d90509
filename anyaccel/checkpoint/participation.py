"""Who calls ``save_state`` / ``load_state``: every process, or the main process alone.

Scripts written for Accelerate call ``save_state`` either on every process (transformers'
``*_no_trainer.py``) or inside ``if accelerator.is_main_process:`` (diffusers' ``train_*.py``). The
main process cannot tell the two apart by itself, and guessing wrong either way is a hang: a
collective the others never enter, or others waiting for a main process that went on. So before
anything collective, the processes find out through the job's TCP store (the hang doctor's, under
this run's prefix), without any collective. A point of the script is named by the collective
sequence number (the number of anyaccel collectives a process has started: the same on every
process there, since the collectives' shape header checks it), never by counts of batches or
``backward`` calls (they differ between processes with uneven loaders, skipped accumulation syncs,
or an evaluation on the main process alone).

* Every other process that calls it says so: one key per process, reused and deleted after use
  (``ckpt/arrived/<rank>``: the sequence number, the call and its directory, a nonce), and waits
  for the main process's answer (``ckpt/decision/<rank>``, which echoes the nonce: an answer is
  for exactly one call). It watches the main process meanwhile (its doctor publishes its state
  while someone watches: no requests of its own) and raises only when the main process is surely
  not coming: blocked in a collective it never entered, or in a synchronising ``backward`` (or a
  collective forward: a sharded model's, or a DDP model's that broadcasts buffers) that the main
  process entered after this one started waiting — or
  gone.
* The main process, the only one that asks the hang doctor where the others are, takes each
  arrival at its point (atomically: a process that gives up withdraws its arrival the same way)
  and waits until every other process has either arrived or is surely not calling: blocked in an
  anyaccel collective numbered past the main process's count (one it never entered), or in a
  synchronising ``backward`` (or a collective forward: a sharded model's, which all-gathers, or a
  DDP model's that broadcasts its buffers from rank 0 — BatchNorm's statistics) that the main
  process never ran (these are counted: the same number on every process at a point), or entered
  after the main process started waiting, or is still inside a second later; or it left the job. Anything else — a process that is late, evaluating,
  in a local accumulation micro-step — is waited for (the doctor reports the wait when it lasts).
  When every process takes part (the usual case: a few milliseconds), the collective protocol of
  :mod:`.training_state` runs as before; when none does, the main process saves alone (the others
  are blocked at their next synchronising step, about one doctor round, ~1-2 s); a mixture is an
  error on every process that called.

Alone is possible only where the main process holds the whole state (one process's strategy:
``Strategy.checkpoint_format == "full"`` without collective state dicts: DDP); under FSDP2, ZeRO-3
or N-D parallelism the main process raises one :class:`~anyaccel.errors.CheckpointError` naming the
call and the fix instead. ``save_state`` alone writes the checkpoint a save by every process would.
``load_state`` alone loads into the main process alone, as Accelerate does under DDP: its model,
optimizer, schedulers, registered objects, loaders' epochs and RNG; the other processes keep what
they have. DDP broadcasts parameters only when it wraps the model (each step all-reduces
gradients, so every replica takes the same update from different weights), so the replicas stay
apart until every process loads: :func:`loaded_alone` says so once per process, with that fix.
``resume()`` on the main process alone is refused under every strategy (it returns where the loop
starts, for every process). A process other than the main one that calls any of them alone raises
once it sees the main process blocked ahead of it. Without the job's store (it failed) every
process takes the collective protocol, as before this existed; a store that fails during the
finding out, or a hang doctor whose thread has stopped, is a :class:`CheckpointError` naming it,
never a wait.

A process that waits for the main process's answer reads the store at growing intervals
(:data:`_POLL_FIRST` seconds after it arrives, doubling up to :data:`_POLL_MAX`), the main process
its arrival keys up to every :data:`_MAIN_POLL_MAX` seconds: thousands of waiting processes do not
flood the store on the main process's machine while it evaluates or writes alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import warnings
from typing import Any, Dict, Iterator, Optional

from .. import doctor
from ..doctor import BACKWARD_SYNC, TRACKER
from ..doctor.tracker import FORWARD_BUFFERS, FORWARD_SYNC
from ..errors import CheckpointError

__all__ = ["alone", "full_state_on_main", "loaded_alone", "by_itself"]

#: seconds the main process waits for the others to say they take part before it asks the hang
#: doctor where they are, and between two such questions
_FIRST_ASK, _ASK_AGAIN = 0.2, 1.0
#: seconds a waiting process gives the main process's doctor to publish its state before it
#: concludes that doctor has stopped (its thread ended, its store connection failed)
_MAIN_SILENT = 30.0
#: seconds between a waiting process's reads of the store: the first after arriving, the longest
#: (the main process's doctor publishes its state about once a second: reading more often tells
#: nothing new); and the longest between the main process's reads of the others' arrival keys
_POLL_FIRST, _POLL_MAX, _MAIN_POLL_MAX = 0.05, 1.0, 0.2
_TAKEN, _WITHDRAWN = b"taken", b"withdrawn"


def full_state_on_main(strategy: Any) -> bool:
    """Whether the main process holds every model and optimizer state whole, so that it can write
    (and read) a checkpoint without the others: full checkpoints and state dicts that are not
    gathered (one process, DDP, XLA replicas). Local."""
    return strategy.checkpoint_format == "full" and not strategy.collective_state_dict


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call of ``what`` at a point of the script, as this process sees it."""

    what: str
    directory: Optional[str]
    seq: int  # collectives started (the point: the same on every process there)
    syncs: int  # synchronising ``backward`` calls: the same on every process at a point
    forwards: int  # collective forwards (sharded models', DDP's buffer broadcasts): the same too

    def __str__(self) -> str:
        return f"{self.what}({self.directory!r})" if self.directory is not None else f"{self.what}()"


def alone(what: str, directory: Optional[str], rank: int, world: int, sharded_by: Optional[str]) -> bool:
    """True when this process (the main one) runs ``what`` (``"save_state"``, ``"load_state"``,
    ``"resume"``) without the others; False when every process takes part (then run the collective
    protocol). ``directory`` is what this process was given (None: automatic), for matching and
    messages. ``sharded_by``: None when the main process holds the whole state
    (:func:`full_state_on_main`), else the strategy's name, for the message. Raises
    :class:`CheckpointError` when the main process calls alone but cannot (sharded states;
    ``resume``), when only some processes call,
    (on another process) when the main process does not call, and when the job's store or the
    hang doctor fails meanwhile. Collective in the sense that every process that calls it is
    answered; it never enters a collective itself, and returns without waiting for a process that
    surely does not call."""
    found = doctor.current()
    store = found.store() if found is not None and world > 1 else None
    if store is None:  # one process, or no store: the collective protocol (as before)
        return False
    call = _Call(what, directory, TRACKER.seq, TRACKER.syncs, TRACKER.forwards)
    outer = (TRACKER.op, TRACKER.counted)
    try:
        if rank != 0:
            TRACKER.op, TRACKER.counted, TRACKER.since = f"{what} (waiting for process 0's answer)", False, time.monotonic()
            _follow(found, store, call, rank)
            return False
        TRACKER.op, TRACKER.counted, TRACKER.since = f"{what} (finding out which processes call it)", False, time.monotonic()
        return _decide(found, store, call, world, sharded_by)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - the store failed: say so, never wait
        raise CheckpointError(
            f"{call} on process {rank}: the job's store failed while finding out which processes call it "
            f"({type(exc).__name__}: {exc}). The processes cannot agree on who saves: call it on every process "
            "(then no store is needed), or check the main node's network and resume from the last checkpoint") from exc
    finally:
        TRACKER.op, TRACKER.counted = outer


# ---- when a process is surely not coming -----------------------------------------------------------
def _blocked(state: Dict[str, Any], seq: int, counts: Dict[str, int], first: Optional[Dict[str, Any]],
             before: Optional[Dict[str, Any]]) -> bool:
    """Is the process whose doctor answered ``state`` blocked where the asking process (at
    collective count ``seq``, with ``counts`` of synchronising ``backward`` calls and sharded
    forwards) will never join it, or gone? ``first`` is its earliest answer since the asker started
    waiting, ``before`` its previous (distinct) answer, about a second earlier. Pure; the rules of
    the module docstring. Counts of batches and of local ``backward`` calls are never compared:
    they differ between processes at one point of the script."""
    if state.get("missing"):
        return bool(state.get("left"))  # not answering (yet): ask again
    op = state.get("op")
    if op and state.get("counted"):
        return int(state.get("seq", 0)) > seq  # a collective the asker never entered
    count = {BACKWARD_SYNC: "syncs", FORWARD_SYNC: "forwards", FORWARD_BUFFERS: "forwards"}.get(op or "")
    if count is None:  # its own code, a local micro-step, a save of its own: it may still come
        return False
    mine = int(state.get(count, 0))
    if mine > counts[count]:
        return True  # a synchronising call the asker never made (every process makes the same ones)
    if first is not None and mine > int(first.get(count, 0)):
        return True  # entered after the asker started waiting: the asker is not in it
    # (a count below the asker's: DDP's join shadowed some for it) still inside one over two answers
    return before is not None and before.get("op") == op and int(before.get(count, 0)) == mine


def _where(state: Dict[str, Any]) -> str:
    """Where a process is, for messages: its operation and its line."""
    if state.get("missing"):
        left = state.get("left") or {}
        return f"it left the job (exit code {left.get('code')}; {left.get('how', '?')})"
    top = (state.get("stack") or [{}])[0]
    line = f" at {top['file']}:{top['line']} (`{top.get('code', '')}`)" if top else ""
    return f"it is in {state['op']}{line}" if state.get("op") else f"it runs its own code{line}"


class _Seen:
    """The answers seen of one process while waiting: its first, and its last two distinct."""

    def __init__(self) -> None:
        self.first: Optional[Dict[str, Any]] = None
        self.before: Optional[Dict[str, Any]] = None
        self.last: Optional[Dict[str, Any]] = None

    def add(self, state: Dict[str, Any], key: Any) -> None:
        if self.last is not None and self.last.get("_key") == key:
            return
        state = dict(state, _key=key)
        self.first = self.first or state
        self.before, self.last = self.last, state

    def blocked(self, seq: int, counts: Dict[str, int]) -> bool:
        return self.last is not None and _blocked(self.last, seq, counts, self.first, self.before)


# ---- the main process --------------------------------------------------------------------------
def _take(store: Any, rank: int, call: _Call, whole: bool) -> Optional[Dict[str, Any]]:
    """Process ``rank``'s arrival at ``call``'s point, taken (atomically against its withdrawal),
    or None. An arrival with another directory is this call only where every process may name its
    own (``whole``: DDP, as Accelerate allows); elsewhere it is another call, answered by an error."""
    key = f"ckpt/arrived/{rank}"
    if not store.check([key]):
        return None
    raw = store.get(key)
    try:
        record: Dict[str, Any] = json.loads(raw)
    except ValueError:  # "taken"/"withdrawn" being cleared
        return None
    if int(record.get("seq", -1)) != call.seq:
        return None  # another point (it cannot reach this one while it waits there)
    if store.compare_set(key, raw, _TAKEN) != _TAKEN:
        return None  # withdrawn in between
    store.delete_key(key)
    if record.get("directory") != call.directory and not whole and record.get("what") == call.what:
        record["other_directory"] = True
    return record


def _decide(found: Any, store: Any, call: _Call, world: int, sharded_by: Optional[str]) -> bool:
    """The main process's side: wait for every other process to arrive or to be surely not
    calling; then answer those that arrived."""
    pending = set(range(1, world))
    arrived: Dict[int, Dict[str, Any]] = {}
    away: Dict[int, Dict[str, Any]] = {}
    seen = {r: _Seen() for r in pending}
    counts = {"syncs": call.syncs, "forwards": call.forwards}
    next_ask, generation, pause, problem = time.monotonic() + _FIRST_ASK, None, 0.002, None
    try:
        while pending:
            for r in sorted(pending):
                record = _take(store, r, call, sharded_by is None)
                if record is not None:
                    arrived[r] = record
                    pending.discard(r)
            if not pending:
                break
            if not found.alive:
                problem = (f"{call} on the main process: its hang doctor has stopped (its thread ended or its store "
                           f"connection failed), so it cannot find out whether processes {sorted(pending)} call it too. "
                           "Call it on every process (no finding out needed), or on the main process alone with a "
                           "working store")
                break
            if generation is not None:
                for r, state in found.answers(generation).items():
                    if r in pending:
                        seen[r].add(state, generation)
                        if seen[r].blocked(call.seq, counts):
                            away[r] = seen[r].last or state
                            pending.discard(r)
            if pending and time.monotonic() >= next_ask:
                generation, next_ask = found.ask(), time.monotonic() + _ASK_AGAIN
            time.sleep(pause)
            pause = min(pause * 2, _MAIN_POLL_MAX)
        problem = problem or _problem(call, arrived, away, sharded_by)
    except BaseException as exc:  # a store failure: those that arrived must not wait for ever
        problem = problem or f"{call} failed on the main process ({type(exc).__name__}: {exc})"
        raise
    finally:
        for r, record in arrived.items():
            try:
                store.set(f"ckpt/decision/{r}", json.dumps({"nonce": record.get("nonce"), "error": problem}))
            except Exception:  # noqa: BLE001 - the store is what failed: they see it fail too
                pass
    if problem is not None:
        raise CheckpointError(problem)
    return not arrived


def _problem(call: _Call, arrived: Dict[int, Dict[str, Any]], away: Dict[int, Dict[str, Any]],
             sharded_by: Optional[str]) -> Optional[str]:
    """Why the call cannot go on (every process that called raises it), or None."""
    others = [r for r, a in arrived.items() if a.get("what") != call.what or a.get("other_directory")]
    if others:
        listing = "; ".join(f"process {r}: {arrived[r].get('what')}({arrived[r].get('directory')!r})" for r in others)
        return (f"process 0 called {call} while other processes called something else at the same point ({listing}): "
                "every process must make the same call" + (" with the same directory (the "
                                                            f"{sharded_by!r} strategy shares one checkpoint)"
                                                            if sharded_by else ""))
    if arrived and away:
        where = "; ".join(f"process {r}: {_where(s)}" for r, s in sorted(away.items()))
        return (f"{call} was called by processes {', '.join(str(r) for r in [0, *sorted(arrived)])} but not by the others "
                f"({where}): call it on every process, or on the main process alone (`if accelerator.is_main_process:`)")
    if not away:
        return None
    where = "; ".join(f"process {r}: {_where(s)}" for r, s in sorted(away.items()))
    if sharded_by is not None:
        return (f"{call} was called by the main process alone (under `if accelerator.is_main_process:`), but the "
                f"{sharded_by!r} strategy keeps the model and optimizer state sharded over every process, so every "
                "process must write and read its part. Call it on every process: move the call "
                "out of the `if accelerator.is_main_process:` block (diffusers' scripts do this for DeepSpeed: `if "
                "accelerator.is_main_process or accelerator.distributed_type == DistributedType.DEEPSPEED:`). The "
                f"other processes did not call it ({where})")
    if call.what == "resume":
        return (f"{call} was called by the main process alone (under `if accelerator.is_main_process:`): it returns "
                "where the training loop starts, and the other processes would start elsewhere. Call it on every "
                f"process, before the loop. The other processes did not call it ({where})")
    return None  # save_state writes alone; load_state loads into this process alone (loaded_alone says so)


@contextlib.contextmanager
def by_itself(alone: bool, what: str, directory: Any) -> Iterator[None]:
    """The block runs ``what`` on this process alone (when ``alone``): an anyaccel collective
    entered in it — from a save or load pre-hook — raises :class:`CheckpointError` instead of
    waiting for processes that went on (:class:`anyaccel.doctor.waiting`). Local."""
    if not alone:
        yield
        return
    outer = TRACKER.alone
    TRACKER.alone = f"{_Call(what, None if directory is None else str(directory), 0, 0, 0)}, which the main process runs alone"
    try:
        yield
    finally:
        TRACKER.alone = outer


_WARNED: Dict[str, bool] = {}


def loaded_alone(directory: str) -> None:
    """Warn, once per process, that ``load_state`` ran on the main process alone (the first
    ``directory`` is named). Local."""
    if _WARNED.get("load_state"):
        return
    _WARNED["load_state"] = True
    warnings.warn(
        f"load_state({directory!r}) was called by the main process alone (under `if accelerator.is_main_process:`): "
        "only this process's model, optimizer, schedulers, registered objects, loaders' epochs and RNG were restored, "
        "as Accelerate does. The other processes keep their weights: DDP broadcasts parameters only when it wraps "
        "the model (buffers such as BatchNorm's statistics at each training forward), and every step applies the "
        "same averaged gradients to each replica's own weights, so the replicas stay apart from now on. Call load_state on every process (move it out of the `if "
        "accelerator.is_main_process:` block; diffusers' scripts resume on every process). (Warned once.)",
        UserWarning, stacklevel=4)


# ---- another process ---------------------------------------------------------------------------
def _follow(found: Any, store: Any, call: _Call, rank: int) -> None:
    """Another process's side: say it calls, and wait for the main process's answer; raise when
    the main process is surely not coming (blocked ahead, gone, or its doctor stopped)."""
    nonce = f"{os.getpid()}.{time.monotonic_ns()}"
    arrived, decided = f"ckpt/arrived/{rank}", f"ckpt/decision/{rank}"
    raw = json.dumps({"seq": call.seq, "what": call.what, "directory": call.directory, "nonce": nonce}).encode()
    store.set(arrived, raw)
    answered = False
    try:
        found.watch_main(True)
        main, heard, pause, last_round = _Seen(), time.monotonic(), _POLL_FIRST, None
        counts = {"syncs": call.syncs, "forwards": call.forwards}
        while True:
            if store.check([decided]):
                answer = json.loads(store.get(decided))
                if answer.get("nonce") == nonce:
                    answered = True
                    store.delete_key(decided)
                    if answer.get("error"):
                        raise CheckpointError(f"{answer['error']} (raised on process {rank} too)")
                    return
            state = found.main_state()
            if state is not None and state.get("round") != last_round:
                last_round, heard = state.get("round"), time.monotonic()
                main.add(state, last_round)
            why = None
            if main.blocked(call.seq, counts):
                why = (f"{call} was called on process {rank} but not on the main process ({_where(main.last or {})}). "
                       "Call it on every process, or on the main process alone (`if accelerator.is_main_process:`); "
                       "no other process can save or load alone")
            elif time.monotonic() - heard > _MAIN_SILENT:
                why = (f"{call} on process {rank}: the main process's hang doctor has not published where it is for "
                       f"{_MAIN_SILENT:g} s (its thread stopped, or its store connection failed), so this process "
                       "cannot find out whether the main process calls it too. Call it on every process")
            if why is not None and _withdraw(store, arrived, raw):
                answered = True
                raise CheckpointError(why)
            time.sleep(pause)  # (not withdrawn: the main process took the arrival, its answer comes)
            pause = min(pause * 2, _POLL_MAX)  # bounded: N waiting processes must not flood the main one's store
    finally:
        try:
            found.watch_main(False)
            if not answered:  # leaving on an error of its own (the store's): the main process must not take it
                _withdraw(store, arrived, raw)
        except Exception:  # noqa: BLE001 - the store failed: the error that ends this says so
            pass


def _withdraw(store: Any, key: str, raw: bytes) -> bool:
    """Take back an arrival the main process has not taken (then a later call of the main process
    at this point does not see it); False when it has been taken (its answer comes)."""
    if store.compare_set(key, raw, _WITHDRAWN) != _WITHDRAWN:
        return False
    store.delete_key(key)
    return True

