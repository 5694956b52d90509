"""Run with 2 processes (anyaccel launch): a model built on meta, prepared under FSDP2.

    python bigmodel_fsdp.py OUT_DIR

1. torch.nn model: init_empty_weights -> prepare -> full weights equal (bitwise) to the same model
   built eagerly after the same seed; each rank holds about half; a training step runs.
2. pretrained weights (one safetensors file / the HF sharded layout / an anyaccel sharded
   save_state directory) into a meta model prepared under FSDP2: equal to the source.
3. a checkpoint with a wrong shape is refused on every rank before anything is loaded.
4. the meta model under ParallelismConfig(dp_shard_size=2) (the nd strategy): equal to eager, runs.
Each rank writes OUT_DIR/rank<r>.json.
"""

import json
import os
import sys

import torch

from anyaccel import Accelerator, ParallelismConfig, set_seed
from anyaccel.big_modeling import init_empty_weights, load_checkpoint_in_model
from anyaccel.checkpoint import save_model
from anyaccel.errors import CheckpointError
from anyaccel.plugins import FullyShardedDataParallelPlugin

out = sys.argv[1]


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(torch.nn.Module):
    def __init__(self, width=48, blocks=3):
        super().__init__()
        self.emb = torch.nn.Embedding(17, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = torch.nn.Linear(width, 5)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def full(acc, model):
    return {k: v.clone() for k, v in acc.get_state_dict(model).items()}


plugin = FullyShardedDataParallelPlugin(auto_wrap_policy=lambda m: isinstance(m, Block))
acc = Accelerator(fsdp_plugin=plugin)
rank = acc.process_index
res = {}

set_seed(3)
eager = Net()
reference = {k: v.clone() for k, v in eager.state_dict().items()}
set_seed(3)
with init_empty_weights():
    meta = Net()
res["built_on_meta"] = all(p.is_meta for p in meta.parameters())
opt = torch.optim.SGD(meta.parameters(), lr=0.1)
meta, opt = acc.prepare(meta, opt)
res["local_bytes"] = sum(p.to_local().numel() * p.element_size() for p in meta.parameters())
res["full_bytes"] = sum(v.numel() * v.element_size() for v in reference.values())
got = full(acc, meta)
if rank == 0:
    res["bitwise_equal_to_eager"] = sorted(got) == sorted(reference) and all(torch.equal(got[k], reference[k])
                                                                              for k in reference)
ids = torch.randint(0, 17, (4, 6), generator=torch.Generator().manual_seed(rank))
loss = meta(ids).square().mean()
acc.backward(loss)
opt.step()
res["trained"] = bool(torch.isfinite(loss))

# 2. pretrained weights in three layouts
src = {k: torch.randn_like(v) for k, v in reference.items()}
layouts = {"file": os.path.join(out, "one", "model.safetensors"), "hf": os.path.join(out, "hf")}
if rank == 0:
    save_model(src, os.path.join(out, "one"), max_shard_size="10GB")
    save_model(src, layouts["hf"], max_shard_size="20KB")
acc.wait_for_everyone()
res["hf_index"] = os.path.exists(os.path.join(layouts["hf"], "model.safetensors.index.json"))
# an anyaccel sharded checkpoint: save_state of a sharded model holding src
sharded_acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT"))
with init_empty_weights():
    holder = Net()
holder = sharded_acc.prepare(holder)
load_checkpoint_in_model(holder, layouts["file"])
sharded_acc.save_state(os.path.join(out, "state"))
layouts["anyaccel_state"] = os.path.join(out, "state")
for name, path in layouts.items():
    with init_empty_weights():
        model = Net()
    model = acc.prepare(model)
    load_checkpoint_in_model(model, path)
    got = full(acc, model)
    if rank == 0:
        res[f"loaded_{name}"] = all(torch.equal(got[k], src[k]) for k in src)

# 3. wrong shapes: refused on every rank before anything is loaded
bad = dict(src, **{"head.weight": torch.zeros(6, 48)})
if rank == 0:
    save_model(bad, os.path.join(out, "bad"))
acc.wait_for_everyone()
with init_empty_weights():
    model = Net()
model = acc.prepare(model)
before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
try:
    load_checkpoint_in_model(model, os.path.join(out, "bad"))
    res["bad_shape_error"] = None
except CheckpointError as exc:
    res["bad_shape_error"] = str(exc)
res["untouched_after_error"] = all(torch.equal(v.to_local(), before[k]) for k, v in model.state_dict().items())

# 4. the same meta model under the N-D strategy, sharded only (ParallelismConfig(dp_shard_size=2))
nd_acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2))
set_seed(3)
with init_empty_weights():
    nd_model = Net()
nd_model = nd_acc.prepare(nd_model)
got = {k: v.clone() for k, v in nd_acc.get_state_dict(nd_model).items()}
if rank == 0:
    res["nd_bitwise_equal_to_eager"] = sorted(got) == sorted(reference) and all(
        torch.equal(got[k], reference[k]) for k in reference)
res["nd_forward_finite"] = bool(torch.isfinite(nd_model(torch.randint(0, 17, (2, 3)))).all())

with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
    json.dump(res, fh)
acc.end_training()
