"""What a sharding strategy does differently for a model cut into pipeline stages: a mixin.

The ``nd`` strategy puts it first among its bases (``class NDStrategy(PipelinedStrategy, ...)``):
each method here handles a model its :class:`~.pipeline.Pipeline` runs and otherwise defers to
the sharding strategy's own (``super()``). What it changes, for the pipelined model only:

* optimizers keep only the parameters of this rank's stages (and the tied copies made here);
* ``model_state_dict`` gathers every stage's entries on rank 0 (``save_model``, ``get_state_dict``),
  ``load_model_state_dict`` loads the entries of this rank's stages;
* sharded checkpoints store a tied weight's optimizer state under the name the untied model uses
  (:meth:`~.pipeline_ties.TiedWeights.aliases`), so they move between pipelined and whole models.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from . import dcp

__all__ = ["PipelinedStrategy"]


class PipelinedStrategy:
    """Mixin for a strategy that may hold a :class:`~.pipeline.Pipeline` in ``_pipeline``."""

    _pipeline: Any = None

    def pipeline_for(self, model: torch.nn.Module) -> Any:
        """The :class:`~.pipeline.Pipeline` running ``model`` (prepared under pp), else None. Local."""
        pipeline = self._pipeline
        return pipeline if pipeline is not None and self.unwrap(model) is pipeline.model else None  # type: ignore[attr-defined]

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, models: List[torch.nn.Module]) -> torch.optim.Optimizer:
        """The sharding strategy's re-pointing by name; under pp, only the parameters of this rank's
        stages stay. Local."""
        optimizer = super().prepare_optimizer(optimizer, models)  # type: ignore[misc]
        if self._pipeline is not None:
            self._pipeline.keep_own_parameters(optimizer)
        return optimizer

    def model_state_dict(self, model: torch.nn.Module) -> Dict[str, Any]:
        """Under pp every stage's entries, gathered on rank 0; otherwise the strategy's. Collective."""
        pipeline = self.pipeline_for(model)
        if pipeline is not None:
            state: Dict[str, Any] = pipeline.full_state_dict()
            return state
        return super().model_state_dict(model)  # type: ignore[misc,no-any-return]

    def load_model_state_dict(self, model: torch.nn.Module, state: Dict[str, Any], strict: bool = True) -> Any:
        """Under pp each rank loads the entries of its stages. Collective."""
        pipeline = self.pipeline_for(model)
        return super().load_model_state_dict(  # type: ignore[misc]
            model, pipeline.local_state(state) if pipeline is not None else state, strict)

    def save_sharded(self, directory: str, models: List[torch.nn.Module], optimizers: List[Any],
                     process_group: Any = None, asynchronous: bool = False) -> Any:
        """Each rank's shards through torch.distributed.checkpoint; under pp a tied weight's
        optimizer state under the name the untied model uses. Collective."""
        return dcp.save_sharded(directory, [self.unwrap(m) for m in models],  # type: ignore[attr-defined]
                                [getattr(o, "optimizer", o) for o in optimizers], process_group, asynchronous,
                                aliases=self._aliases())

    def load_sharded(self, directory: str, manifest: Dict[str, Any], models: List[torch.nn.Module],
                     optimizers: List[Any], strict: bool = True) -> None:
        """Read a sharded checkpoint into any layout; under pp with the aliases of
        :meth:`save_sharded`. Collective."""
        dcp.load_sharded(directory, [self.unwrap(m) for m in models],  # type: ignore[attr-defined]
                         [getattr(o, "optimizer", o) for o in optimizers], strict=strict, aliases=self._aliases())

    def _aliases(self) -> Optional[Dict[str, str]]:
        return self._pipeline.optimizer_aliases() if self._pipeline is not None else None
