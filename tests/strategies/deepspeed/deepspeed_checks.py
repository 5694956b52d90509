"""Run with 2 processes (anyaccel launch): DeepSpeed ZeRO 1/2/3 on CPU (gloo), checked against one
process, resumed mid-epoch, saved and moved between DeepSpeed and FSDP2.

    python deepspeed_checks.py OUT_DIR [CHECK ...]

Each rank writes OUT_DIR/rank<r>.json (one entry per check, or {"error": ...} for a check that
raised); checkpoints stay in OUT_DIR. Without CHECK names every check runs, in one launch
(tests/strategies/deepspeed/test_deepspeed_multiprocess.py asserts each).
"""

import functools
import json
import os
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from anyaccel import Accelerator, set_seed
from anyaccel.checkpoint import ProjectConfiguration
from anyaccel.plugins import FullyShardedDataParallelPlugin
from anyaccel.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))  # tiny_models
import tiny_models  # noqa: E402

# No fp8 in this job: hide torchao, which transformers would import when it builds a model (~1 s of CPU per
# process, and "Failed to load" lines); docs/contributing/testing.md. Users' scripts are not touched.
sys.modules.setdefault("torchao", None)

warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.*deprecated")

OUT = sys.argv[1]
WIDTH = 32
Net = functools.partial(tiny_models.Net, width=WIDTH, blocks=2)


def data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def loader_of(batch, shuffle=True, seed=1, n=64):
    return DataLoader(data(n), batch_size=batch, shuffle=shuffle, generator=torch.Generator().manual_seed(seed))


ACCELERATORS = []  # every check's; the last one ends the job (end_training leaves the process group)


def ds(stage, **kwargs):
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage), **kwargs)
    ACCELERATORS.append(acc)
    return acc


def build(acc, batch=8, lr=1e-2, seed=1, shuffle=True, scheduler=True):
    set_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    objects = [model, opt, loader_of(batch, shuffle=shuffle, seed=seed)]
    if scheduler:
        objects.append(torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
    return acc.prepare(*objects)


def train(acc, model, opt, loader, sched=None, steps=None, clip=None, record=None, epochs=1):
    losses, norms = [], []
    done = 0
    for _ in range(epochs):
        for x, y in loader:
            with acc.accumulate(model):
                if record is not None:
                    record.append(acc.gather((x, y)))
                loss = torch.nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                if clip is not None and acc.sync_gradients:
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), clip)))
                opt.step()
                if sched is not None:
                    sched.step()
                opt.zero_grad()
            losses.append(float(loss.detach()))
            done += 1
            if steps is not None and done >= steps:  # before the loader draws the next batch
                return losses, norms
    return losses, norms


def reference(batches, lr=1e-2, seed=1, clip=None, accumulation=1):
    """One process, plain torch: the same initial weights and the same global batches."""
    set_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    norms = []
    for i in range(0, len(batches), accumulation):
        group = batches[i:i + accumulation]
        for x, y in group:
            (torch.nn.functional.mse_loss(model(x), y) / len(group)).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        for _ in range(dist.get_world_size()):  # anyaccel steps a scheduler once per process per step
            sched.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def max_diff(a, b):
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in b)


def bitwise(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in b)


# ---- the checks -------------------------------------------------------------------------------
def check_equivalence(res):
    """ZeRO-1/2/3 on 2 processes == one process on the same global batches (clipping on)."""
    out = {}
    for stage in (1, 2, 3):
        acc = ds(stage)
        model, opt, loader, sched = build(acc)
        batches = []
        losses, norms = train(acc, model, opt, loader, sched, clip=0.5, record=batches)
        weights = acc.get_state_dict(model)
        ref, ref_norms = reference(batches, clip=0.5)
        entry = {"types": [type(model).__name__, type(opt.optimizer).__name__, acc.distributed_type.value],
                 "norms": norms, "steps": len(losses), "lr": opt.param_groups[0]["lr"]}
        if acc.is_main_process:
            entry.update(_main_only(lambda: dict(max_diff=max_diff(weights, ref), ref_norms=ref_norms,
                                                 keys=sorted(weights) == sorted(ref))))
        else:
            entry["state_dict_elsewhere"] = len(weights)
        local = sum((getattr(p, "ds_tensor", p)).numel() for p in model.module.parameters())
        entry["local_param_fraction"] = local / sum(v.numel() for v in ref.values() if v.is_floating_point())
        out[stage] = entry
    res["equivalence"] = out


def check_accumulation(res):
    """ZeRO-2, 2 micro-batches of 4 per process == one process on the global batches of 16."""
    acc = ds(2, gradient_accumulation_steps=2)
    model, opt, loader, sched = build(acc, batch=4, shuffle=False)
    batches = []
    train(acc, model, opt, loader, sched, record=batches)
    weights = acc.get_state_dict(model)
    ref, _ = reference(batches, accumulation=2)
    res["accumulation"] = {"max_diff": max_diff(weights, ref) if acc.is_main_process else None,
                           "engine_gas": model.gradient_accumulation_steps(),
                           "optimizer_steps": model.global_steps}


def check_resume(res):
    """Mid-epoch save_state / resume() == the uninterrupted run, bitwise, for each stage."""
    out = {}
    for stage in (1, 2, 3):
        project = os.path.join(OUT, f"resume_z{stage}")
        acc = ds(stage)
        m, o, loader, s = build(acc)
        train(acc, m, o, loader, s, epochs=2)
        full = acc.get_state_dict(m)

        config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
        acc = ds(stage, project_config=config)
        m, o, loader, s = build(acc)
        train(acc, m, o, loader, s, steps=3)  # 3 of 4 batches of epoch 0
        path = acc.save_state()

        acc = ds(stage, project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True))
        m, o, loader, s = build(acc)
        start = acc.resume()
        for epoch in range(start.epoch, 2):
            train(acc, m, o, loader, s)
        resumed = acc.get_state_dict(m)
        entry = {"resume_point": [start.epoch, start.step], "lr": o.param_groups[0]["lr"],
                 "files": sorted(os.listdir(os.path.join(path, "deepspeed"))) if acc.is_main_process else None}
        if acc.is_main_process:
            entry.update(_main_only(lambda: {"bitwise": bitwise(resumed, full), "max_diff": max_diff(resumed, full)}))
        out[stage] = entry
    res["resume"] = out


def check_precision(res):
    """bf16 (DeepSpeed's bf16 section): the engine computes in bf16, keeps fp32 masters, and
    get_state_dict gives the fp32 weights; the run follows the fp32 one closely."""
    out = {}
    for stage in (2, 3):
        acc = ds(stage, mixed_precision="bf16")
        model, opt, loader = build(acc, scheduler=False)
        losses, _ = train(acc, model, opt, loader, steps=3)
        weights = acc.get_state_dict(model)
        out[stage] = {"compute": sorted({str(getattr(p, "ds_tensor", p).dtype) for p in model.module.parameters()}),
                      "saved": sorted({str(v.dtype) for v in weights.values()}), "losses": losses,
                      "bf16": model.bfloat16_enabled(), "scaler": acc.scaler is None}
    acc = ds(2)
    model, opt, loader = build(acc, scheduler=False)
    out["fp32_losses"], _ = train(acc, model, opt, loader, steps=3)
    res["precision"] = out


DS_CONFIG = {
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                  "warmup_num_steps": "auto", "warmup_type": "linear"}},
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
}


def check_config_objects(res):
    """An optimizer and a scheduler from the DeepSpeed config (DummyOptim, DummyScheduler), "auto"
    values filled from the prepared objects; they survive a save_state / load_state."""
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=DS_CONFIG))
    ACCELERATORS.append(acc)
    set_seed(1)
    model = Net()
    opt = DummyOptim(model.parameters(), lr=0.02, weight_decay=0.1)
    sched = DummyScheduler(opt, warmup_num_steps=4)
    model, opt, loader, sched = acc.prepare(model, opt, loader_of(8), sched)
    lrs = []
    for x, y in loader:
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()
        lrs.append(sched.get_last_lr()[0])
    config = model.config
    path = acc.save_state(os.path.join(OUT, "config_objects"))
    acc2 = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=DS_CONFIG))
    ACCELERATORS.append(acc2)
    set_seed(1)
    m2 = Net()
    o2 = DummyOptim(m2.parameters(), lr=0.02, weight_decay=0.1)
    m2, o2, _, s2 = acc2.prepare(m2, o2, loader_of(8), DummyScheduler(o2, warmup_num_steps=4))
    acc2.load_state(path)
    w1, w2 = acc.get_state_dict(model), acc2.get_state_dict(m2)
    res["config_objects"] = {
        "optimizer": type(opt.optimizer.optimizer.optimizer).__name__, "lrs": lrs, "loaded_lr": s2.get_last_lr()[0],
        "filled": {k: config[k] for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                           "train_batch_size", "gradient_clipping")},
        "optimizer_params": {k: config["optimizer"]["params"][k] for k in ("lr", "weight_decay")},
        "scheduler_params": config["scheduler"]["params"],
        "steps": [model.global_steps, m2.global_steps], "loaded_equal": bitwise(w1, w2) if acc.is_main_process else None}


def _main_only(compute):
    """What ``compute()`` returns, or {"error": ...}: code run on rank 0 alone must not raise, or
    the other rank would wait in the next collective."""
    try:
        return compute()
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()[-2000:]}


def _engine_and_optimizer_state(acc, model, opt):
    """Full weights and the optimizer's full state (torch's layout), rank 0."""
    return acc.get_state_dict(model), acc.strategy.optimizer_state_dict(opt)


def _same_optimizer_state(a, b):
    """Bitwise equal per-parameter entries (exp_avg, exp_avg_sq, step) and param counts."""
    if sorted(a["state"]) != sorted(b["state"]):
        return f"parameters {sorted(a['state'])} vs {sorted(b['state'])}"
    for i in a["state"]:
        for key, value in a["state"][i].items():
            other = b["state"][i].get(key)
            if not (isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor)
                    and torch.equal(value.float().reshape(-1), other.float().reshape(-1))):
                return f"parameter {i} {key}: {value!r:.80} vs {other!r:.80}"
    return None


def check_cross_engine(res):
    """A save_state written under ZeRO-3 resumes under FSDP2, and the reverse: parameters and
    Adam moments bitwise."""
    fsdp = functools.partial(Accelerator, fsdp_plugin=FullyShardedDataParallelPlugin())
    out = {}
    for source, target in (("zero3", "fsdp"), ("fsdp", "zero3")):
        make = {"zero3": lambda: ds(3), "fsdp": fsdp}
        a = make[source]()
        ACCELERATORS.append(a)
        m, o, loader, s = build(a)
        train(a, m, o, loader, s, steps=3)
        path = a.save_state(os.path.join(OUT, f"{source}_to_{target}"))
        expected = _engine_and_optimizer_state(a, m, o)
        b = make[target]()
        ACCELERATORS.append(b)
        m2, o2, l2, s2 = build(b, seed=7)  # other initial weights: the load must replace them
        from anyaccel.checkpoint import full_states

        conversions, convert = [], full_states.converted  # under FSDP2 rank 0 alone converts (and reads)
        full_states.converted = lambda *args: conversions.append(1) or convert(*args)
        try:
            b.resume(path)  # load_state, and the loader's position in its epoch
        finally:
            full_states.converted = convert
        got = _engine_and_optimizer_state(b, m2, o2)
        entry = {"strategies": [a.strategy.name, b.strategy.name], "position": l2.state_dict().get("position"),
                 "lr": [o.param_groups[0]["lr"], o2.param_groups[0]["lr"]], "conversions": len(conversions)}
        if a.is_main_process:
            entry.update(_main_only(lambda: {
                "weights_bitwise": bitwise(got[0], expected[0]),
                "optimizer_problem": _same_optimizer_state(expected[1], got[1]),
                "optimizer_keys": sorted(expected[1]["state"][0])}))
        # both continue for 1 step on the same batch: the moved state trains on
        x, y = next(iter(loader_of(8, shuffle=False)))
        for acc_, m_, o_ in ((a, m, o), (b, m2, o2)):
            acc_.backward(torch.nn.functional.mse_loss(m_(x), y))
            o_.step()
            o_.zero_grad()
        after = a.get_state_dict(m), b.get_state_dict(m2)
        if a.is_main_process:
            entry.update(_main_only(lambda: {"after_step_max_diff": max_diff(after[1], after[0])}))
        out[f"{source}_to_{target}"] = entry
    res["cross_engine"] = out


def check_transformers(res):
    """ZeRO-3 on a transformers model with tied embeddings: save_model writes one full
    safetensors (the test reloads it with from_pretrained); get_state_dict is the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, zero3_init_flag=False))
    ACCELERATORS.append(acc)
    set_seed(3)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 96, (16, 12), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(ids), batch_size=4)
    model, opt, loader = acc.prepare(model, opt, loader)
    for (batch,) in loader:
        loss = model(input_ids=batch, labels=batch).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    target = os.path.join(OUT, "hf_model")
    acc.save_model(model, target)
    state = acc.get_state_dict(model)
    entry = {"loss": float(loss.detach()), "keys_here": len(state)}
    from transformers.integrations import unset_hf_deepspeed_config

    # every rank: earlier checks' ZeRO-3 accelerators (zero3_init_flag is on by default for stage 3)
    # set transformers' hook, and rank 0 reloads alone below
    unset_hf_deepspeed_config()
    if acc.is_main_process:
        def reload():
            acc.unwrap_model(model).config.save_pretrained(target)
            loaded = LlamaForCausalLM.from_pretrained(target)
            got = loaded.state_dict()
            return {"files": sorted(os.listdir(target)), "tied_in_state": "lm_head.weight" in state,
                    "tied_after_load": loaded.lm_head.weight is loaded.model.embed_tokens.weight,
                    "reloaded_bitwise": sorted(got) == sorted(state) and all(torch.equal(got[k], state[k]) for k in state)}

        entry.update(_main_only(reload))
    res["transformers"] = entry


def _rss_kb(field):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _peak_of(build):
    """Peak resident memory (MiB) above the current one while ``build()`` runs."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # resets VmHWM to the current RSS
    before = _rss_kb("VmRSS")
    result = build()
    return result, (_rss_kb("VmHWM") - before) / 1024


def check_zero3_init(res):
    """zero3_init_flag: a transformers model built after the Accelerator is partitioned as it is
    built (no full copy per process): peak RSS per rank against a plain build."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    def config(hidden=384, layers=10):
        return LlamaConfig(vocab_size=2048, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                           num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8)

    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # no hook of an earlier check: the warm-up build is a plain one on every rank
    AutoModelForCausalLM.from_config(config(64, 1))  # imports transformers' modules first
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True))
    ACCELERATORS.append(acc)
    model, peak_init = _peak_of(lambda: AutoModelForCausalLM.from_config(config()))
    full_bytes = sum(p.ds_numel * p.element_size() for p in model.parameters()) / 2**20
    local_bytes = sum(p.ds_tensor.numel() * p.element_size() for p in model.parameters()) / 2**20
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 2048, (4, 8), generator=torch.Generator().manual_seed(0))
    model, opt = acc.prepare(model, opt)
    loss = model(input_ids=ids, labels=ids).loss
    acc.backward(loss)
    opt.step()
    unset_hf_deepspeed_config()  # the plain build below: a whole model per process
    plain, peak_plain = _peak_of(lambda: AutoModelForCausalLM.from_config(config()))
    res["zero3_init"] = {"peak_mib_zero3_init": peak_init, "peak_mib_plain": peak_plain, "model_mib": full_bytes,
                         "local_param_mib": local_bytes, "loss": float(loss.detach()),
                         "partitioned": all(hasattr(p, "ds_id") for p in model.module.parameters())}


def check_preempt(res):
    """(Named only; its own launch, which a signal ends.) ZeRO-3 trained for 2 epochs uninterrupted
    (the weights kept for check_preempt_resume), then again until the test sends SIGUSR1 to the
    launcher mid-epoch: every rank saves DeepSpeed's checkpoint at the same step, the job exits 75."""
    import gc

    # the uninterrupted run, released before the stopped one starts: an Accelerator alive in the
    # process would answer the stop agreement too (each polls the job's store; see the report)
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3))
    m, o, loader, s = build(acc)
    train(acc, m, o, loader, s, epochs=2)
    full = acc.get_state_dict(m)
    if acc.is_main_process:
        torch.save(full, os.path.join(OUT, "preempt_full.pt"))
    del acc, m, o, loader, s
    gc.collect()
    acc = ds(3, project_config=ProjectConfiguration(project_dir=os.path.join(OUT, "preempt"),
                                                    automatic_checkpoint_naming=True))
    m, o, loader, s = build(acc)
    done = 0
    for _ in range(2):
        for x, y in loader:  # the preemption stops the job at a batch boundary (SystemExit(75))
            acc.backward(torch.nn.functional.mse_loss(m(x), y))
            o.step()
            s.step()
            o.zero_grad()
            done += 1
            if done == 2 and acc.is_main_process:  # the test sends SIGUSR1 to the launcher, as SLURM does
                open(os.path.join(OUT, "preempt_marker"), "w").close()
            if done >= 2:
                time.sleep(0.5)  # a step of real length: the signal arrives during training
    res["preempt"] = {"error": "the job was not stopped by the signal"}


def check_preempt_resume(res):
    """After check_preempt's launch: resume() continues from its checkpoint bitwise like the run
    that was never stopped. Skipped when that launch did not run."""
    project = os.path.join(OUT, "preempt")
    if not os.path.isdir(project):
        res["preempt_resume"] = {"skipped": True}
        return
    acc = ds(3, project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True))
    m, o, loader, s = build(acc)
    start = acc.resume()
    for _ in range(start.epoch, 2):
        train(acc, m, o, loader, s)
    resumed = acc.get_state_dict(m)
    entry = {"resumed_at": [start.epoch, start.step], "checkpoint": os.path.basename(start.checkpoint or "")}
    if acc.is_main_process:
        entry.update(_main_only(lambda: {"bitwise": bitwise(resumed, torch.load(os.path.join(OUT, "preempt_full.pt")))}))
    res["preempt_resume"] = entry


def check_offload(res):
    """ZeRO-2 with the optimizer offloaded to the CPU (DeepSpeed's CPU Adam, JIT-compiled on first
    use: not in the default list) against ZeRO-2 with torch's AdamW, and a bitwise resume."""
    out = {}
    for device in ("none", "cpu"):
        acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, offload_optimizer_device=device))
        ACCELERATORS.append(acc)
        model, opt, loader, sched = build(acc)
        train(acc, model, opt, loader, sched)
        out[device] = {"weights": acc.get_state_dict(model), "optimizer": type(opt.optimizer.optimizer.optimizer).__name__}
    project = os.path.join(OUT, "offload")
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, offload_optimizer_device="cpu"))
    ACCELERATORS.append(acc)
    model, opt, loader, sched = build(acc)
    train(acc, model, opt, loader, sched, steps=2)
    acc.save_state(project)
    acc2 = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, offload_optimizer_device="cpu"))
    ACCELERATORS.append(acc2)
    m2, o2, l2, s2 = build(acc2)
    acc2.resume(project)  # the loader continues after its 2 batches
    train(acc2, m2, o2, l2, s2)
    resumed = acc2.get_state_dict(m2)
    entry = {"optimizers": [out["none"]["optimizer"], out["cpu"]["optimizer"]]}
    if acc.is_main_process:
        entry.update(_main_only(lambda: {"max_diff_vs_torch_adamw": max_diff(out["cpu"]["weights"],
                                                                             out["none"]["weights"]),
                                         "resume_bitwise": bitwise(resumed, out["cpu"]["weights"])}))
    res["offload"] = entry


RESULTS = {}
CHECKS = {name[len("check_"):]: fn for name, fn in list(globals().items()) if name.startswith("check_")}
# JIT-compiles DeepSpeed's CPU Adam (minutes on 2 cores): run only when named (make test-slow)
DEFAULT = [name for name in CHECKS if name not in ("offload", "preempt")]


def main():
    wanted = sys.argv[2:] or DEFAULT
    rank = int(os.environ.get("RANK", "0"))
    res = {}
    for name in wanted:
        try:
            CHECKS[name](res)
        except Exception:  # noqa: BLE001 - reported per check
            res[name] = {"error": traceback.format_exc()[-3000:]}
            print(f"[rank {rank}] check {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    if ACCELERATORS:
        ACCELERATORS[-1].end_training()


if __name__ == "__main__":
    main()
