"""Pipeline parallelism checks, several per launch (tests/strategies/nd/pipeline/test_pipeline_multiprocess.py asserts them).

    anyaccel launch --num_processes 4 --cpu pipeline_checks.py OUT pp2dp2     # pp2 x dp_shard2, 1F1B
    anyaccel launch --num_processes 4 --cpu pipeline_checks.py OUT pp2tp2     # pp2 x tp2, Interleaved1F1B
    anyaccel launch --num_processes 8 --cpu pipeline_checks.py OUT pp2tp2dp2  # pp2 x tp2 x dp_shard2, 1F1B
    python pipeline_checks.py OUT one                                         # one process, no pipeline
    anyaccel launch --num_processes 2 --cpu pipeline_checks.py OUT seq        # nn.Sequential, ZBV, bf16, accumulation

A tiny transformers Llama with tied embeddings (random init, nothing downloaded) trains 10 AdamW
steps of 8 sequences (one loader batch per data-parallel rank) through
``accelerator.pipeline_step``, with clipping; rank 0
also trains the same model in one process on the same global batches, without anyaccel (the
reference, written to OUT/reference_weights.pt). Each rank writes OUT/<layout>_rank<r>.json: losses (mean over the data-parallel ranks),
gradient norms, what evaluation gathered, the refusal of a plain call. Checkpoints chain the
layouts: pp2dp2 saves after step 6 (OUT/ckpt_pp), the one-process job loads it, trains steps 7-10
and saves what it loaded (OUT/ckpt_one), and pp2tp2 loads that and trains steps 7-10 too; rank 0
writes the weights (OUT/<layout>_weights.pt) and save_model's directory (OUT/<layout>_model).

``seq``: an ``nn.Sequential`` (embedding, Linear blocks, a head tied to the embedding) cut at its
children into 4 stages laid in a V on 2 processes (ZBVZeroBubble: rank 0 holds the first and the
last, so both copies of the tied weight), bf16 autocast, 2 accumulated micro-steps per optimizer
step, each stage compiled (``dynamo_backend="aot_eager"``); rank 0 trains the same in one process
under ``torch.autocast``, uncompiled.
"""

import copy
import os
import sys

import torch
import transformers
import rank_results  # tests/scripts: on the job's PYTHONPATH (tests/conftest.py clean_env)
from torch.utils.data import DataLoader, TensorDataset

from anyaccel import Accelerator, ParallelismConfig, set_seed

# No fp8 in this job: hide torchao, which transformers would import when it builds a model (~1 s of CPU per
# process, and "Failed to load" lines); docs/contributing/testing.md. Users' scripts are not touched.
sys.modules.setdefault("torchao", None)

out, layout = sys.argv[1], sys.argv[2]
STEPS, GLOBAL, SEQ, VOCAB, SAVE_AT = 10, 8, 16, 64, 6
CONFIGS = {
    "pp2dp2": dict(pp_size=2, dp_shard_size=2, pp_schedule="1F1B", pp_microbatches=2),
    "pp2tp2": dict(pp_size=2, tp_size=2, pp_schedule="interleaved1f1b", pp_microbatches=2),
    "pp2tp2dp2": dict(pp_size=2, tp_size=2, dp_shard_size=2, pp_schedule="1F1B", pp_microbatches=2),
    "one": dict(),
}


def model_and_data():
    set_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=4, vocab_size=VOCAB,
                                      max_position_embeddings=SEQ, tie_word_embeddings=True)
    ids = torch.randint(0, VOCAB, (STEPS * GLOBAL, SEQ), generator=torch.Generator().manual_seed(1))
    return transformers.LlamaForCausalLM(config), ids


def optimizer_for(model):
    # eps 1e-6: Adam divides by sqrt(v) + eps, so where a gradient element is ~eps a rounding
    # difference between summation orders becomes a visible weight difference (with 1e-8: ~1e-5)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)


def main():
    config = ParallelismConfig(**CONFIGS[layout])
    accelerator = Accelerator(parallelism_config=config)
    model, ids = model_and_data()
    reference = copy.deepcopy(model)
    dp = config.for_world_size(accelerator.num_processes).data_parallel_size
    per_rank = GLOBAL // dp
    optimizer = optimizer_for(model)
    loader = DataLoader(TensorDataset(ids), batch_size=per_rank)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    result = {"layout": layout, "world": accelerator.num_processes, "losses": {}, "norms": {}}
    if layout != "one":
        result["stages"] = accelerator.strategy.pipeline_for(model).stages
        result["pp_rank"] = accelerator.strategy.rank_in("pp")
        try:
            model(ids[:2])
        except RuntimeError as exc:
            result["refused"] = str(exc)
    resume = {"pp2dp2": None, "one": "ckpt_pp", "pp2tp2": "ckpt_one", "pp2tp2dp2": None}[layout]
    start = 0
    if resume:
        start = accelerator.resume(os.path.join(out, resume)).step
        if layout == "one":
            accelerator.save_state(os.path.join(out, "ckpt_one"))  # what it loaded, for the pp2tp2 job
    step = start
    for (batch,) in loader:
        loss = accelerator.pipeline_step(model, {"input_ids": batch, "labels": batch})
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        result["norms"][step] = float(norm)
        result["losses"][step] = float(accelerator.reduce(loss, "mean"))
        if layout == "pp2dp2" and step == SAVE_AT:
            accelerator.save_state(os.path.join(out, "ckpt_pp"))
    # evaluation: forward only, outputs on every rank, each sample gathered once
    model.eval()
    with torch.no_grad():
        loss, logits = accelerator.pipeline_step(model, {"input_ids": batch, "labels": batch}, return_outputs=True)
    model.train()
    result["eval_gathered"] = list(accelerator.gather_for_metrics(logits.argmax(-1)).shape)
    result["eval_loss"] = float(accelerator.reduce(loss, "mean"))
    state = accelerator.get_state_dict(model)
    accelerator.save_model(model, os.path.join(out, f"{layout}_model"))
    if accelerator.is_main_process:
        torch.save(state, os.path.join(out, f"{layout}_weights.pt"))
        result.update(train_reference(reference, ids))
    rank_results.write(out, layout, accelerator.process_index, result)
    accelerator.end_training()


def train_reference(model, ids):
    """One process, the whole global batch per step, plain torch."""
    optimizer = optimizer_for(model)
    losses, norms = {}, {}
    for step in range(1, STEPS + 1):
        batch = ids[(step - 1) * GLOBAL: step * GLOBAL]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        norms[step] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
    torch.save(model.state_dict(), os.path.join(out, "reference_weights.pt"))
    return {"ref_losses": losses, "ref_norms": norms}


def seq_main():
    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2, dynamo_backend="aot_eager",
                              parallelism_config=ParallelismConfig(pp_size=2, pp_schedule="ZBVZeroBubble",
                                                                   pp_microbatches=2))
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 32), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 16, bias=False))
    model[-1].weight = model[0].weight  # tied: the first and the last stage, both on rank 0 in the V
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 16, (80, 6), generator=g), torch.randint(0, 16, (80, 6), generator=g)

    def mse(logits, target):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 16), target.reshape(-1))

    optimizer = optimizer_for(model)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    result = {"stages": accelerator.strategy.pipeline_for(model).stages, "losses": [], "norms": [], "dtypes": [],
              "names": [n for n, _ in model.named_parameters()]}
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))  # what the stage computes in
    linear.register_forward_hook(lambda m, i, o: result["dtypes"].append(str(o.dtype)))
    for xb, yb in loader:
        with accelerator.accumulate(model):
            result["losses"].append(float(accelerator.pipeline_step(model, xb, yb, mse)))
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        if norm is not None:
            result["norms"].append(float(norm))
    result["steps"] = accelerator.strategy.pipeline_for(model).steps
    from torch._dynamo.utils import counters

    result["graphs"] = counters["stats"]["unique_graphs"]  # each stage compiled (torch.compile, aot_eager)
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        ref_opt = optimizer_for(reference)
        result["ref_losses"], result["ref_norms"] = [], []
        for i in range(0, 80, 4):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = mse(reference(x[i:i + 4]).float(), y[i:i + 4])
            (loss / 2).backward()
            result["ref_losses"].append(loss.item())
            if i % 8 == 4:
                result["ref_norms"].append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)))
                ref_opt.step()
                ref_opt.zero_grad()
        expected = reference.state_dict()
        result["max_weight_diff"] = max(float((state[k] - expected[k]).abs().max()) for k in expected)
    rank_results.write(out, "seq", accelerator.process_index, result)
    accelerator.end_training()


if __name__ == "__main__":
    seq_main() if layout == "seq" else main()
