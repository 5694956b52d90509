"""One replica group's side of per-step fault tolerance: :class:`Replica`, owned by the runtime.

Why this module is longer than ~450 lines: it is one protocol (quorum, average, vote, heal) around
one torchft ``Manager``, and about a third of it is the errors of its failure paths, each naming the
group, the rank, the value and the fix; the pieces that stand alone already live beside it
(averaging, healing, shards, store, transport, vote, settings).

The step protocol, with torchft's ``Manager`` (one per process; the group's rank 0 runs its
server, which heartbeats to the Lighthouse):

1. **Quorum** (:meth:`Replica.begin_step`), when the training loader is about to fetch the first
   batch of an optimizer step (or, failing that, at the step's first gradient average): the live
   replica groups agree on who takes part in this step; the gloo group of the gradients is
   rebuilt when membership changed. The quorum is **asynchronous** (torchft's
   ``use_async_quorum=True``): the request leaves at the batch boundary and the forward pass runs
   while it travels; the step waits for it only at its first gradient bucket
   (:meth:`Replica._settle`). A quorum is **synchronous** (waited for at the boundary, as before)
   when this group may be behind the others: its first one, the one of ``resume()``
   (:meth:`Replica.join`) and the one after a step that did not commit. Only there can a heal
   arrive as the rule (a group that committed its last step is at the highest step unless a quorum
   formed without it: :meth:`Replica._settle` says what then), and a group that heals there (fetching the healing state, :mod:`.healing`, from a live
   peer over HTTP) applies it before its forward pass. In the step a group heals in, torchft
   counts only the groups that were already at the highest step: the healed group's gradients
   are zeros in the average, which is divided by the number of the others (every group computes
   the same average, so the weights stay bitwise equal); it takes part fully from the next step.
   The sender's state is the one of its step boundary: :meth:`Replica.begin_step` takes it
   (references, buffers copied) before the quorum leaves, and torchft's quorum thread sends that
   while the main thread runs the forward pass. In the first step of every new quorum the groups
   compare their committed histories (:mod:`.lineage`: groups at one step count with different
   weights are found there, the step does not commit, and a group whose history is not kept
   stops to heal in ``resume()``).
2. **Average** (:mod:`.averaging`), during ``backward``: every gradient, in buckets started as
   they fill (in one order on every group), all-reduced over the groups of the quorum and divided
   by their number; :meth:`Replica.average_gradients` waits for them after ``backward``. (When the
   step's quorum is not formed before ``backward`` — no prepared training loader — it is formed
   after ``backward`` and the buckets start then; under DDP inside the group they all start after
   ``backward`` too, from the gradients DDP wrote.) A group lost during it makes the all-reduce
   fail fast (its sockets reset) or after ``timeout_s``; torchft records the error instead of
   raising.
3. **Commit** (:meth:`Replica.commit`), at ``optimizer.step()``: the ranks of the group vote;
   the step is applied only when every rank of the group finished its all-reduce and at least
   ``min_replicas`` groups took part. A step that is not committed is skipped like an fp16
   overflow step (``optimizer.step_was_skipped``; the scheduler does not step) and its batch is
   lost; the next quorum leaves out the lost group once the Lighthouse stops hearing from it
   (its heartbeat timeout).

Every wait is bounded: a quorum by ``quorum_timeout_s``, an all-reduce, a vote and a transfer by
``timeout_s``, and ``MAX_UNCOMMITTED`` steps in a row that cannot commit end the job with
:class:`~anyaccel.errors.FaultToleranceError` (never a silent hang).

What a user reads (stderr, once per event, on the group's rank 0): a heal with its bytes and
seconds, a step that did not commit and why, a change in the number of groups taking part.
Local to the process, except :meth:`begin_step` / :meth:`average_gradients` / :meth:`commit`,
which are collective over the replica groups of the quorum.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
from typing import Any, Dict, List, Optional

import torch

from ..errors import FaultToleranceError
from .averaging import BucketedAverage, fsdp_units, synced_after_backward
from .healing import Boundary, HealingState
from .lineage import QuorumMembers, advance, compare, verdict
from .reduce import start_average
from .settings import FaultToleranceSettings, require_torchft
from .store import torchft_store
from .transport import counting_transport, current_group, keeping_gloo
from .vote import decide, group_vote

__all__ = ["Replica", "HealReport", "MAX_UNCOMMITTED"]

#: steps in a row that may fail to commit before the job stops (a heal that keeps failing, a peer
#: that keeps dying): torchft's ``max_retries``
MAX_UNCOMMITTED = 20
_PREFIX = "[anyaccel fault tolerance]"


class HealReport:
    """One heal: the committed ``step`` it brought this group to, ``bytes`` received, ``fetch_s``
    (the transfer) and ``total_s`` (the whole quorum, transfer and loading included)."""

    def __init__(self, step: int, nbytes: int, fetch_s: float, total_s: float):
        self.step, self.bytes, self.fetch_s, self.total_s = step, nbytes, fetch_s, total_s

    def __repr__(self) -> str:
        return f"HealReport(step={self.step}, bytes={self.bytes}, fetch_s={self.fetch_s:.3f}, total_s={self.total_s:.3f})"


def _quiet_torchft(debug: bool) -> None:
    """torchft logs every reconfiguration and error with a traceback, and its Rust side logs each
    quorum at INFO; anyaccel says what happened in one line instead (``--debug`` shows theirs)."""
    if not debug:
        os.environ.setdefault("RUST_LOG", "error")  # read when torchft's extension starts logging
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _lineage_words(manager: Any, lineages: List[int], trained: List[bool], kept: int) -> "tuple[str, str]":
    """What the lineage check says when the groups of a quorum hold different histories: the
    error's text, and the line's (every group's fingerprint, which groups have committed nothing
    since loading theirs, which history is kept and, on a tie, why). Local, pure."""
    holding = sum(1 for x in lineages if x == kept)
    loaded = [rank for rank, up in enumerate(trained) if not up]
    if not loaded:
        fresh = ""
    elif len(loaded) == len(trained):
        fresh = "; no group has committed a step since its history was loaded (from a checkpoint or a heal)"
    else:
        fresh = (f"; replica rank{'s' if len(loaded) > 1 else ''} {', '.join(map(str, loaded))} "
                 f"{'have' if len(loaded) > 1 else 'has'} committed no step since {'their' if len(loaded) > 1 else 'its'} "
                 "history was loaded (from a checkpoint or a heal)")
    tie = "" if sum(1 for x in set(lineages) if lineages.count(x) == holding) == 1 else (
        " (as many groups hold another: of those, the one more groups hold that committed a step with it since it "
        "was loaded, then the first group's in torchft's order of replica ids as text)")
    rank = getattr(getattr(manager, "_pg", None), "_rank", None)
    me = f" (this group: replica rank {rank})" if isinstance(rank, int) else ""
    why = (f"the replica groups of this quorum hold {len(set(lineages))} different histories of the same "
           f"{manager.current_step()} committed steps")
    how = (f"{why} (a step some groups committed was taken again by others in a quorum without them: a raising "
           "backward without find_unused_parameters=True, or a failed vote; or a group resumed from a checkpoint "
           f"of another history: docs/guides/fault-tolerance.md); by replica rank {lineages}{me}{fresh}; kept: "
           f"the history {holding} of the {len(lineages)} groups hold, {kept}{tie}; no group commits this step")
    return why, how


class Replica:
    """This process's part in the replica groups (module docstring). Made by the runtime when
    ``fault_tolerance`` is on; the torchft ``Manager`` is made when the group first joins a
    quorum (``resume()`` or the first step), so a group heartbeats to the Lighthouse only once it
    is ready to train. ``store``: ``(host, port)`` of the group's TCP store (the launcher's), or
    None to serve one here (a group of one process started without a launcher). ``restarted``:
    this process is a restart of its group (see :meth:`join`). ``attempt``: the launcher's restart
    attempt (``Environment.launch.restart_attempt``), which names the key its store's port is shared
    under (:mod:`.store`); the runtime replaces it (:attr:`attempt`) with the highest of the group's
    ranks' once their process group is formed. ``find_unused_parameters``:
    DDP's option (``DistributedDataParallelKwargs``), for the average over the groups (:mod:`.averaging`)."""

    def __init__(self, settings: FaultToleranceSettings, rank: int, world_size: int,
                 store: Optional["tuple[str, int]"], debug: bool = False, restarted: bool = False,
                 attempt: int = 0, find_unused_parameters: bool = False):
        self.settings = settings
        self.find_unused_parameters = find_unused_parameters
        self._rank, self._world_size, self._store_address = rank, world_size, store
        # the group's restart attempt (Environment.launch): names the store key; the runtime sets the one
        # every rank agrees on once the process group is formed (runtime._agreed_restart_attempt)
        self.attempt = attempt
        self._debug = debug
        self._restarted = restarted
        self._manager: Any = None
        self._own_store: Any = None
        self._transport: Any = None
        self._healing: Optional[HealingState] = None
        self._pending = False  # a quorum is formed for the step in progress and not yet decided
        self._settled = False  # the pending quorum's answer was waited for (heal applied, participants noted)
        self._quorum_ok = False  # ... and it came: no error, no heal that ends the group (abandon() relies on it)
        self._synchronous = True  # the pending quorum is waited for at the boundary (module docstring, 1)
        self._committed_last = False  # the previous step committed (else the next quorum is synchronous)
        self._boundary: Optional[Boundary] = None  # the healing state at this step's boundary
        self._heal_mark = (0, 0.0, 0, 0.0)  # transfers, seconds, bytes, clock when the pending quorum started
        self._decision: Optional[bool] = None  # the step's commit decision (several optimizers ask once)
        self._joining = False  # resume(): a heal may set the loaders' positions
        self._restored: Dict[str, int] = {}  # torchft's counters from a checkpoint, applied when the manager starts
        self._lineage = 0  # the committed history's fingerprint (.lineage); carried by heals and checkpoints
        self._boundary_lineage = 0  # ... as it stood at this step's boundary (what a peer healing now receives)
        self._members: Optional[QuorumMembers] = None  # torchft's client, remembering each quorum's member ids
        # this process committed a step with the history it holds (not since it was loaded from a checkpoint or
        # a heal): the lineage check's tie-break keeps the history of groups that trained it (.lineage.verdict)
        self._trained = False
        self._checked_quorum: Optional[int] = None  # the quorum whose groups were found to hold one lineage
        self._lineage_error: Optional[FaultToleranceError] = None  # what this group's check reported (join() lets it pass)
        self._rejoin = False  # the check in join() kept another group's history: join() heals from one of those
        self._must_restart: Optional[FaultToleranceError] = None  # (.lineage) not kept in the loop: raised at every step
        self._participants: Optional[int] = None
        self._average: Optional[BucketedAverage] = None
        self._units: Dict[int, int] = {}  # FSDP2's units of the prepared models' parameters (.averaging.fsdp_units)
        self._after_backward = False  # DDP inside the group: the buckets start after backward (.averaging)
        self._names: Dict[int, str] = {}  # id(parameter) -> its name in its prepared model (for what is said)
        self._said_zeroed: "set[int]" = set()  # ids of the parameters already named as getting zeros
        self._overlapped = False  # this step's buckets were armed before backward (under DDP they start after it)
        self._averaged = False  # this step's gradients were averaged (commit refuses a step without)
        self.heals: List[HealReport] = []
        self.uncommitted = 0  # steps that did not commit, over the run
        self.healed_step: Optional[int] = None  # the Accelerator step the last heal carried (None: none yet)
        self.closed = False

    # ---- set-up -------------------------------------------------------------------------------
    def attach(self, training_state: Any) -> None:
        """What a heal sends and loads: ``training_state`` (a callable, or a
        ``weakref.WeakMethod`` of one, returning the ``Accelerator``'s
        :class:`~anyaccel.checkpoint.TrainingState`; :class:`.healing.HealingState`). Local."""
        self._healing = HealingState(training_state, exclude=[self])

    def _manager_now(self) -> Any:
        if self._manager is not None:
            return self._manager
        _quiet_torchft(self._debug)  # before the import: torchft's Rust side reads RUST_LOG when it loads
        torchft = require_torchft()
        timeout = datetime.timedelta(seconds=self.settings.timeout_s)
        host, port = self._store()
        self._transport = counting_transport(timeout)
        try:
            self._manager = torchft.Manager(
                pg=keeping_gloo(timeout), load_state_dict=self._load, state_dict=self._state_dict,
                min_replica_size=self.settings.min_replicas, use_async_quorum=True, timeout=timeout,
                quorum_timeout=datetime.timedelta(seconds=self.settings.quorum_timeout_s),
                connect_timeout=timeout, rank=self._rank, world_size=self._world_size, store_addr=host,
                store_port=port, lighthouse_addr=self.settings.lighthouse,
                replica_id=f"anyaccel_group_{self.settings.group}", checkpoint_transport=self._transport,
                max_retries=MAX_UNCOMMITTED)
        except Exception as exc:  # the Rust server's errors are plain RuntimeErrors
            self._transport.shutdown(wait=False)
            raise FaultToleranceError(
                f"replica group {self.settings.group} could not join the torchft Lighthouse at "
                f"{self.settings.lighthouse} ({type(exc).__name__}: {exc}); check that it runs (anyaccel launch "
                "--fault_tolerance on starts one) and that this machine reaches that address") from exc
        self._members = QuorumMembers(self._manager._client)  # (.lineage: each quorum's member ids)
        self._manager._client = self._members
        if self._restored:
            self._manager.load_state_dict(self._restored)
        return self._manager

    def _store(self) -> "tuple[str, int]":
        """The TCP store torchft uses (:func:`.store.torchft_store`); a store this process serves
        for it is kept until :meth:`close`. Collective over the group's ranks where rank 0 serves it."""
        host, port, self._own_store = torchft_store(self.settings, self._rank, self._world_size, self._store_address,
                                                    self.attempt)
        return host, port

    # ---- the step --------------------------------------------------------------------------
    def join(self) -> Optional[HealReport]:
        """Join the quorum of the next step now, healing from a live peer when this group is
        behind (every piece of :mod:`.healing`, loader positions included); returns the heal, or
        None. Called by ``resume()`` before the training loop. Collective over the groups.

        A *restarted* group that finds itself alone, with nothing of its own to continue from (no
        checkpoint: step 0), exits with status 0 and says why, instead of training from scratch
        alone: the other groups have finished (the usual case: it restarted as they ended) or
        are all gone. A join that failed (the peer it was healing from died during the transfer,
        the new gloo group could not form) raises :class:`FaultToleranceError`: the process ends
        and its launcher starts it again, rather than training on a half-made state."""
        if self._pending:
            return None
        healed_before = len(self.heals)
        self._joining = True
        rejoined = False
        try:
            self.begin_step()
            if self._rejoin:  # (.lineage) not kept: one count lower, it heals now from a group that kept its history
                self._rejoin, rejoined = False, True
                self._fail_step(self._lineage_error or FaultToleranceError("another history is kept"))
                self._manager._step -= 1
                self.begin_step()
        finally:
            self._joining = False
        heal = self.heals[-1] if len(self.heals) > healed_before else None
        if rejoined and (heal is None or self._rejoin):  # no group that kept its history to heal from, or still not kept
            unhealed = FaultToleranceError(
                f"replica group {self.settings.group}: its history of the same committed steps was not the one kept, "
                "and it could not heal from a group that kept it (none was left in the next quorum, or that quorum "
                "did not keep it either); it stops, and its launcher starts it again (--max_restarts)")
            self._fail_step(unhealed)
            raise unhealed
        error: Any = self._manager.errored()
        if error is not None and not rejoined and getattr(error, "original_exception", error) is self._lineage_error:
            error = None  # (.lineage) kept: this group goes on; the step does not commit
        if error is not None:  # e.g. the peer it healed from died during the transfer: start again
            raise FaultToleranceError(
                f"replica group {self.settings.group} could not join the running job ({_cause(error)}); its launcher "
                "starts it again if it has restarts left (--max_restarts), and it heals from a live group then")
        if heal is None and self._restarted and self.settings.groups > 1 and self._participants == 1 \
                and self.step == 0:
            self._say("restarted, but no other replica group is left to heal from and this one has no checkpoint of "
                      "its own: the others have finished (or are all gone); it stops instead of training from scratch "
                      "alone (exit 0)")
            self.close()
            raise SystemExit(0)
        return heal

    def begin_step(self) -> None:
        """Start the quorum of the step about to start (module docstring, 1), unless it is
        started already; wait for it here when it is synchronous (the first, ``resume()``'s,
        after a step that did not commit), else at the step's first gradient bucket. Collective
        over the replica groups; blocks up to ``quorum_timeout_s``."""
        if self._must_restart is not None:  # (.lineage) a script that caught it and went on
            raise self._must_restart
        if self._pending:
            return
        self._synchronous = self._manager is None or self._joining or not self._committed_last
        manager = self._manager_now()
        count = self._transport.count
        self._heal_mark = (count.transfers, count.seconds, count.bytes, time.perf_counter())
        # what a peer that heals in this quorum receives: this boundary's state (torchft's quorum
        # thread asks for it while the forward pass runs, and only then are the optimizers' states
        # read, .healing.Boundary; parameters and optimizer states by reference: nothing changes
        # them before this group's commit, which waits for the quorum and the transfer)
        self._boundary = self._healing.boundary() if self._healing is not None else None
        self._boundary_lineage = self._lineage
        try:
            if manager._quorum_future is not None:  # (start_quorum waits for the previous one without a bound)
                self._await_quorum(manager)
            manager.start_quorum()
        except Exception as exc:
            raise self._no_quorum(exc) from exc
        self._pending, self._settled, self._quorum_ok, self._decision = True, False, False, None
        if self._synchronous:
            self._settle()

    def _settle(self) -> None:
        """Wait for the pending quorum's answer (once per step): apply a heal it brought, say so,
        note the groups taking part. A heal in an asynchronous quorum (this group turned out to be
        behind though it committed its last step) raises :class:`FaultToleranceError`: its batch is
        already being computed on the old weights; the group ends, and its launcher starts it again
        to heal in ``resume()``. Collective over the groups (the quorum)."""
        if self._settled or not self._pending:
            return
        self._settled = True
        manager = self._manager
        self._await_quorum(manager)
        if manager._healing:
            if not self._synchronous:
                raise FaultToleranceError(
                    f"replica group {self.settings.group} is behind the others at step {manager.current_step()} "
                    "though it committed its last step (a quorum formed without it: it asked more than the "
                    "Lighthouse's join timeout late, or a group joined from a checkpoint ahead of the live ones); it "
                    "stops, and its launcher starts it again to heal in resume() (--max_restarts)")
            manager._apply_pending_state_dict()  # what torchft's synchronous start_quorum does
            manager._healing = False
        count = self._transport.count
        transfers, fetch_s, nbytes, start = self._heal_mark
        if count.transfers > transfers:
            report = HealReport(manager.current_step(), count.bytes - nbytes, count.seconds - fetch_s,
                                time.perf_counter() - start)
            self.heals.append(report)
            sits_out = "" if manager.is_participating() else (  # (at step 0 every group is at the highest)
                f"; it sits out step {report.step + 1} (its gradients count as zeros) and takes part from the next")
            self._say(f"healed from a live peer at step {report.step}: {report.bytes:,} bytes in "
                      f"{report.fetch_s:.2f} s ({report.total_s:.2f} s with the quorum){sits_out}")
            self._participants = manager.num_participants()  # (the heal's line says it)
        else:
            self._note_participants(manager.num_participants())
        self._quorum_ok = True
        if manager._quorum_id != self._checked_quorum:
            self._check_lineage(manager)

    def _check_lineage(self, manager: Any) -> None:
        """The first step of a quorum: do its groups hold one committed history (:mod:`.lineage`)?
        When they do not, no group commits the step (its gradients come from different weights).
        A group whose history is not kept heals from one whose is: in ``resume()``
        (:meth:`join`, its loaders not iterating yet) at once, one count lower; in the training
        loop by raising :class:`FaultToleranceError`, so that its process ends and its launcher
        starts it again to heal in ``resume()`` (its loader, which went on apart, is set to theirs
        there). Collective over the replica groups (one small all-reduce); a failure of it is
        recorded (the step does not commit; torchft's Lighthouse then forms a new quorum, and its
        first step checks again)."""
        self._lineage_error = None
        if manager.errored() is not None:  # nothing is sent after an error (as the buckets): checked next quorum
            return
        try:
            lineages, trained = compare(manager, self._lineage, trained=self._trained)
        except Exception as exc:  # a group gone: gloo's sockets reset, or timeout_s
            manager.report_error(exc)
            return
        self._checked_quorum = manager._quorum_id
        if len(set(lineages)) == 1:
            return
        kept = verdict(lineages, trained)
        why, how = _lineage_words(manager, lineages, trained, kept)
        if self._lineage == kept or (self._joining and manager.current_step() > 0):
            self._lineage_error = FaultToleranceError(why)
            manager.report_error(self._lineage_error)
            if self._lineage == kept:
                self._say(f"{how}; this group's is kept: a group with another heals from one that kept it")
            else:
                self._rejoin = True
                self._say(f"{how}; this group's, {self._lineage}, is not: it heals from a group that kept its history "
                          "now, in resume()")
            return
        error = FaultToleranceError(
            f"replica group {self.settings.group}: {why}, and this group's is not the one kept: it heals from a group "
            "that kept it when its launcher starts it again (--max_restarts; with none left, or with one launch per "
            "group, start it again yourself)")
        self._quorum_ok = False  # (abandon() then sends nothing: no group's all-reduces of this step follow)
        self._say(f"{how}; this group's, {self._lineage}, is not: it stops, and its launcher starts it again to heal "
                  "in resume() from a group that kept its history (--max_restarts)")
        self._fail_step(error)  # (recorded: a script that catches it and goes on does not send this step's buckets)
        self._must_restart = error  # (and raised again at its next step: its process must end)
        raise error

    def _await_quorum(self, manager: Any) -> None:
        """torchft's ``wait_quorum`` with an overall bound (``settings.quorum_wait_s``): each of its
        quorum thread's waits has a timeout, but nothing bounds their sum, and a quorum thread stuck
        anyway would hold the step for good. Local; the quorum is collective over the groups."""
        import concurrent.futures

        bound = self.settings.quorum_wait_s
        future = manager._quorum_future
        # (not result(timeout=): the quorum's own failure is a TimeoutError too, torchft's Rust client's
        # when the Lighthouse gives no quorum within quorum_timeout_s, and it must read as no quorum)
        if not concurrent.futures.wait([future], timeout=bound).done:
            s = self.settings
            raise FaultToleranceError(
                f"replica group {s.group}, rank {self._rank}: the quorum of step {manager.current_step() + 1} did not "
                f"complete within {bound:g} s (quorum_timeout_s={s.quorum_timeout_s:g} for the Lighthouse's answer + "
                f"3 x timeout_s={s.timeout_s:g} for the gradient group's rebuild and a heal's transfer); torchft's quorum "
                f"thread is stuck (the Lighthouse at {s.lighthouse} or a peer group stopped answering mid-quorum). The "
                "process ends and its launcher starts the group again (--max_restarts); if a heal of a large state is "
                "just slow, raise TORCHFT_TIMEOUT_SEC (and TORCHFT_QUORUM_TIMEOUT_SEC for a slow Lighthouse)")
        try:
            future.result()
        except Exception as exc:
            raise self._no_quorum(exc) from exc

    def _no_quorum(self, exc: BaseException) -> FaultToleranceError:
        if isinstance(exc, FaultToleranceError):
            return exc
        return FaultToleranceError(
            f"replica group {self.settings.group}: no quorum for step {self._manager.current_step() + 1} within "
            f"{self.settings.quorum_timeout_s:g} s from the Lighthouse at {self.settings.lighthouse} "
            f"({type(exc).__name__}: {exc}); fewer than fault_tolerance_min_replicas="
            f"{self.settings.min_replicas} groups are alive, or the Lighthouse is gone")

    def _quorum_ready(self) -> None:
        """Before the step's first bucket: the quorum started (here, when the loader did not) and
        answered. Collective over the groups."""
        self.begin_step()
        self._settle()

    def watch(self, parameters: List[torch.nn.Parameter], models: Optional[List[torch.nn.Module]] = None) -> None:
        """The parameters whose gradients are averaged (every prepared model's, in prepare order;
        called again when another model is prepared); ``models``: the prepared models, whose FSDP2
        units cut the buckets (:func:`.averaging.buckets_of`) and whose DDP, if any, makes them start
        after ``backward`` (:func:`.averaging.synced_after_backward`); both kept for a later call
        without. Local."""
        if models is not None:
            self._units = fsdp_units(models)
            self._after_backward = synced_after_backward(models)
            self._names = {id(p): name for model in models for name, p in model.named_parameters()}
        if self._average is not None:
            self._average.close()
        self._average = BucketedAverage(parameters, self._allreduce, self._quorum_ready, self._units,
                                        find_unused_parameters=self.find_unused_parameters,
                                        after_backward=self._after_backward)

    def _allreduce(self, flat: torch.Tensor) -> Any:
        return start_average(self._manager, flat)  # torchft's Manager.allreduce without its futures (.reduce)

    def arm(self) -> None:
        """A gradient-sync ``backward`` starts: its buckets start as they fill, when the step's
        quorum is formed already (else after ``backward``, and always after it under DDP inside
        the group: module docstring, 2). Local."""
        self._overlapped = self._pending and self._average is not None
        if self._overlapped:
            assert self._average is not None
            self._average.arm()

    def average_gradients(self, parameters: List[torch.nn.Parameter], failed: Optional[BaseException] = None) -> None:
        """Finish the average of every gradient over the replica groups of this step's quorum
        (module docstring, 2): wait for the buckets started during ``backward``, or form the
        quorum and average now. A parameter without a gradient counts as zeros (named once, on the
        rank that gave them); with ``find_unused_parameters``, one that no group had a gradient for
        is left without one (:mod:`.averaging`). ``failed``: this process's ``backward`` raised it
        (:meth:`abandon`). Collective over the groups; errors are recorded by torchft and make the
        step not commit, and so does a step this group's ``backward`` raised in (with
        ``find_unused_parameters``: any group's)."""
        if not self._overlapped or self._average is None or not self._average.covers(parameters):
            self._quorum_ready()
            self.watch(parameters)
            assert self._average is not None
            self._average.arm()
        self._overlapped = False
        assert self._average is not None
        self._average.finish(abort=failed is not None)
        self._averaged = True
        if not self.find_unused_parameters and failed is None and self._average.zeroed:
            self._say_zeroed(self._average.zeroed)
        # (after the all-reduces: torchft skips every one after an error.) Here, where backward raised, even
        # when every bucket had left before it did, or without the flags (find_unused_parameters off): the
        # others then commit, and this group heals next step
        if (failed is not None or self._average.aborted) and self._manager.errored() is None:  # (an earlier cause stays)
            self._manager.report_error(FaultToleranceError(
                f"this replica group's backward raised {_cause(failed)}" if failed is not None else
                "another replica group's backward raised in this step: its gradients are incomplete, so no group "
                "commits the step"))

    def _say_zeroed(self, zeroed: List[torch.nn.Parameter]) -> None:
        """Name, once each, the parameters this rank gave zeros for without ``find_unused_parameters``
        (:mod:`.averaging`). Local."""
        new = [p for p in zeroed if id(p) not in self._said_zeroed]
        if not new:
            return
        self._said_zeroed.update(id(p) for p in new)
        order = {key: i for i, key in enumerate(self._names)}  # as the model registers them
        new.sort(key=lambda p: order.get(id(p), len(order)))
        names = [self._names.get(id(p), f"a parameter of shape {tuple(p.shape)}") for p in new]
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        self._say(f"{len(new)} parameter(s) got no gradient in this backward ({shown}): averaged over the replica "
                  "groups as zeros, so one no group uses gets a zero gradient (weight decay and momentum still move "
                  "it), where DDP would stop with an error. Set find_unused_parameters=True "
                  "(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)], or in the DDPOptions "
                  "given as strategy options) to leave such a parameter's .grad None, as DDP does: one more small "
                  "all-reduce over the groups every step (and DDP's own search, where DDP splits the model inside the "
                  "group). Every group must be started with the same setting", every_rank=True)

    def abandon(self, parameters: List[torch.nn.Parameter], error: BaseException) -> None:
        """``backward`` raised ``error`` on this process in a gradient-sync step (armed): send the
        step's remaining buckets anyway, so that every group issues this step's all-reduces and the
        next step's line up (:mod:`.averaging`: with ``find_unused_parameters`` flagged, and no group
        commits this one; without, the others commit it and this group heals from a peer at its next
        quorum); then vote it down here (``optimizer.step()`` of this step, if called, skips); the caller then
        raises ``error``. Where the step's quorum itself failed (``error`` is then that failure, or
        came after it), nothing is sent: the process is ending. Where sending or voting fails too
        (e.g. out of memory again), the groups' all-reduces no longer line up: the step is marked
        failed and :class:`FaultToleranceError` is raised from both (the process must end, and its
        launcher restarts the group, which heals). In a group of **several processes** nothing is
        sent either: the strategy inside the group (FSDP2, DDP, tensor parallelism) cannot go on
        after an exception in its ``backward`` (its own collectives no longer line up, and FSDP2
        cannot reshard), so the process ends at once with :class:`FaultToleranceError` (raised
        again at every later step if a script catches it); the other groups then see a group that
        died, and its launcher restarts it to heal. Collective over the replica groups and the group's ranks."""
        if self._settled and not self._quorum_ok:  # the quorum failed or ends the group: no step to line up
            self._fail_step(error)
            return
        if self._world_size > 1:
            message = (f"its backward raised ({_cause(error)}): the strategy inside a group of {self._world_size} "
                       "processes cannot go on after that (its collectives no longer line up; FSDP2 cannot reshard), "
                       "so the process ends, and its launcher starts the group again to heal from a live group "
                       "(--max_restarts); the other groups go on without it")
            ended = FaultToleranceError(f"replica group {self.settings.group}, rank {self._rank}: {message}")
            self._fail_step(ended)
            self._must_restart = ended
            self._say(message, every_rank=True)
            raise ended from error
        try:
            self.average_gradients(parameters, failed=error)
            self.commit()
        except Exception as exc:
            self._fail_step(exc)
            message = (f"its backward raised ({_cause(error)}), and sending its step's remaining gradients or voting "
                       f"the step down failed too ({_cause(exc)}): its all-reduces no longer line up with the other "
                       "groups'; the process ends, and its launcher starts the group again to heal (--max_restarts)")
            self._say(message, every_rank=True)  # (only this rank may know)
            raise FaultToleranceError(f"replica group {self.settings.group}, rank {self._rank}: {message}") from exc

    def _fail_step(self, exc: BaseException) -> None:
        """This step is over and not committed, whatever happens next in it. Local."""
        if self._manager is not None and self._manager.errored() is None:
            self._manager.report_error(exc if isinstance(exc, Exception) else FaultToleranceError(str(exc)))
        self._pending, self._committed_last, self._averaged, self._decision = False, False, False, False

    def commit(self) -> bool:
        """Whether this step's update may be applied (module docstring, 3): asked once per step,
        the answer kept for every optimizer of the step. Collective over the ranks of the group.
        Raises :class:`FaultToleranceError` after ``MAX_UNCOMMITTED`` steps in a row failed."""
        if self._decision is not None:
            return self._decision
        if self._must_restart is not None:
            raise self._must_restart
        if not self._averaged:
            raise FaultToleranceError(
                "optimizer.step() was called without accelerator.backward(loss) in this step, or with its only backward "
                "inside accelerator.no_sync(model): with fault tolerance the gradients are averaged over the replica "
                "groups in accelerator.backward outside no_sync (loss.backward() alone, or no_sync alone, would step "
                "each group with its own gradients, and their weights would drift apart); call "
                "accelerator.backward(loss) for the step's last micro-batch outside no_sync")
        self._averaged = False
        self._settle()
        manager = self._manager
        error = manager.errored()
        try:  # decided here (.vote): alone in a group of one process, over the group's process group in larger ones
            decision = bool(decide(manager, None if self._world_size == 1 else self._group_vote))
        except (RuntimeError, TimeoutError) as exc:
            if getattr(manager, "_commit_failures", 0) > MAX_UNCOMMITTED:  # torchft's max_retries
                raise FaultToleranceError(
                    f"replica group {self.settings.group}: {MAX_UNCOMMITTED} steps in a row did not commit (last: "
                    f"{_cause(manager.errored() or error)}); the job stops instead of retrying for good") from exc
            # the vote itself failed: a rank of the group is gone, or its vote did not come within timeout_s
            # (the group's all-reduce raises RuntimeError), or a peer healing from this group held its
            # transfer past timeout_s (the checkpoint server's lock)
            raise FaultToleranceError(
                f"replica group {self.settings.group}, rank {self._rank}: the commit vote of step "
                f"{manager.current_step() + 1} failed ({_cause(exc)}); a process of this group is gone or stalled "
                f"(the vote waits timeout_s={self.settings.timeout_s:g} s, TORCHFT_TIMEOUT_SEC), or a peer healing "
                "from it stalled its transfer; the process ends, and its launcher starts the group again to heal "
                "(--max_restarts)") from exc
        self._decision, self._pending, self._committed_last = decision, False, decision
        self._boundary = None  # served no longer: should_commit waited for any transfer
        if decision:
            members = self._members.of(manager._quorum_id) if self._members is not None else ()
            self._lineage = advance(self._lineage, manager._quorum_id, manager.current_step(), members)
            self._trained = True
        if not decision:
            self.uncommitted += 1
            participants = manager.num_participants()
            why = _cause(manager.errored() or error) or (
                f"only {participants} of the required {self.settings.min_replicas} replica groups took part"
                if participants < self.settings.min_replicas else
                "another rank of this group voted it down: that rank's error is on its own lines")
            self._say(f"step {manager.current_step() + 1} not committed ({why}); its batch is skipped and the next "
                      "quorum leaves out a lost group once the Lighthouse stops hearing from it")
            if self._rank != 0 and manager.errored() is not None:  # (rank 0 names another rank: this one says why)
                self._say(f"voted step {manager.current_step() + 1} down ({why})", every_rank=True)
        return decision

    def _group_vote(self, local: bool) -> bool:
        return group_vote(local, self.settings.timeout_s)

    def _note_participants(self, participants: int) -> None:
        if participants != self._participants:
            if self._participants is not None or participants != self.settings.groups:
                self._say(f"step {self._manager.current_step() + 1} runs with {participants} of "
                          f"{self.settings.groups} replica groups")
            self._participants = participants

    # ---- what torchft calls ------------------------------------------------------------------
    def _state_dict(self) -> Dict[str, Any]:
        if self._boundary is None:
            raise FaultToleranceError("a peer asked this replica group for its state before anything was prepared")
        return {**self._boundary.resolve(), "lineage": self._boundary_lineage}  # (on torchft's quorum thread)

    def _load(self, healed: Dict[str, Any]) -> None:
        if self._healing is None:
            raise FaultToleranceError("this replica group healed before anything was prepared: call "
                                      "accelerator.resume() after prepare()")
        self.healed_step = self._healing.load(healed, loaders=self._joining)
        self._lineage, self._trained = int(healed.get("lineage", 0)), False

    # ---- information -----------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Steps committed (torchft's count, the same in every group of a quorum). Local."""
        return int(self._manager.current_step()) if self._manager is not None else int(self._restored.get("step", 0))

    @property
    def participants(self) -> Optional[int]:
        """Replica groups in the current step's quorum (None before the first). Local."""
        return self._participants

    def state_dict(self) -> Dict[str, int]:
        """torchft's counters (steps committed, batches committed), saved in this group's
        checkpoints so that a group resumed from disk is not taken for being ahead. Local."""
        if self._manager is not None:
            return {**self._manager.state_dict(), "lineage": self._lineage}
        return {**(self._restored or {"step": 0, "batches_committed": 0}), "lineage": self._lineage}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Restore :meth:`state_dict` (before the first quorum). Local."""
        self._restored = {"step": int(state.get("step", 0)), "batches_committed": int(state.get("batches_committed", 0))}
        self._lineage = int(state.get("lineage", 0))  # (absent from checkpoints of earlier releases: 0)
        self._trained = False
        if self._manager is not None:
            self._manager.load_state_dict(self._restored)

    def _say(self, message: str, every_rank: bool = False) -> None:
        """One line on stderr about this group, from its rank 0; with ``every_rank``, from this
        rank, named (what only this rank may know). Local."""
        if every_rank:
            print(f"{_PREFIX} replica group {self.settings.group}, rank {self._rank}: {message}", file=sys.stderr,
                  flush=True)
        elif self._rank == 0:
            print(f"{_PREFIX} replica group {self.settings.group}: {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Leave: stop the group's torchft server and checkpoint server (the others notice at
        the Lighthouse's heartbeat timeout) and the TCP store this process served for torchft;
        the gloo group is kept until the process ends (:mod:`.transport`). Local; idempotent."""
        if self.closed:
            return
        self.closed = True
        manager, self._manager = self._manager, None
        if self._average is not None:
            self._average.close()
        if manager is not None:
            from ..process import process_group

            process_group.keep(current_group(manager._pg))
            manager.shutdown(wait=False)
        # the store this process served for torchft: torch's TCPStore has no close(), its server stops
        # when the master object is freed, and this is its only reference (clients do not hold it)
        self._own_store = None



def _cause(error: Any) -> str:
    """The first line of a torchft error (its ``ExceptionWithTraceback`` carries a traceback)."""
    if error is None:
        return ""
    original = getattr(error, "original_exception", error)
    return f"{type(original).__name__}: {str(original).splitlines()[0][:200]}"
