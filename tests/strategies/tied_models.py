"""Models with tied weights and the checks both tie scripts run (ties_checks.py on 2 processes,
ties_nd_checks.py on 4), imported as a sibling module.

* :func:`llama`: a transformers Llama from a tiny config with ``tie_word_embeddings=True`` (as
  Llama-3.2, Qwen3 and Gemma ship): ``lm_head.weight is model.embed_tokens.weight``.
* :class:`TiedNet`: a plain ``torch.nn`` model that ties by assigning one Parameter to two
  modules (``self.head.weight = self.embed.weight``).

:func:`train` runs 4 AdamW steps on one batch every rank sees (so any number of data-parallel
ranks computes what one process does); :func:`report` says, on every rank, whether the tie is one
object after ``unwrap_model``, whether the two full weights are bitwise equal, a checksum of the
weight (compared across ranks by the test), and the largest difference from a reference trained
in one process.
"""

from __future__ import annotations

import hashlib
import sys

import torch

# No fp8 in this job: hide torchao, which transformers would import when it builds a model (~1 s of CPU per
# process, and "Failed to load" lines); docs/contributing/testing.md. Users' scripts are not touched.
sys.modules.setdefault("torchao", None)

VOCAB, WIDTH, STEPS, LR = 64, 32, 4, 1e-2


def llama_config(kv_heads: int = 2):
    import transformers

    return transformers.LlamaConfig(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_attention_heads=4,
                                    num_key_value_heads=kv_heads, num_hidden_layers=2, vocab_size=VOCAB,
                                    max_position_embeddings=32, tie_word_embeddings=True)


def llama(seed: int = 0, kv_heads: int = 2):
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(llama_config(kv_heads))


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 2 * width)
        self.fc2 = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class TiedNet(torch.nn.Module):
    """Token ids -> embedding -> 2 blocks -> a head whose weight is the embedding's."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(2))
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def tied_names(model):
    """(embedding module, head module) of either model."""
    if hasattr(model, "lm_head"):
        return model.model.embed_tokens, model.lm_head
    return model.embed, model.head


def batches(seed: int = 1):
    return torch.randint(0, VOCAB, (STEPS, 4, 16), generator=torch.Generator().manual_seed(seed))


def loss_of(model, ids):
    """Next-token cross entropy (transformers' own for the Llama; a DDP wrapper's module is looked into)."""
    if hasattr(getattr(model, "module", model), "lm_head"):
        return model(input_ids=ids, labels=ids).loss
    logits = model(ids)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def train(model, optimizer, backward=None, data=None):
    """4 AdamW steps on the same batches on every rank; the losses."""
    losses = []
    for ids in batches() if data is None else data:
        loss = loss_of(model, ids)
        (backward or (lambda t: t.backward()))(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR)


def full(t):
    """The whole tensor (collective for a DTensor: every rank must call it)."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def checksum(t) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()[:16]


def report(accelerator, model, reference=None, losses=None, ref_losses=None):
    """What the test asserts for one prepared and trained model, on this rank. Collective (gathers
    the two weights)."""
    inner = accelerator.unwrap_model(model)
    embed, head = tied_names(inner)
    e, h = full(embed.weight), full(head.weight)
    res = {"same_object": head.weight is embed.weight, "bitwise_equal": bool(torch.equal(e, h)),
           "checksum": checksum(e), "parameters": len(list(inner.parameters()))}
    if reference is not None:
        ref_embed, _ = tied_names(reference)
        res["max_diff_from_reference"] = float((e - ref_embed.weight.detach()).abs().max())
    if losses is not None and ref_losses is not None:
        res["max_loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    return res


def reference_run(model):
    """The same 4 steps in one process, without anyaccel: (model, losses)."""
    losses = train(model, adamw(model))
    return model, losses
