"""Run with anyaccel launch --cpu: fp8 (torchao, emulated on the CPU) under DDP, FSDP2 and TP x FSDP,
each checked against one process training the same batches in fp8 (rank 0 runs it), and
checkpoints under FSDP2 with the fp8 all-gather.

    python fp8_checks.py OUT_DIR two        # 2 processes: ddp, fsdp (fp8 all-gather), checkpoints
    python fp8_checks.py OUT_DIR tp_fsdp    # 4 processes: ParallelismConfig(dp_shard_size=2, tp_size=2)

The model is a tiny transformers Llama (random weights, nothing downloaded). Every run trains STEPS
optimizer steps of ACCUMULATE micro-batches per data-parallel rank, clipping the gradient norm at
each step. The reference (one process, rank 0) converts the same model with the same fp8 settings
and runs every data-parallel rank's micro-batches one after another under bf16 autocast, with the
loss divided by their number: the same dynamic fp8 scales per micro-batch as the job's, so only
the order of fp32 sums differs (the tolerances are tests/training/test_precision_fp8_multiprocess.py's).
Each rank writes OUT_DIR/rank<r>.json.
"""

import copy
import json
import os
import sys

import torch
import transformers

from anyaccel import Accelerator, ParallelismConfig, ProjectConfiguration, set_seed
from anyaccel.precision_fp8 import CPU, Fp8Training, report

out, layout = sys.argv[1], sys.argv[2]
STEPS, ACCUMULATE, BATCH, SEQ, LR, CLIP = 2, 2, 2, 16, 0.05, 1.0
CONFIG = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                  num_hidden_layers=2, vocab_size=128, max_position_embeddings=SEQ)


def llama():
    set_seed(0)
    return transformers.LlamaForCausalLM(CONFIG)


def optimizer(model):
    """SGD with momentum: a weight differs where its gradients did (AdamW's first steps move every weight by
    about lr whatever its gradient, which would hide a wrong gradient in the weights)."""
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def batches(dp, seed=1):
    """[step][dp rank][micro-batch] token ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (STEPS, dp, ACCUMULATE, BATCH, SEQ), generator=g)


def train(acc, model, opt, ids, dp_rank):
    losses, norms = [], []
    for step in range(ids.shape[0]):
        for micro in ids[step, dp_rank].to(acc.device):
            with acc.accumulate(model):
                loss = model(input_ids=micro, labels=micro).loss
                acc.backward(loss)
                if acc.sync_gradients:
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
                opt.step()
                opt.zero_grad()
            losses.append(float(acc.reduce(loss.detach(), "mean")))
    return losses, norms


def reference(ids, like):
    """One process, no Accelerator: the same conversion (the accelerator's fp8 settings), bf16 autocast,
    every dp rank's micro-batches in turn, the loss divided by their number."""
    model = llama()
    fp8 = Fp8Training(like.options, CPU, is_main_process=False)
    fp8.convert(model)
    opt = optimizer(model)
    dp, losses, norms = ids.shape[1], [], []
    for step in range(ids.shape[0]):
        per_micro = [[] for _ in range(ACCUMULATE)]
        for r in range(dp):
            for m, micro in enumerate(ids[step, r]):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(input_ids=micro, labels=micro).loss
                (loss.float() / (dp * ACCUMULATE)).backward()
                per_micro[m].append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses += [sum(v) / dp for v in per_micro]
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def compare(result, name, acc, model, ids, losses, norms):
    state = acc.get_state_dict(model)
    result[name] = {"losses": losses, "norms": norms, "report": report(model).message() if report(model) else None,
                    "all_gather": report(model).fsdp_float8_all_gather if report(model) else None,
                    "float8_layers": sum(type(m).__name__ == "Float8Linear" for m in acc.unwrap_model(model).modules())}
    if acc.is_main_process:
        ref_losses, ref_norms, expected = reference(ids, acc._fp8)
        result[name].update(ref_losses=ref_losses, ref_norms=ref_norms, same_keys=sorted(state) == sorted(expected),
                            max_weight_diff=max(float((state[k].float() - expected[k].float()).abs().max())
                                                for k in expected))


def run(name, result, **kwargs):
    acc = Accelerator(mixed_precision="fp8", gradient_accumulation_steps=ACCUMULATE, **kwargs)
    model = llama()
    opt = optimizer(model)  # built before prepare: remapped onto the new parameters
    model, opt = acc.prepare(model, opt)
    dp_rank, dp = acc.strategy.data_parallel()
    ids = batches(dp)
    losses, norms = train(acc, model, opt, ids, dp_rank)
    compare(result, name, acc, model, ids, losses, norms)
    return acc, model, opt


def checkpoints(result):
    """FSDP2 + fp8 all-gather: save_state, train on; a new job resume()s and continues bitwise; the
    sharded checkpoint loads into a bf16 FSDP2 run and back; save_model gives the plain model's weights."""
    project = ProjectConfiguration(project_dir=os.path.join(out, "project"), automatic_checkpoint_naming=True)
    ids = batches(2, seed=7)

    def job(precision="fp8"):
        acc = Accelerator(mixed_precision=precision, strategy="fsdp", project_config=copy.deepcopy(project))
        model = llama()
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))  # state to restore
        return acc, model, opt

    acc, model, opt = job()
    first = acc.resume()  # nothing there yet
    train(acc, model, opt, ids[:1], acc.process_index)
    acc.save_state()
    at_save = acc.get_state_dict(model)
    after, _ = train(acc, model, opt, ids[1:], acc.process_index)
    state = acc.get_state_dict(model)
    acc2, model2, opt2 = job()
    point = acc2.resume()
    again, _ = train(acc2, model2, opt2, ids[1:], acc2.process_index)
    state2 = acc2.get_state_dict(model2)
    acc3, model3, _ = job("bf16")  # the fp8 run's sharded checkpoint into a bf16 run (strict: the same keys)
    acc3.load_state(point.checkpoint)
    acc3.save_model(model3, os.path.join(out, "bf16_model"))
    acc.save_model(model2, os.path.join(out, "fp8_model"))  # collective: every rank
    result["checkpoints"] = {"first": list(first), "resumed_from": os.path.basename(point.checkpoint or ""),
                             "continued": after, "resumed": again, "bitwise": after == again and all(
                                 torch.equal(state[k], state2[k]) for k in state),
                             "all_gather": report(model2).fsdp_float8_all_gather}
    if acc.is_main_process:  # the fp8 job's save_model and the bf16 job's: the plain Llama loads both
        plain = transformers.LlamaForCausalLM(CONFIG)
        for name, expected in (("fp8_model", state2), ("bf16_model", at_save)):
            weights = saved_weights(name)
            missing, unexpected = plain.load_state_dict(weights, strict=False)
            result["checkpoints"][name] = {"missing": list(missing), "unexpected": list(unexpected),
                                           "types": sorted({type(v).__name__ for v in weights.values()}),
                                           "equal": all(torch.equal(weights[k], expected[k]) for k in expected)}


def saved_weights(name):
    """What save_model wrote under OUT_DIR/name (its safetensors shards), read without anyaccel."""
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(os.listdir(os.path.join(out, name))):
        if f.endswith(".safetensors"):
            weights.update(load_file(os.path.join(out, name, f)))
    return weights


result = {}
if layout == "two":
    run("ddp", result, strategy="ddp")
    run("fsdp", result, strategy="fsdp")
    checkpoints(result)
else:
    run("tp_fsdp", result, parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
acc = Accelerator()
with open(os.path.join(out, f"rank{acc.process_index}.json"), "w") as f:
    json.dump(result, f)
acc.end_training()
