"""Big models: build without memory, shard before filling, load without a full copy per process,
and run models larger than memory by placing layers on devices, in host memory and on disk.

Accelerate's names and semantics (``init_empty_weights``, ``load_checkpoint_and_dispatch``,
``infer_auto_device_map``, ...). One idea per module:

* :mod:`.empty_init` — ``init_empty_weights`` / ``init_on_device``;
* :mod:`.checkpoints` — reading any checkpoint layout one tensor or slice at a time;
* :mod:`.sharded_load` — meta → FSDP2 shards → filled from the model's init or a checkpoint;
* :mod:`.loading` — ``load_checkpoint_in_model``;
"""

from .empty_init import init_empty_weights, init_on_device
from .loading import load_checkpoint_in_model

__all__ = ["init_empty_weights", "init_on_device", "load_checkpoint_in_model"]
