"""Run with 2 processes (anyaccel launch --num_processes 2 --cpu): a transformers Llama built from a
tiny config (random weights, nothing downloaded) trains with its own tensor-parallel plan (TP2),
checked against the same training in one process (rank 0 runs it).

    python nd_llama.py OUT_DIR
"""

import copy
import json
import os
import sys

import torch
import transformers

from anyaccel import Accelerator, ParallelismConfig, set_seed

# No fp8 in this job: hide torchao, which transformers would import when it builds a model (~1 s of CPU per
# process, and "Failed to load" lines); docs/contributing/testing.md. Users' scripts are not touched.
sys.modules.setdefault("torchao", None)

out = sys.argv[1]
accelerator = Accelerator(parallelism_config=ParallelismConfig(tp_size=2))
set_seed(0)
config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  num_hidden_layers=2, vocab_size=64, max_position_embeddings=32)
model = transformers.LlamaForCausalLM(config)
reference = copy.deepcopy(model)
ids = torch.randint(0, 64, (5, 4, 16), generator=torch.Generator().manual_seed(1))


def optimizer_for(m):
    return torch.optim.SGD(m.parameters(), lr=0.1)


optimizer = optimizer_for(model)
model, optimizer = accelerator.prepare(model, optimizer)
losses, norms = [], []
for batch in ids:
    loss = model(input_ids=batch, labels=batch).loss
    accelerator.backward(loss)
    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
state = accelerator.get_state_dict(model)
result = {"losses": losses, "norms": norms, "tp_rank": accelerator.tensor_parallel_rank,
          "dtensors": sum(type(p).__name__ == "DTensor" for p in model.parameters())}
if accelerator.is_main_process:
    ref_opt = optimizer_for(reference)
    result["ref_losses"], result["ref_norms"] = [], []
    for batch in ids:
        loss = reference(input_ids=batch, labels=batch).loss
        loss.backward()
        result["ref_norms"].append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)))
        ref_opt.step()
        ref_opt.zero_grad()
        result["ref_losses"].append(loss.item())
    expected = reference.state_dict()
    result["max_weight_diff"] = max(float((state[k].float() - expected[k]).abs().max()) for k in expected)
    result["same_keys"] = sorted(state) == sorted(expected)
with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
    json.dump(result, f)
accelerator.end_training()
