"""Sequence parallelism (Ulysses) on real CPU processes, each job checked against the same training
in one process on the same global batches (rank 0 runs it, in this script).

    anyaccel launch --num_processes 4 --cpu sequence_checks.py OUT four    # the 4-process jobs below
    anyaccel launch --num_processes 8 --cpu sequence_checks.py OUT eight   # sp2 x tp2 x dp_shard2
    python sequence_checks.py OUT one                                      # one process loads the sp checkpoint

(``four`` ends with FSDP2 over the 4 processes, without sp, loading the sp checkpoint too.)

``four`` runs, one after the other in the same processes (one Accelerator each; the process group
is left once, at the end):

* ``sp2dp2``: ``ParallelismConfig(sp_size=2, dp_shard_size=2)``, a transformers Llama with tied
  embeddings and grouped-query attention (4 query heads, 2 key/value heads), SDPA; labels with
  ignored tokens in different numbers per data-parallel rank and right-padded rows with an
  attention mask; clipping; ``save_state`` at the end (the one-process job loads it);
* ``sp2tp2``: ``ParallelismConfig(sp_size=2, tp_size=2)``, an untied Llama with eager attention
  whose 2 key/value heads are 1 per TP rank: each sp rank gets a copy (fewer kv heads than sp ranks);
* ``own``: ``sp_size=2, dp_shard_size=2`` with a model of ours whose attention goes through
  ``SequenceParallelAttention``, tuple batches with ignored prompt tokens, global positions from
  ``accelerator.sequence_parallel_rank`` and ``accelerator.causal_lm_loss``, gradient
  accumulation over 2 micro-batches; ``ddp``: the same under plain DDP over the 4 processes;
* ``errors``: what is refused, with the message: query heads not divisible by sp_size, a model
  without attention to split, left padding;
* ``frozen``: a model with nothing to train (not wrapped by FSDP) prepared twice still runs
  sequence parallel;
* ``moe``: a frozen Qwen3-MoE with its auxiliary loss (sp without ep): loss and aux_loss as one
  process, a coefficient changed after prepare, ``return_dict=False`` refused.

Each rank writes OUT/<job>_rank<r>.json; rank 0 also OUT/<job>.pt (the full weights at the end).
"""

import copy
import os
import sys

import torch
import transformers
import rank_results  # tests/scripts: on the job's PYTHONPATH (tests/conftest.py clean_env)
from torch.utils.data import DataLoader, TensorDataset

from anyaccel import Accelerator, ParallelismConfig, SequenceParallelAttention, set_seed

# No fp8 in this job: hide torchao, which transformers would import when it builds a model (~1 s of CPU per
# process, and "Failed to load" lines); docs/contributing/testing.md. Users' scripts are not touched.
sys.modules.setdefault("torchao", None)

STEPS, BATCH, SEQ, VOCAB, LR, MAX_NORM = 10, 2, 16, 64, 2e-3, 1.0
ACCUMULATE = 2  # the own-model job: micro-batches per optimizer step


def llama(**overrides):
    kwargs = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64, attn_implementation="sdpa")
    kwargs.update(overrides)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))


def lm_samples(n):
    """Token sequences with ignored labels (different counts per sample: the loss must weight tokens,
    not ranks), every third row right-padded (mask 0, labels -100 at the padding)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    labels, mask = ids.clone(), torch.ones_like(ids)
    for i in range(n):
        labels[i, : (i * 3) % 7] = -100  # a prompt whose tokens are not scored
        if i % 3 == 0:
            pad = 2 + i % 4
            mask[i, -pad:], labels[i, -pad:] = 0, -100
    return [{"input_ids": ids[i], "labels": labels[i], "attention_mask": mask[i]} for i in range(n)]


def write(out, name, accelerator, result, state=None):
    rank_results.write(out, name, accelerator.process_index, result)
    if state is not None and accelerator.is_main_process:
        torch.save(state, os.path.join(out, f"{name}.pt"))


def compare(accelerator, model, reference, result):
    """The gathered weights of ``model`` against ``reference``'s (rank 0 only: the full state is there)."""
    state = accelerator.get_state_dict(model)  # collective
    if accelerator.is_main_process:
        expected = reference.state_dict()
        diffs = {k: float((state[k].float() - expected[k]).abs().max()) for k in expected}
        result.update(same_keys=sorted(state) == sorted(expected), max_weight_diff=max(diffs.values()),
                      worst=max(diffs, key=diffs.__getitem__),
                      max_weight_change=max(float((state[k].float() - v).abs().max())
                                            for k, v in result.pop("_initial").items()))
    else:
        result.pop("_initial")
    return state


def llama_job(out, name, config, model_kwargs, clip=False, save=None):
    accelerator = Accelerator(parallelism_config=config)
    dp = accelerator.parallelism_config.data_parallel_size
    set_seed(0)
    model = llama(**model_kwargs)
    reference = copy.deepcopy(model)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    data = lm_samples(STEPS * BATCH * dp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=BATCH))
    losses, norms, shapes = [], [], set()
    for batch in loader:
        shapes.add(tuple(batch["input_ids"].shape))
        out_ = model(**batch)
        accelerator.backward(out_.loss)
        if clip:
            norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out_.loss.item())
    result = {"losses": losses, "norms": norms, "shapes": sorted(shapes), "steps": len(losses), "_initial": initial,
              "sp_rank": accelerator.sequence_parallel_rank, "tp_rank": accelerator.tensor_parallel_rank,
              "mesh": list(accelerator.torch_device_mesh.mesh_dim_names),
              "tied": model.lm_head.weight is model.model.embed_tokens.weight,
              "attention": accelerator.unwrap_model(model).config._attn_implementation}
    if accelerator.is_main_process:  # one process, the global batch of every step
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
        result["ref_losses"], result["ref_norms"] = [], []
        for batch in DataLoader(data, batch_size=BATCH * dp):
            loss = reference(**batch).loss
            loss.backward()
            if clip:
                result["ref_norms"].append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)))
            ref_opt.step()
            ref_opt.zero_grad()
            result["ref_losses"].append(loss.item())
    state = compare(accelerator, model, reference, result)
    if save:
        accelerator.save_state(os.path.join(out, save))
    write(out, name, accelerator, result, state)
    return accelerator, model


class Attention(torch.nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        # no bias: a key bias's true gradient is 0 (softmax ignores a constant per query row), so AdamW
        # turns rounding noise into full-size steps there, in one process as under sp
        self.qkv = torch.nn.Linear(width, 3 * width, bias=False)
        self.proj = torch.nn.Linear(width, width)
        self.attend = SequenceParallelAttention()  # F.scaled_dot_product_attention, (batch, heads, seq, dim)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(self.attend(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, w))


class TinyLM(torch.nn.Module):
    """A causal LM of our own: learned absolute positions, attention through SequenceParallelAttention."""

    def __init__(self, width=32, heads=4, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.pos = torch.nn.Embedding(SEQ, width)
        self.blocks = torch.nn.ModuleList(Attention(width, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, VOCAB)

    def forward(self, tokens, positions):
        h = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def own_job(out, name, accelerator):
    """TinyLM on (tokens, labels) tuples with prompt tokens ignored (-100, different counts per row),
    ``accelerator.causal_lm_loss``, ACCUMULATE micro-batches per step; against one process."""
    dp = accelerator.parallelism_config.data_parallel_size if accelerator.parallelism_config else \
        accelerator.num_processes
    set_seed(0)
    model = TinyLM()
    reference = copy.deepcopy(model)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(0, VOCAB, (STEPS * BATCH * dp, SEQ), generator=torch.Generator().manual_seed(2))
    labels = tokens.clone()
    for i in range(len(labels)):
        labels[i, : (i * 5) % 11] = -100  # a prompt that is not scored
    data = TensorDataset(tokens, labels)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=BATCH))
    losses = []
    for batch, targets in loader:
        local = batch.shape[1]
        positions = torch.arange(local) + accelerator.sequence_parallel_rank * local  # this slice's global positions
        with accelerator.accumulate(model):
            loss = accelerator.causal_lm_loss(model(batch, positions), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    result = {"losses": losses, "_initial": initial, "local_length": local,
              "bound": sum(m.sequence_group is not None for m in accelerator.unwrap_model(model).modules()
                           if isinstance(m, SequenceParallelAttention))}
    if accelerator.is_main_process:
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
        result["ref_losses"] = []
        for i, (batch, targets) in enumerate(DataLoader(data, batch_size=BATCH * dp)):
            logits = reference(batch, torch.arange(SEQ))
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets[:, 1:].reshape(-1))
            (loss / ACCUMULATE).backward()
            if (i + 1) % ACCUMULATE == 0:
                ref_opt.step()
                ref_opt.zero_grad()
            result["ref_losses"].append(loss.item())
    compare(accelerator, model, reference, result)
    write(out, name, accelerator, result)
    return accelerator


def error_of(fn):
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def errors_job(out, accelerator):
    """What is refused, on an accelerator with sp_size=2 (each error is raised on every rank alike)."""
    result = {
        "heads": error_of(lambda: accelerator.prepare(llama(hidden_size=24, num_attention_heads=3,
                                                            num_key_value_heads=3))),
        "no_attention": error_of(lambda: accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4)))),
    }
    left = lm_samples(4)
    for sample in left:  # padding first: left padding (on every data-parallel rank's rows)
        sample["attention_mask"] = (torch.arange(SEQ) >= 3).long()
    loader = accelerator.prepare(DataLoader(left, batch_size=4))
    result["left_padding"] = error_of(lambda: next(iter(loader)))
    write(out, "errors", accelerator, result)


def loaded(out, name, accelerator):
    """``accelerator`` (another layout) loads the checkpoint sp2dp2 saved: the weights it had, gathered."""
    set_seed(0)
    model = llama(tie_word_embeddings=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    loader = DataLoader(lm_samples(STEPS * BATCH * 2), batch_size=BATCH * 2 // accelerator.num_processes)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.load_state(os.path.join(out, "sp_checkpoint"))
    state = accelerator.get_state_dict(model)  # collective; full on rank 0
    result = {"optimizer_steps": sorted({int(s["step"]) for s in optimizer.optimizer.state.values()})}
    if accelerator.is_main_process:
        saved = torch.load(os.path.join(out, "sp2dp2.pt"))
        result.update(same_keys=sorted(saved) == sorted(state),
                      max_diff=max(float((state[k] - saved[k]).abs().max()) for k in saved))
    write(out, name, accelerator, result)
    return accelerator


def frozen_job(out, accelerator):
    """A frozen model (not wrapped: nothing to train) prepared twice still runs sequence parallel:
    its loss on the sliced batches is the one-process loss of the whole global batch."""
    set_seed(0)
    model = llama().requires_grad_(False)
    reference = copy.deepcopy(model)
    model = accelerator.prepare(accelerator.prepare(model))
    data = lm_samples(4)
    loader = accelerator.prepare(DataLoader(data, batch_size=2))
    with torch.no_grad():
        losses = [model(**batch).loss.item() for batch in loader]
        # the loss of the global batch: both data-parallel ranks' 2 samples, token-weighted
        expected = [reference(**next(iter(DataLoader(data, batch_size=4)))).loss.item()]
    write(out, "frozen", accelerator, {"losses": losses, "expected": expected})


def moe_job(out, accelerator):
    """sp without ep: a frozen Qwen3-MoE whose config returns router logits; its ``labels=`` loss and
    ``aux_loss`` on the sliced global batch as one process computes them (the per-slice auxiliary
    term is taken out of the sliced sum and the global one added after the mean, not divided by the
    token count); ``router_aux_loss_coef`` changed after prepare is the one used; ``return_dict=False``
    with router logits refused on every rank. Masks all ones (under sp alone the loader replaces
    right padding by ones, so the router statistics count it: ep_size > 1 leaves it out)."""
    set_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        router_aux_loss_coef=0.02, max_position_embeddings=64, output_router_logits=True)).requires_grad_(False)
    reference = copy.deepcopy(model)
    data = [dict(s, attention_mask=torch.ones(SEQ, dtype=torch.long)) for s in lm_samples(4)]
    model = accelerator.prepare(model)
    batch = next(iter(accelerator.prepare(DataLoader(data, batch_size=2))))
    whole = next(iter(DataLoader(data, batch_size=4)))
    with torch.no_grad():
        got, ref = model(**batch), reference(**whole)
        result = {"loss": got.loss.item(), "aux": got.aux_loss.item(), "ref_loss": ref.loss.item(),
                  "ref_aux": ref.aux_loss.item()}
        accelerator.unwrap_model(model).router_aux_loss_coef = reference.router_aux_loss_coef = 0.5
        result.update(coef_loss=model(**batch).loss.item(), ref_coef_loss=reference(**whole).loss.item())
        result["tuple"] = error_of(lambda: model(**batch, return_dict=False))
    write(out, "moe", accelerator, result)


def one(out):
    """One process loads the checkpoint sp2dp2 saved and holds the weights it had."""
    loaded(out, "one", Accelerator()).end_training()


def main(out, stage):
    accelerators = []
    if stage == "own":
        accelerators.append(own_job(out, "own", Accelerator(
            parallelism_config=ParallelismConfig(sp_size=2, dp_shard_size=2), gradient_accumulation_steps=ACCUMULATE)))
    elif stage == "four":
        first, _ = llama_job(out, "sp2dp2", ParallelismConfig(sp_size=2, dp_shard_size=2),
                             dict(tie_word_embeddings=True), clip=True, save="sp_checkpoint")
        accelerators.append(first)
        accelerators.append(llama_job(out, "sp2tp2", ParallelismConfig(sp_size=2, tp_size=2),
                                      dict(attn_implementation="eager", tie_word_embeddings=False))[0])
        accelerators.append(own_job(out, "own", Accelerator(
            parallelism_config=ParallelismConfig(sp_size=2, dp_shard_size=2), gradient_accumulation_steps=ACCUMULATE)))
        # the same loss helper under plain DDP over the 4: tokens, not processes, carry the weight
        accelerators.append(own_job(out, "ddp", Accelerator(strategy="ddp", gradient_accumulation_steps=ACCUMULATE)))
        errors_job(out, first)
        frozen_job(out, first)
        moe_job(out, first)
        accelerators.append(loaded(out, "fsdp4", Accelerator(strategy="fsdp")))  # FSDP2 over the 4, no sp
    elif stage == "eight":
        accelerators.append(llama_job(out, "sp2tp2dp2", ParallelismConfig(sp_size=2, tp_size=2, dp_shard_size=2),
                                      dict(tie_word_embeddings=False))[0])
    else:
        return one(out)
    for accelerator in reversed(accelerators):  # one process group for the whole stage; the last leaves it
        accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
