"""``anyaccel.utils.deepspeed``: Accelerate's DeepSpeed names, refused (anyaccel has no DeepSpeed
integration; importing works so that a migrated script starts, using them raises
``NotImplementedError`` naming FSDP2 as the way to shard)."""

from __future__ import annotations

from ._refuse import refused_names

__all__ = ["DummyOptim", "DummyScheduler", "DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper",
           "DeepSpeedSchedulerWrapper", "HfDeepSpeedConfig", "get_active_deepspeed_plugin",
           "map_pytorch_optim_to_deepspeed"]

globals().update(refused_names("deepspeed", __all__))
