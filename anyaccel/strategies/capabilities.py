"""What only some strategies can do: small optional interfaces the ``Accelerator`` asks for.

Lightning Fabric's pattern (``_BackwardSyncControl``, ``_Sharded``): the :class:`~.base.Strategy`
base keeps what every strategy does; an ability only some have is a small interface a strategy
inherits, and the façade tests ``isinstance(strategy, <interface>)`` — never a strategy's name or
class. A strategy of your own gains an ability by inheriting its interface and writing its
methods; the ``Accelerator`` needs no change.

========================  =========================================  ============================
interface                 what the façade asks                       who has it
========================  =========================================  ============================
:class:`Pipelined`        ``pipeline_for(model)``: the schedule that  ``nd`` (``pp_size`` > 1)
                          runs a model cut into stages
:class:`SequenceParallel` ``sequence_feed(feed)``: batches cut into   ``nd`` (``sp_size`` > 1)
                          this process's slice of every sequence
:class:`EngineTraining`   ``begin_prepare``, ``engine_backward``:     ``deepspeed``
                          an engine built from the prepared objects
                          runs backward and scales the loss itself
:class:`UnevenInputs`     ``join_uneven_inputs(joinables)``           ``ddp``
:class:`BackwardSyncControl`  ``sync_in_backward(model)``             ``ddp``
========================  =========================================  ============================

The interfaces are plain classes (no ``abc`` metaclass), so the façade's ``isinstance`` tests cost
what a class check costs. Also here: what ``pipeline_step``'s arguments mean for every strategy
(:func:`split_batch`, :func:`default_loss`), whether or not it cuts models into stages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Mapping, Optional, Sequence, Tuple

import torch

from .. import lazyclass

if TYPE_CHECKING:
    from .loss import SequenceGroup

__all__ = ["Pipelined", "SequenceParallel", "EngineTraining", "UnevenInputs", "BackwardSyncControl", "split_batch",
           "default_loss"]

if TYPE_CHECKING:  # (a type alias, for annotations: made when imported at run time, __getattr__ below)
    #: what a loader's batches go through on their way to the device (the backend's feed), or None
    Feed = Optional[Callable[[Iterable[Any]], Iterable[Any]]]
else:  # (hidden from type checkers: a module __getattr__ would type every misspelt name Any)
    # Feed evaluated when imported, not at import (typing's subscriptions cost)
    __getattr__, __dir__ = lazyclass.module_attributes(__name__, globals(), {
        "Feed": lambda: Optional[Callable[[Iterable[Any]], Iterable[Any]]]})


class Pipelined:
    """The strategy may cut a model into pipeline stages (no process can call ``model(x)``), and
    ``Accelerator.pipeline_step`` runs each batch through the stages' schedule instead."""

    def pipeline_for(self, model: torch.nn.Module) -> Any:
        """What runs ``model``'s batches when this strategy cut it into stages (an object with
        ``step_of(args, target, loss_fn, sync, return_outputs)``, whose result's ``backward()``
        runs the schedule), else None. Local."""
        raise NotImplementedError


class SequenceParallel:
    """The strategy splits every sequence over processes (Ulysses): a loader's batches are cut
    into this process's slice, and the loss counts the tokens of every slice."""

    def sequence_group(self) -> "SequenceGroup":
        """Where this process stands: the ``sp`` group, its slice, the processes whose tokens
        make one global batch. Collective the first time (it builds groups)."""
        raise NotImplementedError

    def sequence_feed(self, feed: Feed) -> Feed:
        """``feed`` with every batch cut into this process's slice of each sequence first (``feed``
        itself when sequences are not split). Local."""
        raise NotImplementedError


class EngineTraining:
    """The strategy trains through an engine it builds from several prepared objects together
    (DeepSpeed: model, optimizer, scheduler, the loaders' batch size); the engine runs backward
    and scales an fp16 loss itself (no torch ``GradScaler``)."""

    #: the engine scales the fp16 loss itself: the ``Accelerator`` makes no ``GradScaler``
    owns_loss_scaling = True

    def begin_prepare(self, objects: Sequence[Any], *, gradient_accumulation_steps: int, split_batches: bool) -> None:
        """Called once per ``prepare()`` call with every object given, before any is prepared. Local."""
        raise NotImplementedError

    def engine_backward(self, loss: torch.Tensor, sync: bool, **kwargs: Any) -> None:
        """The engine's backward of ``loss`` (already divided for accumulation); ``sync``: this
        micro-step ends an accumulation group. Local, or collective where the engine communicates."""
        raise NotImplementedError


class UnevenInputs:
    """Ranks may run different numbers of batches: ranks that run out keep answering the others'
    collectives (torch's ``Join``)."""

    def join_uneven_inputs(self, joinables: Sequence[Any]) -> Optional[ContextManager[Any]]:
        """A context in which ranks may run different numbers of batches, over ``joinables``;
        None when this job cannot (one process). Collective: every rank enters it."""
        raise NotImplementedError


class BackwardSyncControl:
    """Gradient synchronisation can be forced in one backward, even after forwards that skipped it."""

    def sync_in_backward(self, model: torch.nn.Module) -> ContextManager[Any]:
        """A context in which ``model``'s backward synchronises gradients even after forwards under
        ``no_sync`` (accumulation micro-steps). Collective inside: every rank uses it for the same
        backward."""
        raise NotImplementedError


# ---- what pipeline_step's arguments mean, for every strategy ---------------------------------------
def split_batch(inputs: Any, target: Any) -> Tuple[Tuple[Any, ...], Any]:
    """``(positional inputs, target)`` of a batch: a tensor or tuple as the inputs; a transformers
    batch (a mapping) as its ``input_ids``, with ``labels`` as the target when none is given. An
    ``attention_mask`` is accepted only when it masks nothing (no padding): the stages after the
    first receive only hidden states. Raises ``ValueError`` for other keys. Local."""
    if isinstance(inputs, Mapping):
        batch = dict(inputs)
        ids = batch.pop("input_ids", None)
        labels = batch.pop("labels", None)
        mask = batch.pop("attention_mask", None)
        if ids is None or batch:
            raise ValueError(f"pipeline_step: a batch given as a mapping must hold input_ids (and labels, "
                             f"attention_mask); got keys {sorted(inputs)}. Pass the first stage's inputs as a tensor "
                             "or a tuple of tensors instead")
        if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
            raise ValueError("pipeline_step: attention_mask masks some tokens (padding), but the stages after the "
                             "first receive only hidden states, so a padding mask cannot reach them; pack sequences "
                             "without padding (the causal mask is applied by every stage)")
        return (ids,), labels if target is None else target
    return (inputs if isinstance(inputs, tuple) else (inputs,)), target


def default_loss(model: torch.nn.Module) -> Callable[[Any, Any], torch.Tensor]:
    """The loss of a transformers model (its own ``loss_function``: causal-LM cross entropy with
    shifted labels, mean over tokens); raises ``ValueError`` for other models. Local."""
    loss_function = getattr(model, "loss_function", None)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if loss_function is None or vocab is None:
        raise ValueError(f"pipeline_step needs loss_fn(outputs, target) for a {type(model).__name__} (only a "
                         "transformers model brings its own loss)")
    return lambda logits, labels: loss_function(logits=logits, labels=labels, vocab_size=vocab)
