"""Expert parallelism through the ``nd`` strategy (``ParallelismConfig(ep_size=...)``, issue 39 phase 2),
each layout checked against one process training the same model on the same global batch (every
rank computes that reference itself). Run by expert_checks.py in the same launch (4 processes):

* ``nd_ep``: tiny Qwen3-MoE, dp_shard 4 x ep 2 (efsdp 2: the experts FSDP-sharded over the 2
  processes holding the same experts);
* ``nd_hsdp_ep``: tiny Mixtral, dp_replicate 2 x dp_shard 2 x ep 2 (the experts HSDP over replicas);
* ``nd_ep_tp``: tiny Qwen3-MoE with its own tensor-parallel plan, dp_shard 2 x tp 2 x ep 2 (q/k
  norms ``replicated_with_grad_allreduce``, the experts' entries left to ep);
* ``nd_accum_mask``: Qwen3-MoE dp_shard 4 x ep 2 with ``gradient_accumulation_steps=2`` and
  right-padded micro-batches whose real lengths differ per row and per process (the loss:
  ``accelerator.causal_lm_loss`` + the global auxiliary term, the attention mask given);
* ``nd_pp_ep``: a 4-layer Qwen3-MoE at pp 2 x dp_shard 2 x ep 2 through ``pipeline_step``
  (no auxiliary loss: refused under pp);
* ``nd_sp_ep``: Qwen3-MoE with its auxiliary loss at sp 2 x dp_shard 2 x ep 2 (Ulysses; ep over
  the slices of each sequence), right-padded rows; a mask with a hole across the slices refused;
* ``nd_ckpt``: ``save_state`` under ep loaded by FSDP without ep (and the reverse), and
  ``save_model`` loaded by transformers' ``from_pretrained``.

STEPS AdamW steps with clipping; each rank writes OUT/<job>_rank<r>.json.
"""

import copy
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
import rank_results  # tests/scripts: on the job's PYTHONPATH (tests/conftest.py clean_env)

from anyaccel import Accelerator, ParallelismConfig
from anyaccel.strategies.nd.expert import expert_parameters

STEPS, BATCH, SEQ, VOCAB, LR, CLIP = 10, 2, 8, 64, 3e-3, 0.5


def _write(out, job, result):
    rank_results.write(out, job, dist.get_rank(), result)


def _batch(step, rows):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (rows, SEQ), generator=g)


def _routing(model, mesh):
    """Pairs per expert per MoE layer of this step, summed over the processes whose tokens differ."""
    ours = torch.tensor([m.dispatch_stats.tokens_per_expert for _, m in sorted(
        ((n, m) for n, m in model.named_modules() if hasattr(m, "dispatch_stats")), key=lambda x: x[0])])
    dist.all_reduce(ours, group=mesh.group("loss"))
    return ours.tolist()


def _reference_routing(logits, top_k, num_experts):
    return [torch.bincount(torch.topk(torch.softmax(l, -1), top_k, -1).indices.reshape(-1),
                           minlength=num_experts).tolist() for l in logits]


def train(out, job, config, build, top_k, num_experts):
    """``build()`` under ``config`` next to an unsplit copy trained on the global batch; returns the
    accelerator, the prepared model and the reference (for the checkpoint checks)."""
    accelerator = Accelerator(parallelism_config=config)
    model = build()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    mesh = accelerator.strategy.process_mesh
    rank, readers = mesh.rank_in("batch"), mesh.size("batch")
    result = {"losses": [], "ref_losses": [], "aux": [], "ref_aux": [], "norms": [], "ref_norms": [],
              "counts_equal": [], "ep": mesh.size("experts"), "efsdp": mesh.size("efsdp"),
              "ep_rank": accelerator.expert_parallel_rank,
              "expert_numel_local": sum(p.to_local().numel() for _, p in expert_parameters(model)),
              "expert_numel": sum(p.numel() for n, p in reference.named_parameters() if ".experts." in n)}
    for step in range(STEPS):
        batch = _batch(step, readers * BATCH)
        mine = batch[rank * BATCH:(rank + 1) * BATCH]
        outputs = model(input_ids=mine, labels=mine, output_router_logits=True)
        accelerator.backward(outputs.loss)
        result["norms"].append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        ref = reference(input_ids=batch, labels=batch, output_router_logits=True)
        ref.loss.backward()
        result["ref_norms"].append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)))
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        loss = outputs.loss.detach().clone()
        dist.all_reduce(loss, group=mesh.group("loss"))
        result["losses"].append(loss.item() / mesh.size("loss"))
        result["ref_losses"].append(ref.loss.item())
        result["aux"].append(outputs.aux_loss.item())
        result["ref_aux"].append(ref.aux_loss.item())
        result["counts_equal"].append(_routing(model, mesh) == _reference_routing(ref.router_logits, top_k, num_experts))
    _compare_final_weights(accelerator, model, reference, build, result)
    _write(out, job, result)
    return accelerator, model, reference


ACCUM, ACC_STEPS = 2, 5  # nd_accum_mask: 5 optimizer steps of 2 micro-batches each


def _padded(step, micro, rows):
    """A global micro-batch right-padded to SEQ, the real lengths 2..SEQ differing by process (its
    rows' lengths rotate over the processes with the micro-batch): ids, attention mask, labels
    (-100 on padding)."""
    ids = _batch(100 + 10 * step + micro, rows)
    share = rows // BATCH
    lengths = torch.tensor([SEQ - 2 * ((row // BATCH + step + micro) % share) - row % BATCH for row in range(rows)])
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    return ids * mask, mask, ids.masked_fill(mask == 0, -100)


def accumulate_with_padding(out, config, build, top_k, num_experts):
    """``gradient_accumulation_steps=2`` under ``config`` with padded micro-batches whose real lengths
    differ per process (the loss: ``accelerator.causal_lm_loss`` + the auxiliary term, both of the
    global micro-batch), next to one process on the global micro-batches (transformers' loss with
    the attention mask, divided by 2, accumulated); clipping and an AdamW step every 2 micro-batches."""
    accelerator = Accelerator(parallelism_config=config, gradient_accumulation_steps=ACCUM)
    model = build()
    reference = copy.deepcopy(model)
    coef = model.config.router_aux_loss_coef
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    mesh = accelerator.strategy.process_mesh
    rank, readers = mesh.rank_in("batch"), mesh.size("batch")
    result = {"losses": [], "ref_losses": [], "aux": [], "ref_aux": [], "norms": [], "ref_norms": [],
              "counts_equal": [], "tokens": [], "per_rank_mean_losses": [], "synced": []}
    for step in range(ACC_STEPS):
        for micro in range(ACCUM):
            ids, mask, labels = (t[rank * BATCH:(rank + 1) * BATCH] for t in _padded(step, micro, readers * BATCH))
            with accelerator.accumulate(model):
                outputs = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
                loss = accelerator.causal_lm_loss(outputs.logits, labels) + coef * outputs.aux_loss
                accelerator.backward(loss)
                result["synced"].append(accelerator.sync_gradients)
                if accelerator.sync_gradients:
                    result["norms"].append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
                optimizer.step()
                optimizer.zero_grad()
            g_ids, g_mask, g_labels = _padded(step, micro, readers * BATCH)
            ref = reference(input_ids=g_ids, attention_mask=g_mask, labels=g_labels, output_router_logits=True)
            (ref.loss / ACCUM).backward()
            result["losses"].append(loss.item())  # the global micro-batch's, on every process
            result["ref_losses"].append(ref.loss.item())
            result["aux"].append(outputs.aux_loss.item())
            result["ref_aux"].append(ref.aux_loss.item())
            result["tokens"].append(int((labels[:, 1:] != -100).sum()))
            # what a per-process mean (transformers' labels= loss) would report: not the global batch's
            mean = torch.nn.functional.cross_entropy(outputs.logits[:, :-1].reshape(-1, VOCAB).float(),
                                                     labels[:, 1:].reshape(-1)).detach() + coef * outputs.aux_loss
            dist.all_reduce(mean, group=mesh.group("loss"))
            result["per_rank_mean_losses"].append(mean.item() / mesh.size("loss"))
            result["counts_equal"].append(_routing(model, mesh) == _reference_routing(ref.router_logits, top_k,
                                                                                        num_experts))
        result["ref_norms"].append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)))
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    _compare_final_weights(accelerator, model, reference, build, result)
    _write(out, "nd_accum_mask", result)
    return accelerator


def composed(out, job, config, build, data, global_rows, step_fn):
    """``build()`` under ``config`` (pp x ep or sp x ep) fed by a prepared loader of ``data``
    (``global_rows`` rows per step over the data-parallel processes), ``step_fn(accelerator, model,
    batch)`` -> the loss after backward and the auxiliary loss (or None); next to one process on the
    global batches (``reference(**batch)``). STEPS AdamW steps with clipping."""
    accelerator = Accelerator(parallelism_config=config)
    model = build()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    dp = accelerator.parallelism_config.data_parallel_size
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=global_rows // dp))
    result = {"losses": [], "norms": [], "ref_losses": [], "ref_norms": [], "ep_rank": accelerator.expert_parallel_rank,
              "pp_rank": accelerator.pipeline_parallel_rank, "sp_rank": accelerator.sequence_parallel_rank,
              "aux": [], "ref_aux": []}
    for batch in loader:
        loss, aux = step_fn(accelerator, model, batch)
        if aux is not None:
            result["aux"].append(aux.item())
        result["norms"].append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        result["losses"].append(float(accelerator.reduce(loss.detach(), "mean")))
    for batch in DataLoader(data, batch_size=global_rows):
        ref = reference(**batch)
        ref.loss.backward()
        result["ref_norms"].append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)))
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        result["ref_losses"].append(ref.loss.item())
        if getattr(ref, "aux_loss", None) is not None:
            result["ref_aux"].append(ref.aux_loss.item())
    _compare_final_weights(accelerator, model, reference, build, result)
    return accelerator, model, result


def pipeline_with_experts(out, qwen):
    """pp 2 x dp_shard 2 x ep 2 (1F1B, 2 micro-batches): a 4-layer Qwen3-MoE (each stage 2 MoE
    layers) through ``accelerator.pipeline_step``, without the auxiliary loss (refused under pp)."""
    def pipelined(accelerator, model, batch):
        return accelerator.pipeline_step(model, {"input_ids": batch["input_ids"], "labels": batch["labels"]}), None

    ids = _batch(200, STEPS * 8)
    data = [{"input_ids": row, "labels": row} for row in ids]
    config = ParallelismConfig(pp_size=2, dp_shard_size=2, ep_size=2, pp_schedule="1F1B", pp_microbatches=2)
    accelerator, _, result = composed(out, "nd_pp_ep", config, lambda: qwen(num_layers=4), data, 8, pipelined)
    _write(out, "nd_pp_ep", result)
    return accelerator


def sequence_with_experts(out, qwen):
    """sp 2 x dp_shard 2 x ep 2 (ep over the two slices of each sequence): Qwen3-MoE with its
    auxiliary loss (``output_router_logits=True``), 16-token rows, every third right-padded (labels
    -100 there), the model's ``labels=`` loss: the cross entropy of the global batch plus the
    auxiliary term of its router statistics, padding left out, as one process; then a mask with a
    hole across the slice border (each slice right-padded on its own), refused on every rank; a
    ``router_aux_loss_coef`` changed after prepare used by the loss; ``return_dict=False`` refused."""
    def forward(accelerator, model, batch):
        outputs = model(**batch)
        accelerator.backward(outputs.loss)
        return outputs.loss, outputs.aux_loss

    def build():
        model = qwen()
        model.config.output_router_logits = True
        return model

    g = torch.Generator().manual_seed(300)
    ids = torch.randint(0, VOCAB, (STEPS * 4, 2 * SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[::3, -3:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    data = [{"input_ids": i, "labels": lab, "attention_mask": m} for i, lab, m in zip(ids, labels, mask)]
    config = ParallelismConfig(sp_size=2, dp_shard_size=2, ep_size=2)
    accelerator, model, result = composed(out, "nd_sp_ep", config, build, data, 4, forward)
    sp = accelerator.sequence_parallel_rank
    hole = torch.ones(2, SEQ, dtype=torch.long)
    hole[:, -2:] = 0 if sp == 0 else 1  # slice 0 ends in padding, slice 1 has tokens again
    rows = ids[:2, sp * SEQ:(sp + 1) * SEQ]
    try:
        model(input_ids=rows, attention_mask=hole, labels=rows.masked_fill(hole == 0, -100))
    except ValueError as exc:
        result["hole_refused"] = str(exc)
    sliced = next(iter(accelerator.prepare(DataLoader(data[:4], batch_size=2))))
    inner = accelerator.unwrap_model(model)
    with torch.no_grad():  # a coefficient changed after prepare (a schedule): the one the loss uses
        before = model(**sliced)
        inner.router_aux_loss_coef = 0.5
        after = model(**sliced)
        inner.router_aux_loss_coef = 0.02
        result["coef_shift"] = [(after.loss - before.loss).item(), ((0.5 - 0.02) * before.aux_loss).item()]
        try:
            model(**sliced, return_dict=False)
        except ValueError as exc:
            result["tuple_refused"] = str(exc)
    _write(out, "nd_sp_ep", result)
    return accelerator


def _full(accelerator, model):
    return accelerator.get_state_dict(model)


def checkpoints(out, ep_accelerator, ep_model, config, build):
    """save_state under ep -> FSDP without ep -> save_state -> a fresh ep job; save_model ->
    transformers' from_pretrained."""
    result = {}
    trained = _full(ep_accelerator, ep_model)
    ep_dir, plain_dir, export = (os.path.join(out, d) for d in ("state_ep", "state_plain", "export_ep"))
    ep_accelerator.save_state(ep_dir)
    plain = Accelerator(strategy="fsdp")
    plain_model = build()
    plain_model, plain_opt = plain.prepare(plain_model, torch.optim.AdamW(plain_model.parameters(), lr=LR))
    plain.load_state(ep_dir)
    loaded = _full(plain, plain_model)
    plain.save_state(plain_dir)
    again = Accelerator(parallelism_config=config)
    again_model = build()
    again_model, again_opt = again.prepare(again_model, torch.optim.AdamW(again_model.parameters(), lr=LR))
    for p in again_model.parameters():  # what the checkpoint must overwrite
        p.data.to_local().zero_() if hasattr(p.data, "to_local") else p.data.zero_()
    again.load_state(plain_dir)
    back = _full(again, again_model)
    ep_accelerator.save_model(ep_model, export)
    if ep_accelerator.is_main_process:
        result["ep_to_plain_max_diff"] = max(float((loaded[k] - trained[k]).abs().max()) for k in trained)
        result["plain_to_ep_max_diff"] = max(float((back[k] - trained[k]).abs().max()) for k in trained)
        result["optimizer_steps_plain"] = int(next(iter(plain_opt.optimizer.state.values()))["step"])
        inner = ep_accelerator.unwrap_model(ep_model)
        inner.config.save_pretrained(export)
        import transformers

        reloaded = type(inner).from_pretrained(export).state_dict()
        result["from_pretrained_keys_equal"] = sorted(reloaded) == sorted(trained)
        result["from_pretrained_max_diff"] = max(float((reloaded[k] - trained[k]).abs().max()) for k in trained)
        result["transformers"] = transformers.__version__
    _write(out, "nd_ckpt", result)
    return [plain, again]


def main(out, qwen, mixtral):
    """Every job above, in these processes (one Accelerator per layout; the caller ends training)."""
    accelerators = []
    qwen_ep = ParallelismConfig(dp_shard_size=4, ep_size=2)
    accelerator, model, _ = train(out, "nd_ep", qwen_ep, qwen, top_k=2, num_experts=8)
    accelerators.append(accelerator)
    accelerators += checkpoints(out, accelerator, model, qwen_ep, qwen)
    accelerators.append(train(out, "nd_hsdp_ep", ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, ep_size=2),
                              mixtral, top_k=2, num_experts=4)[0])
    accelerators.append(train(out, "nd_ep_tp", ParallelismConfig(dp_shard_size=2, tp_size=2, ep_size=2), qwen,
                              top_k=2, num_experts=8)[0])
    accelerators.append(accumulate_with_padding(out, qwen_ep, qwen, top_k=2, num_experts=8))
    accelerators.append(pipeline_with_experts(out, qwen))
    accelerators.append(sequence_with_experts(out, qwen))
    return accelerators


def _compare_final_weights(accelerator, model, reference, build, result):
    """Collective (``get_state_dict`` gathers): on the main process, record whether the gathered
    weights have the reference's keys, how far they are from them, and how far training moved the
    reference from a fresh ``build()`` (so an equality is not that of two untrained models)."""
    full = accelerator.get_state_dict(model)  # rank 0: the gathered weights
    if accelerator.is_main_process:
        expected = reference.state_dict()
        result["keys_equal"] = sorted(full) == sorted(expected)
        result["weights_max_diff"] = max(float((full[k] - expected[k]).abs().max()) for k in expected)
        result["moved"] = max(float((p.detach() - q).abs().max()) for p, q in zip(
            reference.parameters(), build().parameters()))
