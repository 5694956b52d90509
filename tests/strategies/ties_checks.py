"""Run with 2 processes (anyaccel launch --num_processes 2 --cpu): tied weights survive DDP, FSDP2
(with wrap policies that would put the embedding and the head in different units), save_model ->
transformers from_pretrained, save_state -> load_state, and meta-device init with sharded loading. One launch, many checks
(tests/strategies/test_ties_multiprocess.py asserts them).

    python ties_checks.py OUT_DIR

Each rank writes OUT_DIR/rank<r>.json: {check name: tied_models.report(...) plus extras}.
"""

import copy
import json
import os
import sys
import warnings

import torch
import transformers
from safetensors import safe_open

from anyaccel import Accelerator, init_empty_weights, load_checkpoint_in_model
from anyaccel.plugins import FullyShardedDataParallelPlugin

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tied_models as tm  # noqa: E402

# No fp8 in this job: hide torchao, which transformers would import when it builds a model (~1 s of CPU per
# process, and "Failed to load" lines); docs/contributing/testing.md. Users' scripts are not touched.
sys.modules.setdefault("torchao", None)

out = sys.argv[1]
res = {}


def prepared_run(accelerator, model, reference=None):
    """Prepare ``model`` with a fresh AdamW, train 4 steps; the report and the prepared model.
    ``reference``: the same model, untouched (trained here in one process to compare)."""
    ref_model, ref_losses = tm.reference_run(copy.deepcopy(reference if reference is not None else model))
    model, optimizer = accelerator.prepare(model, tm.adamw(model))
    losses = tm.train(model, optimizer, accelerator.backward)
    return tm.report(accelerator, model, ref_model, losses, ref_losses), model


def warned(fn):
    """fn()'s result and the FSDP tie warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in caught if "tied weights" in str(w.message)]


# 1. DDP: a transformers Llama and a plain torch.nn model
ddp = Accelerator(strategy="ddp")
rank = ddp.process_index
res["ddp_llama"], _ = prepared_run(ddp, tm.llama())
torch.manual_seed(0)
res["ddp_tiednet"], _ = prepared_run(ddp, tm.TiedNet())

# 2. FSDP2, the default policy (the model's _no_split_modules: LlamaDecoderLayer)
fsdp = Accelerator(strategy="fsdp")
res["fsdp_llama"], _ = prepared_run(fsdp, tm.llama())

# 3. FSDP2, policies that would make the embedding and the head units of their own
by_size = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(min_num_params=1000))
(res["fsdp_llama_min_num_params"], sized), res["min_num_params_warnings"] = warned(
    lambda: prepared_run(by_size, tm.llama()))
by_class = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block", "Embedding"]))
torch.manual_seed(0)
(res["fsdp_tiednet_class_policy"], _), res["class_policy_warnings"] = warned(
    lambda: prepared_run(by_class, tm.TiedNet()))

# 4. save_model -> from_pretrained, from the FSDP2 model of 3 (every rank calls save_model)
saved = os.path.join(out, "saved")
by_size.save_model(sized, saved)
trained = tm.full(by_size.unwrap_model(sized).lm_head.weight)
if rank == 0:
    by_size.unwrap_model(sized).config.save_pretrained(saved)
    with safe_open(os.path.join(saved, "model.safetensors"), framework="pt") as fh:
        keys = list(fh.keys())
    loaded = transformers.LlamaForCausalLM.from_pretrained(saved)
    res["save_model"] = {"reloads_tied": loaded.lm_head.weight is loaded.model.embed_tokens.weight,
                         "reloaded_equal": bool(torch.equal(loaded.lm_head.weight.detach(), trained)),
                         "stored_once": ("lm_head.weight" in keys) + ("model.embed_tokens.weight" in keys) == 1}
by_size.wait_for_everyone()

# 5. save_state -> load_state (sharded) into another model under FSDP2: tied, the trained weight
by_size.save_state(os.path.join(out, "state"))
resumed = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(min_num_params=1000))
other = tm.llama(seed=9)  # other weights: the checkpoint must replace them
(other, other_opt), _ = warned(lambda: resumed.prepare(other, tm.adamw(other)))
resumed.load_state(os.path.join(out, "state"))
inner = resumed.unwrap_model(other)
res["load_state"] = {"same_object": inner.lm_head.weight is inner.model.embed_tokens.weight,
                     "equal": bool(torch.equal(tm.full(inner.model.embed_tokens.weight), trained))}

# 6. meta-device init, sharded by FSDP2 (units that would split the tie), then filled
#    a. from the model's own initialisation: the same numbers as an eager build (the first user's)
meta = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block", "Embedding"]))
torch.manual_seed(5)
eager = tm.TiedNet()
torch.manual_seed(5)
with init_empty_weights():
    empty = tm.TiedNet()
(empty, opt), _ = warned(lambda: meta.prepare(empty, tm.adamw(empty)))
filled = {k: tm.full(v) for k, v in meta.unwrap_model(empty).state_dict().items()}
res["meta_init"] = {"equals_eager": all(torch.equal(filled[k], v.detach()) for k, v in eager.state_dict().items()),
                    **tm.report(meta, empty)}
#    b. a transformers checkpoint written by save_pretrained (lm_head.weight not stored), loaded
#       into the shards, then trained
pretrained = os.path.join(out, "pretrained")
source = tm.llama(seed=3)
if rank == 0:
    source.save_pretrained(pretrained)
meta.wait_for_everyone()
with init_empty_weights():
    empty = transformers.LlamaForCausalLM(tm.llama_config())
by_size_meta = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(min_num_params=1000))
(empty, opt), _ = warned(lambda: by_size_meta.prepare(empty, tm.adamw(empty)))
load_checkpoint_in_model(empty, pretrained)
loaded_ok = torch.equal(tm.full(by_size_meta.unwrap_model(empty).lm_head.weight),
                        source.model.embed_tokens.weight.detach())
ref_model, ref_losses = tm.reference_run(copy.deepcopy(source))
losses = tm.train(empty, opt, by_size_meta.backward)
res["meta_loaded"] = {"loaded_equal": bool(loaded_ok), **tm.report(by_size_meta, empty, ref_model, losses, ref_losses)}

with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
    json.dump(res, fh)
ddp.end_training()
