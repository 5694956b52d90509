"""A replica group's training script for the fault-tolerance tests (``tests/fault_tolerance/test_fault_tolerance_multiprocess.py``).

The canonical loop (``resume()`` before it, ``end_training()`` last) on the standard small set-up
of ``train_common`` (MLP with dropout, Adam, StepLR, shuffled loader), over ``EPOCHS`` epochs.
After every step each process appends one JSON line to ``$FT_OUT/group_<g>_rank_<r>.jsonl``: the
group, its rank in the group, its pid, the committed step count, the groups in the step's quorum,
whether the optimizer stepped, the loader position, torchft's quorum id and a SHA-256 of the bytes of every weight it
holds (bitwise comparison across groups: under FSDP2 rank r's shards, which rank r of every group
holds; under tensor parallelism likewise). A ``start`` line records each (re)start and what ``resume()`` returned.

While the group trains without all its peers it sleeps ``FT_ALONE_SLEEP`` seconds per step, so
that a restarted peer (a new interpreter, torch imported again: seconds on a loaded machine)
comes back before training ends. Usage: ``anyaccel launch --fault_tolerance on --num_processes 2
--max_restarts 1 --cpu ft_train.py`` (2 groups of 1 process), or with ``--num_processes 4
--dp_replicate_size 2 --dp_shard_size 2`` (2 groups of 2 processes, FSDP2 inside each), or
``--tp_size 2`` instead of ``--dp_shard_size 2`` (tensor parallel inside each: the MLP's first
layer cut by columns, its last by rows; rank r of every group holds the same shards), or ``--sp_size
2`` with ``FT_MODEL=llama`` (sequence parallel inside each, Ulysses: a transformers Llama with tied
embeddings, each rank of a group a half of every sequence and FSDP2's shard over the group's 2 ranks),
or ``--ep_size 2`` beside ``--dp_shard_size 2`` with ``FT_MODEL=moe`` (expert parallel inside each: a
transformers Qwen3-MoE, each rank of a group 4 of every layer's 8 experts; the ``start`` and ``end``
lines say which, and the bytes its all-to-alls sent to the other rank).

``FT_TOGETHER=n``: end every group n + 5 committed steps after a restarted group healed
(:func:`stop_now`), instead of at the end of ``FT_EPOCHS`` (which then only bounds the time
alone): the checks need a few dozen steps together, not the rest of the epochs. ``FT_OUT`` must be a
fresh directory (as for the records, which are appended to): a ``stop_at`` left there ends the run.

``FT_RAISE_AT=k``: group 1's ``backward`` (each of ``FT_RAISE_GROUPS``'s, default ``1``) raises in step ``k``, once
(not again in a process its launcher restarted), half-way (one gradient
a bucket: its last layers' buckets have left); the script catches it (a ``raised`` line), zeroes the
gradients and goes on to the next batch.

``FT_APART_AT=k`` (with ``FT_RAISE_AT=k``, 3 groups, ``FT_RAISE_GROUPS=1,2``): the groups go apart
after step ``k``, which group 0 commits and groups 1 and 2 vote down. Group 0 then waits,
heartbeating, before its next quorum, until each of the others has committed the step again
without it (their quorum forms after the Lighthouse's join timeout: 2 of the 3 groups it hears
from, more than half) and said so in the file ``$FT_OUT/apart_<group>``; group 0 then says in
``$FT_OUT/asking`` that its request for the next quorum has left, and the others ask 0.3 s later (first, the
two would form their next quorum at once, without group 0: the Lighthouse's fast quorum, all of
the last one's members). All three meet at the same committed count with different weights: the
case the lineage check finds (``anyaccel/fault_tolerance/lineage.py``). (With 2 groups it cannot happen: the Lighthouse
forms no quorum of half the groups it hears from.)

``FT_SAVE_AT=k``: ``save_state()`` (automatic naming, under the group's ``replica_group_<g>``) right after committing
step ``k``, then end. ``FT_WAIT_AT=k`` with ``FT_WAIT_FOR=name``: once, after committing step ``k``, wait
(heartbeating, asking no quorum) until ``$FT_OUT/<name>`` exists before the next step: the test writes it once the
Lighthouse has another group's request (a group resumed from a checkpoint of another history at count ``k``), so
that the two meet at one count (the lineage check's tie). The ``start`` line's ``restored`` is the committed count
read from this group's own checkpoint (None without one), whatever a heal then replaced it with.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))  # train_common

from train_common import build  # noqa: E402

from anyaccel import Accelerator  # noqa: E402

EPOCHS = int(os.environ.get("FT_EPOCHS", "6"))
RAISE_AT = int(os.environ.get("FT_RAISE_AT", "-1"))
APART_AT = int(os.environ.get("FT_APART_AT", "-1"))
RAISE_GROUPS = [int(g) for g in os.environ.get("FT_RAISE_GROUPS", "1").split(",")]
TOGETHER = int(os.environ.get("FT_TOGETHER", "0"))
SAVE_AT = int(os.environ.get("FT_SAVE_AT", "-1"))
WAIT_AT = int(os.environ.get("FT_WAIT_AT", "-1"))


class BackwardRaised(Exception):
    pass


def raise_in_backward(module: torch.nn.Module):
    """Make the next ``backward`` raise when it reaches ``module``'s output (once)."""
    def boom(_grad):
        raise BackwardRaised("raised in backward")

    def forward_hook(_module, _inputs, output):
        handle.remove()
        output.register_hook(boom)

    handle = module.register_forward_hook(forward_hook)


def weights_sha(model: torch.nn.Module) -> str:
    """This process's weights: the whole model, or under FSDP2 its shards (rank r of every group
    holds the same shards)."""
    digest = hashlib.sha256()
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        digest.update(local.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def stop_now(acc: Accelerator, replica, healed_at) -> bool:
    """(FT_TOGETHER=n) Whether to end the training here: n committed steps after a restarted group
    healed in ``resume()`` (``healed_at``: the count it healed to), its rank 0 names a step 5 later in
    ``$FT_OUT/stop_at``, and every rank of every group ends right after committing that step, all at
    one count (the groups commit in lockstep). Until then the epochs bound the run, as without it.
    Checked after every committed step; a rank past the named step (a count skipped) raises instead
    of leaving the others in a collective it does not join."""
    stop_file = os.path.join(os.environ["FT_OUT"], "stop_at")
    if healed_at is not None and acc.process_index == 0 and replica.step >= healed_at + TOGETHER \
            and not os.path.exists(stop_file):
        staged = f"{stop_file}.{os.getpid()}"
        with open(staged, "w") as fh:
            fh.write(str(replica.step + 5))
        try:  # the first writer wins (a second restarted group's rank 0 keeps its value), never read half-written
            os.link(staged, stop_file)
        except FileExistsError:
            pass
        os.unlink(staged)
    if not os.path.exists(stop_file):
        return False
    with open(stop_file) as fh:
        last = int(fh.read())
    if replica.step > last:
        raise SystemExit(f"ft_train: FT_TOGETHER: this rank is at committed step {replica.step}, past the last one "
                         f"named ({last}): the groups would end at different counts")
    return replica.step == last


def experts_held(model: torch.nn.Module):
    """(FT_MODEL=moe) Which experts of each layer this process holds, ``[first, count]`` a layer
    (``[0, 8]`` in one process; ``[0, 4]`` or ``[4, 4]`` under ep_size 2), and the bytes its
    all-to-alls have sent to the other ep rank so far; None for a model without experts."""
    if not (hasattr(model, "model") and hasattr(model.model.layers[0].mlp, "experts")):
        return None
    experts = [layer.mlp.experts for layer in model.model.layers]
    held = [[e.held.start, len(e.held)] if hasattr(e, "held") else [0, e.num_experts] for e in experts]
    return {"held": held, "bytes_sent": sum(e.dispatch_stats.bytes_sent for e in experts if hasattr(e, "dispatch_stats"))}


def rng_sha() -> str:
    """The torch generators' states (dropout draws from the device's): equal in every group that seeded alike."""
    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    if torch.cuda.is_initialized():
        digest.update(torch.cuda.get_rng_state().numpy().tobytes())
    return digest.hexdigest()[:16]


def say_asking(replica) -> None:
    """(FT_APART_AT) Write ``$FT_OUT/asking`` once this group's next quorum request has left (its
    manager's ``start_quorum`` returned: the request is on torchft's quorum thread), not before."""
    manager = replica._manager
    start_quorum = manager.start_quorum

    def then_say(*args, **kwargs):
        manager.start_quorum = start_quorum  # (once)
        start_quorum(*args, **kwargs)
        open(os.path.join(os.environ["FT_OUT"], "asking"), "w").close()

    manager.start_quorum = then_say


def build_language_model(acc, moe=False):
    """(FT_MODEL=llama) A tiny transformers Llama (tied embeddings, SDPA), AdamW, StepLR and a
    shuffled loader of 512 token sequences of 16, prepared: the shapes of a language model's
    script, for sequence parallelism inside a group. ``moe`` (FT_MODEL=moe): a tiny Qwen3-MoE
    instead (8 experts a layer, 2 per token, its load-balancing loss on), for expert parallelism
    inside a group."""
    import transformers
    from torch.utils.data import DataLoader

    from anyaccel import set_seed

    sys.modules.setdefault("torchao", None)  # (transformers would import it: seconds of CPU per process)
    transformers.logging.set_verbosity_error()
    set_seed(0)
    if moe:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
            output_router_logits=True, attn_implementation="sdpa", tie_word_embeddings=True))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            vocab_size=64, max_position_embeddings=64, attn_implementation="sdpa", tie_word_embeddings=True))
    ids = torch.randint(0, 64, (512, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    return acc.prepare(model, opt, DataLoader(data, batch_size=8, shuffle=True), sched)


def main():
    if RAISE_AT >= 0:
        from anyaccel.fault_tolerance import averaging

        averaging.BUCKET_BYTES = averaging.FIRST_BUCKET_BYTES = 1  # buckets leave during backward
    if SAVE_AT >= 0:
        from anyaccel import ProjectConfiguration

        acc = Accelerator(project_config=ProjectConfiguration(automatic_checkpoint_naming=True))
    else:
        acc = Accelerator()
    replica = acc._replica
    group = replica.settings.group
    out = open(os.path.join(os.environ["FT_OUT"], f"group_{group}_rank_{acc.process_index}.jsonl"), "a", buffering=1)
    # the same seed in every group: the same initial weights and the same shuffle order
    config = acc.parallelism_config
    tensor_parallel = config is not None and config.tp_size > 1  # 6 -> 16 cut by columns, 16 -> 1 by rows
    if os.environ.get("FT_MODEL") in ("llama", "moe"):
        model, opt, loader, sched = build_language_model(acc, moe=os.environ["FT_MODEL"] == "moe")
    else:
        model, opt, loader, sched = build(acc, seed=0, n=512, batch_size=8,
                                          tp_plan={"0": "colwise", "3": "rowwise"} if tensor_parallel else None)
    start = acc.resume()

    def record(**fields):
        out.write(json.dumps({"group": group, "rank": acc.process_index, "pid": os.getpid(), "t": time.time(),
                              **fields}) + "\n")

    record(event="start", epoch=start.epoch, step=start.step, resumed=start.checkpoint,
           heals=[vars(h) for h in replica.heals], committed=replica.step, sha=weights_sha(model),
           restored=replica._restored.get("step"),
           device=str(next(model.parameters()).device), visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
           experts=experts_held(acc.unwrap_model(model)))
    alone_sleep = float(os.environ.get("FT_ALONE_SLEEP", "0.5"))
    raised = done = waited = False
    apart = [os.path.join(os.environ["FT_OUT"], f"apart_{g}") for g in RAISE_GROUPS]
    healed_at = replica.step if replica._restarted and replica.heals else None
    # (its steps must each be checked: the raise and apart paths skip to the next batch, and a count with them)
    assert not (TOGETHER and (RAISE_AT >= 0 or APART_AT >= 0)), "FT_TOGETHER goes with neither FT_RAISE_AT nor FT_APART_AT"
    for epoch in range(start.epoch, EPOCHS):
        if done:
            break
        for batch in loader:
            xb, yb = (batch, None) if isinstance(batch, dict) else batch
            if group in RAISE_GROUPS and replica.step + 1 == RAISE_AT and not raised and not replica._restarted:
                raised = True
                raise_in_backward(acc.unwrap_model(model)[2])  # the dropout between the two Linears
            loss = model(**xb).loss if yb is None else torch.nn.functional.mse_loss(model(xb), yb)
            try:
                acc.backward(loss)
            except BackwardRaised:
                record(event="raised", committed=replica.step, uncommitted=replica.uncommitted)
                opt.zero_grad()
                continue
            opt.step()
            sched.step()
            opt.zero_grad()
            record(event="step", committed=replica.step, participants=replica.participants,
                   stepped=not opt.step_was_skipped, epoch=epoch, position=loader.position, sha=weights_sha(model),
                   lr=sched.get_last_lr()[0], rng=rng_sha(), quorum=replica._manager._quorum_id)
            if replica.step == SAVE_AT:
                acc.save_state()
                done = True
                break
            if replica.step == WAIT_AT and not waited:  # (FT_WAIT_AT) until the test says the other group is asking
                waited = True
                go, deadline = os.path.join(os.environ["FT_OUT"], os.environ["FT_WAIT_FOR"]), time.time() + 120
                while not os.path.exists(go) and time.time() < deadline:
                    time.sleep(0.05)
                record(event="waited", committed=replica.step, found=os.path.exists(go))
            if TOGETHER and stop_now(acc, replica, healed_at):
                done = True
                break
            if APART_AT >= 0 and group not in RAISE_GROUPS and replica.step == APART_AT \
                    and not all(map(os.path.exists, apart)):
                deadline = time.time() + 120  # (FT_APART_AT) until the others have taken step APART_AT again apart
                while not all(map(os.path.exists, apart)) and time.time() < deadline:
                    time.sleep(0.05)
                record(event="apart", committed=replica.step, found=all(map(os.path.exists, apart)))
                say_asking(replica)
                continue
            mine = os.path.join(os.environ["FT_OUT"], f"apart_{group}")
            if APART_AT >= 0 and group in RAISE_GROUPS and replica.step == APART_AT \
                    and (replica.participants or 0) < replica.settings.groups and not os.path.exists(mine):
                record(event="apart", committed=replica.step, sha=weights_sha(model))
                open(mine, "w").close()
                asking, deadline = os.path.join(os.environ["FT_OUT"], "asking"), time.time() + 120
                while not os.path.exists(asking) and time.time() < deadline:
                    time.sleep(0.05)
                time.sleep(0.3)  # (group 0's request first; within the Lighthouse's join timeout, 1 s, of it)
                continue
            if (replica.participants or 0) < replica.settings.groups:
                time.sleep(alone_sleep)
    record(event="end", committed=replica.step, sha=weights_sha(model), uncommitted=replica.uncommitted,
           experts=experts_held(acc.unwrap_model(model)))
    acc.end_training()


if __name__ == "__main__":
    main()
