"""Run with 2 processes (anyaccel launch / torchrun): FSDP2 on CPU with gloo, checked against DDP.

    python fsdp_checks.py OUT_DIR

Each rank writes OUT_DIR/rank<r>.json; the checkpoints it writes stay in OUT_DIR for the
single-process half of the test (tests/strategies/fsdp/test_fsdp_multiprocess.py loads them in one process).
"""

import functools
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from anyaccel import Accelerator, set_seed
from anyaccel.plugins import FullyShardedDataParallelPlugin

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))  # tiny_models
import tiny_models  # noqa: E402

out = sys.argv[1]
WIDTH = 64


# The model (tests/scripts/tiny_models.py): 4 blocks of width WIDTH; Net(blocks=n) for another depth.
Net = functools.partial(tiny_models.Net, width=WIDTH, blocks=4)


def data(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def build(acc, batch=8, lr=1e-2, shuffle=True, seed=1):
    set_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)  # built before prepare, on the unsharded model
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    # its own generator: the order does not depend on what drew from the global RNG before the epoch
    loader = DataLoader(data(), batch_size=batch, shuffle=shuffle, generator=torch.Generator().manual_seed(seed))
    return acc.prepare(model, opt, loader, sched)


def train(acc, model, opt, loader, sched, steps=None, clip=None):
    losses, norms = [], []
    for i, (x, y) in enumerate(loader):
        if steps is not None and i >= steps:
            break
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            if clip is not None and acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(float(loss))
    return losses, norms


def full_weights(acc, model):
    state = acc.get_state_dict(model)  # collective under FSDP: rank 0 gets everything
    return {k: v.detach().clone() for k, v in state.items()}


def local_bytes(tensors):
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


r = None
res = {}
plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"])
fsdp = Accelerator(fsdp_plugin=plugin)
ddp = Accelerator(strategy="ddp")
r = fsdp.process_index
res["strategies"] = [fsdp.strategy.name, ddp.strategy.name]

# 1. FSDP2 and DDP: same loss trajectory and final weights (clipping on: the global norm too)
m_f, o_f, l_f, s_f = build(fsdp)
m_d, o_d, l_d, s_d = build(ddp)
res["sharded_types"] = sorted({type(p).__name__ for p in m_f.parameters()})
loss_f, norm_f = train(fsdp, m_f, o_f, l_f, s_f, clip=1.0)
loss_d, norm_d = train(ddp, m_d, o_d, l_d, s_d, clip=1.0)
w_f, w_d = full_weights(fsdp, m_f), full_weights(ddp, m_d)
res["loss_fsdp"], res["loss_ddp"], res["norm_fsdp"], res["norm_ddp"] = loss_f, loss_d, norm_f, norm_d
if r == 0:
    res["max_weight_diff"] = max(float((w_f[k] - w_d[k]).abs().max()) for k in w_d)
    res["same_keys"] = sorted(w_f) == sorted(w_d)

# 2. each rank holds about half: parameters, gradients, Adam state (bytes)
x, y = next(iter(l_f))
torch.nn.functional.mse_loss(m_f(x), y).backward()
full_param_bytes = sum(v.numel() * v.element_size() for v in w_d.values()) if r == 0 else None
res["bytes"] = {
    "params": local_bytes(list(m_f.parameters())),
    "grads": local_bytes([p.grad for p in m_f.parameters() if p.grad is not None]),
    "adam": local_bytes([v for st in o_f.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]),
    "full_params": full_param_bytes,
    "ddp_params": local_bytes(list(m_d.parameters())),
}
o_f.zero_grad()

# 3. accumulation (2 micro-batches of 8) == one batch of 16, under FSDP
acc_a = Accelerator(fsdp_plugin=plugin, gradient_accumulation_steps=2)
m1, o1, l1, s1 = build(acc_a, batch=8, shuffle=False)
train(acc_a, m1, o1, l1, s1)
acc_b = Accelerator(fsdp_plugin=plugin)
m2, o2, l2, s2 = build(acc_b, batch=16, shuffle=False)
# the scheduler steps once per optimizer step in both runs
train(acc_b, m2, o2, l2, s2)
w1, w2 = full_weights(acc_a, m1), full_weights(acc_b, m2)
if r == 0:
    res["accumulation_max_diff"] = max(float((w1[k] - w2[k]).abs().max()) for k in w1)

# 4. mid-epoch save_state / resume(): bitwise the uninterrupted run (sharded checkpoint)
acc = Accelerator(fsdp_plugin=plugin)
m, o, l, s = build(acc)
train(acc, m, o, l, s)  # epoch 0
it_losses = []
for i, (x, y) in enumerate(l):  # epoch 1, interrupted after 5 steps
    loss = torch.nn.functional.mse_loss(m(x), y)
    acc.backward(loss)
    o.step(); s.step(); o.zero_grad()
    if i == 4:
        acc.save_state(os.path.join(out, "fsdp_ckpt"))
        at_checkpoint = full_weights(acc, m)
res["ckpt_files"] = sorted(os.listdir(os.path.join(out, "fsdp_ckpt", "sharded"))) if r == 0 else None
reference = full_weights(acc, m)
acc2 = Accelerator(fsdp_plugin=plugin)
m2, o2, l2, s2 = build(acc2, seed=99)  # different initial weights: the checkpoint must overwrite them
res["resume_point"] = list(acc2.resume(os.path.join(out, "fsdp_ckpt"))[:2])  # right after building
for i, (x, y) in enumerate(l2):  # continues epoch 1 after its 5th batch (resume() restores the position)
    loss = torch.nn.functional.mse_loss(m2(x), y)
    acc2.backward(loss)
    o2.step(); s2.step(); o2.zero_grad()
resumed = full_weights(acc2, m2)
if r == 0:
    res["resume_bitwise"] = all(torch.equal(reference[k], resumed[k]) for k in reference)
    torch.save(at_checkpoint, os.path.join(out, "fsdp_at_checkpoint.pt"))  # for the 2 -> 1 process load

# 5. save_model: one full safetensors file written by rank 0, loadable without anyaccel
acc.save_model(m, os.path.join(out, "exported"))  # every rank calls it under FSDP
if r == 0:
    torch.save(reference, os.path.join(out, "exported_expected.pt"))
acc.wait_for_everyone()

# 6. DDP -> FSDP and FSDP -> DDP checkpoint moves
ddp2 = Accelerator(strategy="ddp")
md, od, ld, sd = build(ddp2)
train(ddp2, md, od, ld, sd, steps=5)
ddp2.save_state(os.path.join(out, "ddp_ckpt"))
ddp_weights = full_weights(ddp2, md)
after_ddp, _ = train(ddp2, md, od, ld, sd)  # the rest of the epoch, under DDP
acc3 = Accelerator(fsdp_plugin=plugin)
m3, o3, l3, s3 = build(acc3, seed=7)
acc3.load_state(os.path.join(out, "ddp_ckpt"))
loaded = full_weights(acc3, m3)
after_fsdp, _ = train(acc3, m3, o3, l3, s3)
if r == 0:
    res["ddp_to_fsdp_equal"] = all(torch.equal(ddp_weights[k], loaded[k]) for k in ddp_weights)
res["ddp_to_fsdp_losses"] = [after_ddp, after_fsdp]

acc4 = Accelerator(strategy="ddp")
m4, o4, l4, s4 = build(acc4, seed=8)
acc4.load_state(os.path.join(out, "fsdp_ckpt"))  # sharded, written by FSDP2; epoch 1 again from its start
back = full_weights(acc4, m4)
if r == 0:
    res["fsdp_to_ddp_equal"] = all(torch.equal(back[k], at_checkpoint[k]) for k in back)
res["fsdp_to_ddp_optimizer_steps"] = sorted({int(st["step"]) for st in o4.state.values()})
# transformers' shape: the script skips the 5 batches done (once: load_state left the position)
after_ddp, _ = train(acc4, m4, o4, acc4.skip_first_batches(l4, 5), s4)  # finishes epoch 1 as FSDP did
back_end = full_weights(acc4, m4)
if r == 0:
    res["fsdp_to_ddp_continued_max_diff"] = max(float((back_end[k] - reference[k]).abs().max()) for k in back_end)

# 7. mixed precision (parameters in bf16/fp16 for compute, gradients reduced in fp32), activation
#    checkpointing and size-based wrapping
mp = {}
for precision in ("bf16", "fp16"):
    accm = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(min_num_params=4000, activation_checkpointing=True),
                       mixed_precision=precision)
    mm, om, lm, sm = build(accm)
    seen = []
    mm.blocks[0].fc1.register_forward_hook(lambda mod, i, o: seen.append(str(o.dtype)))
    lossm, _ = train(accm, mm, om, lm, sm)
    mp[precision] = {"losses": lossm, "compute": sorted(set(seen)), "master": sorted({str(p.dtype) for p in mm.parameters()}),
                     "forwards_per_step": len(seen) / len(lossm),  # 2 with activation checkpointing (recomputed)
                     "skipped_steps": accm.scaler is not None and accm.scaler.get_scale() < 65536.0}
res["mixed_precision"] = mp

# 8. a checkpoint taken before the first optimizer step leaves the run unchanged (torch's state-dict
#    helper would initialise the optimizer with a hidden step), in both formats
untouched = {}
for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT", None):
    acc_s = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"],
                                                                   state_dict_type=kind or "SHARDED_STATE_DICT"))
    ms, os_, ls, ss = build(acc_s)
    if kind:
        acc_s.save_state(os.path.join(out, f"early_{kind}"))
    train(acc_s, ms, os_, ls, ss, steps=4)
    untouched[kind or "none"] = full_weights(acc_s, ms)
if r == 0:
    res["early_save_unchanged"] = all(torch.equal(untouched[k][n], untouched["none"][n])
                                      for k in ("SHARDED_STATE_DICT", "FULL_STATE_DICT") for n in untouched["none"])

# 9. clear errors
errors = {}
try:
    Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Decoder"])).prepare(Net())
except ValueError as exc:
    errors["class_name"] = str(exc)
try:
    from torch.distributed.fsdp import fully_shard

    wrapped = Net()
    fully_shard(wrapped)
    Accelerator(strategy="fsdp").prepare(wrapped)
except ValueError as exc:
    errors["already_wrapped"] = str(exc)
res["errors"] = errors

# 10. Accelerate's set_state_dict_type: a run checkpointing sharded switches to full files for its
#     last save; loading those under FSDP2 reads them on rank 0 alone (Accelerate's rank0_only
#     loading) and broadcasts them; a per-process directory is refused (each rank holds a part)
from anyaccel.checkpoint import full_states  # noqa: E402

acc10 = Accelerator(strategy="fsdp")  # no plugin given: accelerator.state.fsdp_plugin exists, as in Accelerate
m10, o10, l10, s10 = build(acc10)
train(acc10, m10, o10, l10, s10, steps=3)
plugin10 = acc10.state.fsdp_plugin
res["state_dict_type_before"] = plugin10.state_dict_type
plugin10.set_state_dict_type("FULL_STATE_DICT")
acc10.save_state(os.path.join(out, "switched"))
res["switched_files"] = sorted(f for f in os.listdir(os.path.join(out, "switched")) if not f.startswith("random"))
expected10 = full_weights(acc10, m10)
reads = {"model": 0, "optimizer": 0}
read_model, read_torch = full_states.load_model_file, full_states.torch_load


def counting(kind, read):
    def wrapped(*args, **kwargs):
        reads[kind] += 1
        return read(*args, **kwargs)
    return wrapped


full_states.load_model_file, full_states.torch_load = counting("model", read_model), counting("optimizer", read_torch)
acc11 = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT"))
m11, o11, l11, s11 = build(acc11, seed=5)
acc11.load_state(os.path.join(out, "switched"))
loaded11 = full_weights(acc11, m11)
res["rank0_reads"] = dict(reads)
if r == 0:
    res["rank0_load_equal"] = all(torch.equal(expected10[k], loaded11[k]) for k in expected10)
res["rank0_optimizer_steps"] = sorted({int(st["step"]) for st in o11.state.values()})
acc12 = Accelerator(strategy="fsdp")
set_seed(1)
m12 = tiny_models.Net(width=WIDTH, blocks=3)  # another model, the same objects prepared
o12 = torch.optim.AdamW(m12.parameters(), lr=1e-2)
acc12.prepare(m12, o12, DataLoader(data(), batch_size=8), torch.optim.lr_scheduler.StepLR(o12, step_size=3))
try:
    acc12.load_state(os.path.join(out, "switched"))
    res["rank0_mismatch"] = "loaded"
except Exception as exc:  # noqa: BLE001 - every rank must raise, none may wait
    res["rank0_mismatch"] = f"{type(exc).__name__}: {exc}"
full_states.load_model_file, full_states.torch_load = read_model, read_torch
try:
    acc11.save_state(os.path.join(out, f"own_dir_{r}"))
    res["own_dirs"] = "saved"
except Exception as exc:  # noqa: BLE001
    res["own_dirs"] = f"{type(exc).__name__}: {exc}"

# 11. one optimizer over two prepared models (diffusers' text encoder + UNet shape), saved under DDP
#     and loaded under FSDP2 on 2 processes: FSDP2 loads an optimizer into the one model holding its
#     parameters, so the load fails, with the same CheckpointError on both ranks (found by each: no
#     rank waits in rank 0's broadcast); a saved optimizer whose groups differ raises on both too
def two_models(accelerator, seed):
    set_seed(seed)
    first, second = tiny_models.Net(width=WIDTH, blocks=1), tiny_models.Net(width=WIDTH, blocks=1)
    optimizer = torch.optim.AdamW(list(first.parameters()) + list(second.parameters()), lr=1e-2)
    first, second, optimizer = accelerator.prepare(first, second, optimizer)
    batch = torch.randn(8, 8, generator=torch.Generator().manual_seed(seed))
    accelerator.backward(first(batch).sum() + second(batch).sum())
    optimizer.step()
    optimizer.zero_grad()
    return accelerator


two_dir = os.path.join(out, "two_models")
two_models(Accelerator(strategy="ddp"), 3).save_state(two_dir)
try:
    two_models(Accelerator(strategy="fsdp"), 4).load_state(two_dir)
    res["two_models_one_optimizer"] = "loaded"
except Exception as exc:  # noqa: BLE001 - every rank must raise, none may wait
    res["two_models_one_optimizer"] = f"{type(exc).__name__}: {exc}"
groups_dir = os.path.join(out, "one_model_two_groups")
one = Accelerator(strategy="ddp")
set_seed(3)
one_model = tiny_models.Net(width=WIDTH, blocks=1)
one_optimizer = torch.optim.AdamW(one_model.parameters(), lr=1e-2)
one_model, one_optimizer = one.prepare(one_model, one_optimizer)
one.backward(one_model(torch.randn(8, 8)).sum())
one_optimizer.step()
one.save_state(groups_dir)
acc15 = Accelerator(strategy="fsdp")
set_seed(3)
m15 = tiny_models.Net(width=WIDTH, blocks=1)
o15 = torch.optim.AdamW([{"params": list(m15.parameters())[:2]}, {"params": list(m15.parameters())[2:]}], lr=1e-2)
acc15.prepare(m15, o15)
try:
    acc15.load_state(groups_dir)
    res["optimizer_groups_differ"] = "loaded"
except Exception as exc:  # noqa: BLE001
    res["optimizer_groups_differ"] = f"{type(exc).__name__}: {exc}"

with open(os.path.join(out, f"rank{r}.json"), "w") as fh:
    json.dump(res, fh)
fsdp.end_training()
