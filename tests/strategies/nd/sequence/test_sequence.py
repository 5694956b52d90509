"""Sequence parallelism without processes: ParallelismConfig's sp fields, the head-count rule, and
the loss helpers in one process (where they must equal what transformers and torch compute). The
multi-process behaviour is in tests/strategies/nd/sequence/test_sequence_multiprocess.py."""

import pytest
import torch

from anyaccel import Accelerator, ParallelismConfig, SequenceParallelAttention
from anyaccel.strategies.loss import SequenceGroup, causal_lm_loss, global_token_mean, shift_labels
from anyaccel.strategies.nd.sequence.ulysses import check_heads


@pytest.fixture(autouse=True)
def _no_launcher_sizes(monkeypatch):
    for name in ("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "PARALLELISM_CONFIG_DP_SHARD_SIZE",
                 "PARALLELISM_CONFIG_TP_SIZE", "PARALLELISM_CONFIG_CP_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_sp_backend_takes_anyaccels_name_and_accelerates():
    assert ParallelismConfig(sp_size=2).sp_backend == "ulysses"
    assert ParallelismConfig(sp_size=2, sp_backend="deepspeed").sp_backend == "deepspeed"
    with pytest.raises(ValueError, match=r"^ParallelismConfig.sp_backend has the value 'megatron'; allowed: one of "
                                         r"ulysses, deepspeed$"):
        ParallelismConfig(sp_size=2, sp_backend="megatron")


def test_sp_handler_takes_accelerates_fields_from_an_object_or_a_mapping():
    class DeepSpeedSequenceParallelConfig:  # Accelerate's class, as far as its fields go
        sp_seq_length, sp_seq_length_is_variable, sp_attn_implementation = 32, False, "sdpa"

    config = ParallelismConfig(sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig())
    assert config.sp_handler == {"sp_seq_length": 32, "sp_seq_length_is_variable": False,
                                 "sp_attn_implementation": "sdpa"}
    assert ParallelismConfig(sp_size=2, sp_handler={"sp_attn_implementation": "eager"}).sp_handler[
        "sp_attn_implementation"] == "eager"
    for handler, needle in [
        ({"sp_seq_len": 8}, r"unknown field\(s\) \['sp_seq_len'\]"),
        ({"sp_attn_implementation": "flash_attention_2"}, "runs 'sdpa' or 'eager'"),
        ({"sp_seq_length_is_variable": False}, "sp_seq_length_is_variable=False needs sp_seq_length"),
        ({"sp_seq_length": 9, "sp_seq_length_is_variable": False}, "sp_seq_length=9 is not a multiple of sp_size"),
        (object(), "pass Accelerate's DeepSpeedSequenceParallelConfig or a dict"),
    ]:
        with pytest.raises(ValueError, match=needle):
            ParallelismConfig(sp_size=2, sp_handler=handler)


def test_sequence_and_context_parallel_together_are_refused():
    with pytest.raises(ValueError, match=r"sp_size=2, cp_size=2\): sequence and context parallelism both split"):
        ParallelismConfig(sp_size=2, cp_size=2)


def test_sp_counts_as_non_data_parallel():
    config = ParallelismConfig(sp_size=2, dp_shard_size=2, tp_size=2)
    assert (config.total_size, config.data_parallel_size, config.non_data_parallel_size) == (8, 2, 4)
    with pytest.raises(ValueError, match="sp_size=2 .* = 2 processes, but this job has 4"):
        ParallelismConfig(sp_size=2).for_world_size(4)


def test_head_counts_that_do_not_split_name_themselves():
    check_heads(8, 2, 4)  # kv heads fewer than ranks, ranks a multiple: copies
    check_heads(8, 8, 4)
    with pytest.raises(ValueError, match=r"6 query heads are not divisible by sp_size=4; 6 key/value heads neither "
                                         r"divide nor are divisible by sp_size=4"):
        check_heads(6, 6, 4, where="MyModel")
    with pytest.raises(ValueError, match=r"\(m\): 3 key/value heads neither divide nor"):
        check_heads(12, 3, 2, where="m")


def test_the_loss_helpers_equal_torch_and_transformers_in_one_process():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11, requires_grad=True)
    labels = torch.randint(0, 11, (3, 7))
    labels[0, :3] = -100
    assert shift_labels(labels, None).tolist() == [row[1:] + [-100] for row in labels.tolist()]
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))
    got = causal_lm_loss(logits, labels, None)
    assert torch.allclose(got, expected)
    (g1,) = torch.autograd.grad(got, logits)
    (g2,) = torch.autograd.grad(expected, logits)
    assert torch.allclose(g1, g2)
    summed = torch.tensor(6.0, requires_grad=True)
    mean = global_token_mean(summed, 4, SequenceGroup(None, 1, 0))
    assert mean.item() == 1.5
    mean.backward()
    assert summed.grad.item() == 0.25
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=1, vocab_size=11))
    out = model(input_ids=labels.clamp(min=0), labels=labels)
    assert torch.allclose(causal_lm_loss(out.logits, labels, None), out.loss)


def test_the_accelerator_helpers_in_one_process_and_an_unbound_attention_hook():
    accelerator = Accelerator(cpu=True)
    logits, labels = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1))
    assert torch.allclose(accelerator.causal_lm_loss(logits, labels), expected)
    assert accelerator.global_token_mean(torch.tensor(3.0), torch.tensor(2)).item() == 1.5
    assert accelerator.sequence_parallel_rank == 0
    q = torch.randn(1, 2, 4, 8)
    hook = SequenceParallelAttention()  # not prepared: the kernel as it is
    assert torch.equal(hook(q, q, q, is_causal=True),
                       torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert "not bound" in repr(hook)
    accelerator.end_training()


def test_the_inputs_hook_refuses_what_it_can_alone_before_its_collective():
    """Under sp x ep the prepared transformers model checks a right-padding mask across the slices
    (an all-gather over sp, on each forward with a mask); what it refuses from the call alone (a
    cache, as generate passes; ``num_items_in_batch``) is refused first, so a process that calls it
    alone gets the error instead of waiting in the all-gather (here: no process group at all, so
    the all-gather would raise instead). The model's name is in the labels error (not the name of
    the last cache argument checked)."""
    transformers = pytest.importorskip("transformers")
    from anyaccel.strategies.nd.sequence import transformers as sequence_transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, attn_implementation="sdpa"))
    model.loss_type = "NotCausal"  # only for the labels refusal's message below
    undo = sequence_transformers.install(model, SequenceGroup(None, 2, 0), keep_padding=True)
    try:
        ids, mask = torch.randint(0, 16, (1, 4)), torch.tensor([[1, 1, 0, 0]])
        with pytest.raises(ValueError, match="past_key_values= is not supported"):
            model(input_ids=ids, attention_mask=mask, past_key_values=transformers.DynamicCache())
        with pytest.raises(ValueError, match="LlamaForCausalLM's loss needs the whole sequence"):
            model(input_ids=ids, attention_mask=mask, labels=ids)
    finally:
        undo()
