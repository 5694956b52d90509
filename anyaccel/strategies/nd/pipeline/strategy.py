"""What a sharding strategy does differently for a model cut into pipeline stages: a mixin.

The ``nd`` strategy puts it first among its bases (``class NDStrategy(PipelinedStrategy, ...)``):
each method here handles a model its :class:`~.schedule.Pipeline` runs and otherwise defers to
the sharding strategy's own (``super()``). It is the :class:`~anyaccel.strategies.capabilities.Pipelined`
capability the ``Accelerator`` asks for in ``pipeline_step``. What it changes, for the pipelined
model only:

* ``prepare_model`` cuts a model to train into stages first (:meth:`PipelinedStrategy._cuts`,
  :meth:`PipelinedStrategy._cut_pipeline`); the strategy parallelizes each stage, then
  :meth:`PipelinedStrategy._start_pipeline` compiles each (with ``dynamo_backend``) and starts the
  schedule's groups;
* optimizers keep only the parameters of this rank's stages (and the tied copies made here);
* ``model_state_dict`` gathers every stage's entries on rank 0 (``save_model``, ``get_state_dict``),
  ``load_model_state_dict`` loads the entries of this rank's stages;
* sharded checkpoints store a tied weight's optimizer state under the name the untied model uses
  (:meth:`~.ties.TiedWeights.aliases`), so they move between pipelined and whole models.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ... import dcp
from ...capabilities import Pipelined

__all__ = ["PipelinedStrategy"]


class PipelinedStrategy(Pipelined):
    """Mixin for a strategy that may hold a :class:`~.schedule.Pipeline` in ``_pipeline``."""

    _pipeline: Any = None

    def _cuts(self, model: torch.nn.Module, evaluation_mode: bool) -> bool:
        """Whether ``prepare`` cuts ``model`` into pipeline stages (pp > 1 and something to train);
        refuses a model compiled before ``prepare`` and a second model. Local."""
        if self.config.pp_size == 1 or evaluation_mode or not any(p.requires_grad for p in model.parameters()):  # type: ignore[attr-defined]
            return False
        from ...compile import compiled_by_user

        if compiled_by_user(model):
            raise ValueError("pp_size > 1: this model was compiled before prepare (torch.compile(model) or "
                             "model.compile()), but no process runs the whole model: pass the uncompiled model "
                             "and Accelerator(dynamo_backend=...), which compiles each pipeline stage")
        if self._pipeline is not None:
            raise ValueError("pp_size > 1: one model per Accelerator can be cut into pipeline stages; this one has "
                             "one already")
        return True

    def _cut_pipeline(self, inner: torch.nn.Module) -> Tuple[List[torch.nn.Module], Dict[int, str]]:
        """Cut ``inner`` (the whole model) into this rank's stages, after the strategy checked its
        tensor-parallel plan on the whole model (``_check_whole_plan``); return the stage modules
        and the name each old parameter has here (for optimizers). Local."""
        from .schedule import Pipeline

        self._check_whole_plan(inner)  # type: ignore[attr-defined]
        every: Dict[int, List[str]] = {}
        for name, p in inner.named_parameters(remove_duplicate=False):
            every.setdefault(id(p), []).append(name)
        self._pipeline = Pipeline.cut(inner, self.config, self.process_mesh)  # type: ignore[attr-defined]
        return self._pipeline.modules, self._pipeline.local_names(every)

    def _start_pipeline(self, parts: Sequence[torch.nn.Module]) -> None:
        """After each stage is parallelized: compile each in place (``dynamo_backend``; under pp the
        whole model never runs), then the pipeline's autocast and groups. Collective. Nothing
        without a pipeline."""
        if self._pipeline is None:
            return
        dynamo = self.dynamo  # type: ignore[attr-defined]
        if dynamo is not None and dynamo.enabled:
            from .schedule import compile_settings

            compile_settings(self.config)  # type: ignore[attr-defined]
            for part in parts:
                self.compile(part)  # type: ignore[attr-defined]
        self._pipeline.start(self.backend.device, self.mixed_precision,  # type: ignore[attr-defined]
                             self.backend.autocast_device_type)  # type: ignore[attr-defined]

    def prepare_model(self, model: torch.nn.Module, device_placement: bool, evaluation_mode: bool) -> torch.nn.Module:
        """Under pp a model to train is cut into stages before anything else (each stage compiled on
        its own, in the strategy's ``wrap``); otherwise the sharding strategy's. Collective."""
        if self._cuts(model, evaluation_mode):
            return self.wrap(model)  # type: ignore[attr-defined,no-any-return]
        return super().prepare_model(model, device_placement, evaluation_mode)  # type: ignore[misc,no-any-return]

    def pipeline_for(self, model: torch.nn.Module) -> Any:
        """The :class:`~.schedule.Pipeline` running ``model`` (prepared under pp), else None. Local."""
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
