"""Run with 4 processes (anyaccel launch --num_processes 4 --cpu): tied weights survive N-D
parallelism — TP2 x FSDP2 (the model's own transformers plan), HSDP 2 x 2, tensor parallel over
all 4, a user's parallelize_fn on a plain torch.nn model — and save_model -> from_pretrained after
TP x FSDP; a plan that cuts the embedding and the head differently is an error naming both. One
launch, many checks (tests/strategies/test_ties_multiprocess.py asserts them).

    python ties_nd_checks.py OUT_DIR

Each rank writes OUT_DIR/rank<r>.json.
"""

import copy
import json
import os
import sys

import torch
import transformers
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from anyaccel import Accelerator, ParallelismConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tied_models as tm  # noqa: E402

# No fp8 in this job: hide torchao, which transformers would import when it builds a model (~1 s of CPU per
# process, and "Failed to load" lines); docs/contributing/testing.md. Users' scripts are not touched.
sys.modules.setdefault("torchao", None)

out = sys.argv[1]
res = {}


def prepared_run(accelerator, model):
    """Prepare ``model`` with a fresh AdamW, train 4 steps (every rank the same batches); the
    report against the same training in one process, and the prepared model."""
    ref_model, ref_losses = tm.reference_run(copy.deepcopy(model))
    model, optimizer = accelerator.prepare(model, tm.adamw(model))
    losses = tm.train(model, optimizer, accelerator.backward)
    return tm.report(accelerator, model, ref_model, losses, ref_losses), model


# 1. TP2 x FSDP2 with the model's own plan (embedding rowwise, lm_head colwise), then save_model
tp_fsdp = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
rank = tp_fsdp.process_index
res["tp2_fsdp2"], model = prepared_run(tp_fsdp, tm.llama())
saved = os.path.join(out, "saved")
tp_fsdp.save_model(model, saved)  # collective: every rank calls it
trained = tm.full(tp_fsdp.unwrap_model(model).lm_head.weight)
if rank == 0:
    tp_fsdp.unwrap_model(model).config.save_pretrained(saved)
    loaded = transformers.LlamaForCausalLM.from_pretrained(saved)
    res["save_model"] = {"reloads_tied": loaded.lm_head.weight is loaded.model.embed_tokens.weight,
                         "reloaded_equal": bool(torch.equal(loaded.lm_head.weight.detach(), trained))}
tp_fsdp.wait_for_everyone()

# 2. HSDP: 2 replicas x 2 shards
hsdp = Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))
res["hsdp"], _ = prepared_run(hsdp, tm.llama())

# 3. tensor parallel over all 4 processes (4 key/value heads: TP 4 divides them)
tp4 = Accelerator(parallelism_config=ParallelismConfig(tp_size=4))
res["tp4"], _ = prepared_run(tp4, tm.llama(kv_heads=4))


# 4. a plain torch.nn model with a tie by assignment, the user's parallelize_fn, TP2 x FSDP2
def parallelize(model, mesh):
    parallelize_module(model, mesh["tp"], {"embed": RowwiseParallel(input_layouts=Replicate()),
                                           "blocks.*.fc1": ColwiseParallel(), "blocks.*.fc2": RowwiseParallel(),
                                           "head": ColwiseParallel(output_layouts=Replicate())})


user_fn = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2, parallelize_fn=parallelize))
torch.manual_seed(0)
res["parallelize_fn_tiednet"], _ = prepared_run(user_fn, tm.TiedNet())

# 5. plans that would untie: an error naming both parameters (raised on every rank alike)
errors = {}
for name, plan in {"different_dims": {"model.embed_tokens": "colwise", "lm_head": "colwise_gather_output"},
                   "one_left_out": {"lm_head": "colwise_gather_output"}}.items():
    bad = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2, tp_plan=plan))
    try:
        bad.prepare(tm.llama())
        errors[name] = None
    except ValueError as exc:
        errors[name] = str(exc)
res["errors"] = errors

with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
    json.dump(res, fh)
tp_fsdp.end_training()
