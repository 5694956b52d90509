"""Run with 2 processes (anyaccel launch): a transformers Llama from a tiny config, end to end.

    python bigmodel_hf.py OUT_DIR

Rank 0 saves random pretrained weights in the Hugging Face layout (sharded, with
model.safetensors.index.json). Every rank: init_empty_weights -> prepare (FSDP2; each rank holds
about half) -> load_checkpoint_in_model (each rank reads its rows) -> 3 training steps ->
save_model. Rank 0 then loads the saved model with load_checkpoint_and_dispatch and a cpu+disk map
and compares its logits with the same weights loaded in memory by transformers.
Each rank writes OUT_DIR/rank<r>.json.
"""

import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from anyaccel import Accelerator, set_seed
from anyaccel.big_modeling import init_empty_weights, load_checkpoint_and_dispatch, load_checkpoint_in_model

# No fp8 in this job: hide torchao, which transformers would import when it builds a model (~1 s of CPU per
# process, and "Failed to load" lines); docs/contributing/testing.md. Users' scripts are not touched.
sys.modules.setdefault("torchao", None)

out = sys.argv[1]
config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
acc = Accelerator(strategy="fsdp")
rank = acc.process_index
res = {}
pretrained = os.path.join(out, "pretrained")
if rank == 0:
    set_seed(7)
    LlamaForCausalLM(config).save_pretrained(pretrained, max_shard_size="40KB")
acc.wait_for_everyone()
res["hf_index"] = os.path.exists(os.path.join(pretrained, "model.safetensors.index.json"))

set_seed(0)
with init_empty_weights():
    model = LlamaForCausalLM(config)
res["meta"] = all(p.is_meta for p in model.parameters())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = acc.prepare(model, optimizer)
load_checkpoint_in_model(model, pretrained)
full = acc.get_state_dict(model)
if rank == 0:
    from safetensors.torch import load_file

    source = {}
    for name in os.listdir(pretrained):
        if name.endswith(".safetensors"):
            source.update(load_file(os.path.join(pretrained, name)))
    res["loaded_equals_pretrained"] = all(torch.equal(full[k], source[k]) for k in source) and set(source) <= set(full)
res["local_param_bytes"] = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
res["full_param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())

g = torch.Generator().manual_seed(rank)
losses = []
for _ in range(3):
    ids = torch.randint(0, 96, (2, 12), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    acc.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(float(loss))
res["losses"] = losses
trained = os.path.join(out, "trained")
acc.save_model(model, trained, max_shard_size="40KB")
acc.wait_for_everyone()

if rank == 0:
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(5))
    reference = LlamaForCausalLM(config).eval()  # the same weights, loaded whole in memory
    from safetensors.torch import load_file
    reference.load_state_dict({k: v for f in os.listdir(trained) if f.endswith(".safetensors")
                               for k, v in load_file(os.path.join(trained, f)).items()})
    with torch.no_grad():
        want = reference(input_ids=ids).logits
    res["trained_changed"] = not torch.equal(reference.lm_head.weight, source["lm_head.weight"])
    with init_empty_weights():
        empty = LlamaForCausalLM(config)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk"}
    dispatched = load_checkpoint_and_dispatch(empty, trained, device_map=device_map,
                                              offload_folder=os.path.join(out, "offload")).eval()
    with torch.no_grad():
        got = dispatched(input_ids=ids).logits
    res["dispatch_max_diff"] = float((got - want).abs().max())
    res["disk_params_meta"] = all(p.is_meta for n, p in dispatched.named_parameters() if n.startswith("model.layers.1."))
    # "auto" with a budget smaller than the model: part of it goes to disk
    with init_empty_weights():
        empty = LlamaForCausalLM(config)
    total = sum(p.numel() * 4 for p in empty.parameters())
    auto = load_checkpoint_and_dispatch(empty, trained, device_map="auto", max_memory={"cpu": total // 2},
                                        no_split_module_classes=["LlamaDecoderLayer"],
                                        offload_folder=os.path.join(out, "offload_auto")).eval()
    with torch.no_grad():
        res["auto_max_diff"] = float((auto(input_ids=ids).logits - want).abs().max())
    res["auto_map_devices"] = sorted(set(map(str, auto.hf_device_map.values())))
with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
    json.dump(res, fh)
acc.end_training()
