"""A plain Accelerator() in each worker: report what the launcher told it (strategy, FSDP, compile)."""

import json
import sys

import torch

from anyaccel import Accelerator

acc = Accelerator()
model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)))
fsdp = acc.strategy.options if acc.strategy.name == "fsdp" else None  # its FSDPOptions
report = {"strategy": acc.strategy.name, "world": acc.num_processes,
          "wrap": fsdp and list(fsdp.transformer_cls_names_to_wrap), "ac": fsdp and fsdp.activation_checkpointing,
          "dynamo": acc.strategy.dynamo and acc.strategy.dynamo.backend,
          "sharded": sorted({type(p).__name__ for p in model.parameters()})}
with open(f"{sys.argv[1]}/rank{acc.process_index}.json", "w") as fh:
    json.dump(report, fh)
