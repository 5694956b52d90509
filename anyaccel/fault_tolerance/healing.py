"""The healing state: what a replica group that (re)joins receives from a live peer, and how it
is applied — the same pieces ``save_state`` writes, in memory.

======================  =====================================================================
piece                   how
======================  =====================================================================
weights                 each prepared model's state, as the strategy gives it, or under a
                        sharding strategy (FSDP2) this rank's shards (:mod:`.shards`: rank
                        ``r`` heals from rank ``r`` of a live group, no gather; parameters by
                        reference: nothing changes them before the sender's next optimizer
                        step, which waits for the transfer; buffers copied, since a forward
                        may update them, BatchNorm's running statistics)
optimizer state         each prepared optimizer's, as the strategy gives it (sharded: this
                        rank's shards; by reference)
schedulers, scaler      ``state_dict()`` of each
loader positions        each prepared loader's ``state_dict()``: epoch, batches done, order
custom objects          those of ``register_for_checkpointing``
RNG                     the sender's (Python, NumPy, torch and started devices):
                        :func:`anyaccel.checkpoint.rng.get_rng_state`
step                    the ``Accelerator``'s ``step`` (torchft transfers its own step count)
======================  =====================================================================

Where it is taken: on the sending group's main thread, at the step boundary
(:meth:`anyaccel.fault_tolerance.replica.Replica.begin_step`: after the previous step committed and
its scheduler stepped, before the next batch is fetched), just before the quorum request leaves;
torchft's quorum thread sends that while the main thread runs the forward pass (the quorum is
asynchronous). Parameters and optimizer states are references (nothing changes them before the
sender's commit, which waits for the quorum and a transfer in flight), the rest is small or copied.
What the forward pass or the next batch would change is taken at the boundary; the optimizers'
states and the RNG states' conversion are read by the quorum thread, and only when a peer heals
(:class:`Boundary`: the same bytes, 0.1 ms a step less for the benchmark's MLP). A group that heals
continues exactly there.

The RNG states are the sender's. When every group seeds alike (``set_seed(s)`` in every group,
which a shared shuffle order needs anyway), the groups' generators are equal at every step and
the healed group continues with the states it would have had; otherwise it continues with its
peer's.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Union

import torch

from ..checkpoint.rng import capture_rng_state, rng_state_of, set_rng_state
from ..errors import FaultToleranceError
from .shards import like_parameter, local_part, local_tree

__all__ = ["HealingState", "Boundary", "LOADER_FIELDS"]

#: the fields of a loader's state that say where it stands (compared when a heal arrives mid-epoch)
LOADER_FIELDS = ("epoch", "position", "finished_epoch")


def _sharded(strategy: Any) -> bool:
    """Whether the strategy's states are sharded over the group's processes (FSDP2, the N-D
    family): their state dicts are collective, so a heal moves each rank's shards instead."""
    return bool(getattr(strategy, "collective_state_dict", False))


def _model_state(strategy: Any, model: torch.nn.Module) -> Dict[str, Any]:
    """The model's state for the transfer: the strategy's (or, sharded, this rank's shards: no
    gather), parameters by reference, every other tensor copied."""
    sharded = _sharded(strategy)
    # (keep_vars: the parameters themselves, not a detached DTensor each: a dispatch per parameter per step)
    state = local_tree(model.state_dict(keep_vars=True)) if sharded else strategy.model_state_dict(model)
    params = {local_part(p).data_ptr() for p in model.parameters()}
    return {k: (v if not isinstance(v, torch.Tensor) or v.data_ptr() in params else v.detach().clone())
            for k, v in state.items()}


def _load_model_shards(model: torch.nn.Module, healed: Dict[str, Any]) -> None:
    """Copy the received shards into this rank's own (the same rank of a group split alike holds
    the same shard). Raises :class:`FaultToleranceError` naming the keys that differ."""
    own = model.state_dict()
    if set(own) != set(healed):
        raise FaultToleranceError(
            f"the live replica group this one heals from has a model with keys {sorted(set(healed) - set(own))[:5]} "
            f"that this one lacks, and lacks {sorted(set(own) - set(healed))[:5]}: every group must build the same "
            "model")
    with torch.no_grad():
        for key, value in healed.items():
            if isinstance(value, torch.Tensor):
                local_part(own[key]).copy_(value)


def _load_optimizer_shards(optimizer: Any, healed: Dict[str, Any]) -> None:
    """Load a received optimizer state of this rank's shards, each state rebuilt as its
    parameter holds them (:func:`.shards.like_parameter`)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {index: {k: like_parameter(params[int(index)], v) for k, v in entry.items()}
             for index, entry in healed["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": healed["param_groups"]})


class Boundary:
    """The healing state of one step boundary (:meth:`HealingState.boundary`): what was taken
    there, and what :meth:`resolve` adds when a peer asks for it."""

    __slots__ = ("_taken", "_strategy", "_optimizers", "_rng", "_resolved")

    def __init__(self, taken: Dict[str, Any], strategy: Any, optimizers: List[Any], rng: Any):
        self._taken, self._strategy, self._optimizers, self._rng = taken, strategy, optimizers, rng
        self._resolved: Union[Dict[str, Any], None] = None

    def resolve(self) -> Dict[str, Any]:
        """The whole healing state of the boundary (the same pieces and bytes as taken all there):
        the optimizers' states read now (this rank's shards under a sharding strategy: no
        collective), the RNG states converted. Valid until the sender's next optimizer step. Local."""
        if self._resolved is None:
            sharded = _sharded(self._strategy)
            optimizers = [local_tree(o.state_dict()) if sharded else self._strategy.optimizer_state_dict(o)
                          for o in self._optimizers]
            self._resolved = {**self._taken, "optimizers": optimizers, "rng": rng_state_of(self._rng)}
        return self._resolved


class HealingState:
    """The healing state of one ``Accelerator`` (see the module docstring). ``training_state`` is
    a callable returning the current :class:`~anyaccel.checkpoint.TrainingState` (the
    ``Accelerator``'s, made when asked: what is prepared by then), or a ``weakref.WeakMethod`` of
    one (the runtime that holds this must not keep its ``Accelerator`` alive); ``exclude`` lists
    objects of ``custom_objects`` that are not part of it (the fault-tolerance state itself)."""

    def __init__(self, training_state: Union[Callable[[], Any], "weakref.WeakMethod[Any]"], exclude: List[Any]):
        self._source = training_state
        self._exclude = exclude

    def _training_state(self) -> Any:
        source = self._source
        if isinstance(source, weakref.WeakMethod):
            method = source()
            if method is None:
                raise FaultToleranceError("the Accelerator of this replica group is gone; nothing to heal from or into")
            return method()
        return source()

    def _custom(self, state: Any) -> List[Any]:
        return [o for o in state.custom_objects if not any(o is x for x in self._exclude)]

    def state_dict(self) -> Dict[str, Any]:
        """The healing state now (module docstring). Local."""
        return self.boundary().resolve()

    def boundary(self) -> "Boundary":
        """The healing state at this step boundary, for :meth:`Boundary.resolve` to give only if
        a peer heals from it: taken at each step boundary by the replica, on the main thread
        (module docstring). What a forward pass or the next batch changes is taken now (models,
        as references and buffer copies, because FSDP2 swaps its parameters during forward; RNG
        states as the generators give them; loaders, schedulers, scaler, custom objects, step);
        the optimizers' states, which change only at the optimizer step (after the commit, which
        waits for a transfer in flight), and the RNG states' conversion are left to
        :meth:`Boundary.resolve`, on torchft's quorum thread. Local."""
        state = self._training_state()
        return Boundary({
            "models": [_model_state(state.strategy, m) for m in state.models],
            "schedulers": [s.state_dict() for s in state.schedulers],
            "scaler": state.scaler.state_dict() if state.scaler is not None else None,
            "dataloaders": [loader.state_dict() if hasattr(loader, "state_dict") else {} for loader in state.dataloaders],
            "custom": [o.state_dict() for o in self._custom(state)],
            "step": int(state.step),
        }, state.strategy, list(state.optimizers), capture_rng_state())

    def load(self, healed: Dict[str, Any], loaders: bool) -> int:
        """Apply ``healed`` (what :meth:`state_dict` gave on the peer) to this group's objects;
        returns the ``Accelerator`` step it carries. ``loaders``: set the loaders' positions
        (before the training loop: ``resume()``); otherwise the positions must already be the
        peer's (a group that fell one commit behind in the same loop), and a group whose loader
        stands elsewhere raises :class:`FaultToleranceError` saying to call ``resume()`` before
        the loop. Local; on the main thread."""
        state = self._training_state()
        self._check_counts(state, healed)
        if not loaders:
            self._check_positions(state, healed)
        sharded = _sharded(state.strategy)
        for model, weights in zip(state.models, healed["models"]):
            if sharded:
                _load_model_shards(model, weights)
            else:
                state.strategy.load_model_state_dict(model, weights, strict=True)
        for optimizer, optimizer_state in zip(state.optimizers, healed["optimizers"]):
            if sharded:
                _load_optimizer_shards(optimizer, optimizer_state)
            else:
                state.strategy.load_optimizer_state_dict(optimizer, optimizer_state)
        for scheduler, scheduler_state in zip(state.schedulers, healed["schedulers"]):
            scheduler.load_state_dict(scheduler_state)
        if state.scaler is not None and healed["scaler"] is not None:
            state.scaler.load_state_dict(healed["scaler"])
        if loaders:
            for loader, loader_state in zip(state.dataloaders, healed["dataloaders"]):
                if loader_state and hasattr(loader, "load_state_dict"):
                    loader.load_state_dict(loader_state)
        for obj, obj_state in zip(self._custom(state), healed["custom"]):
            obj.load_state_dict(obj_state)
        set_rng_state(healed["rng"])
        return int(healed["step"])

    def _check_counts(self, state: Any, healed: Dict[str, Any]) -> None:
        mine = {"models": len(state.models), "optimizers": len(state.optimizers),
                "schedulers": len(state.schedulers), "dataloaders": len(state.dataloaders),
                "custom": len(self._custom(state))}
        theirs = {key: len(healed[key]) for key in mine}
        if mine != theirs:
            raise FaultToleranceError(
                f"the live replica group this one heals from prepared {theirs}, this one {mine}: every replica "
                "group must run the same script, preparing the same objects in the same order before its loop")

    def _check_positions(self, state: Any, healed: Dict[str, Any]) -> None:
        for i, (loader, theirs) in enumerate(zip(state.dataloaders, healed["dataloaders"])):
            mine = loader.state_dict() if hasattr(loader, "state_dict") else {}
            if {k: mine.get(k) for k in LOADER_FIELDS} != {k: theirs.get(k) for k in LOADER_FIELDS}:
                raise FaultToleranceError(
                    f"this replica group joined a running job whose loader {i} stands at epoch {theirs.get('epoch')}, "
                    f"batch {theirs.get('position')}, but its own is at epoch {mine.get('epoch')}, batch "
                    f"{mine.get('position')} and already iterating: call `start = accelerator.resume()` after "
                    "prepare() and start the loop at start.epoch (docs/guides/fault-tolerance.md), so that a "
                    "restarted group continues where the others are")
