"""Tied parameters (anyaccel/strategies/ties.py): found, kept in one FSDP2 unit, re-tied after
tensor parallelism or refused naming both, stored once. One process; the multi-process checks
(every strategy, real launches) are tests/strategies/test_ties_multiprocess.py."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from anyaccel.strategies.fsdp import ties
from conftest import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
_TORCHAO = sys.modules.get("torchao", False)
import tied_models  # noqa: E402 - a sibling module of the tie scripts

if _TORCHAO is False and sys.modules.get("torchao", False) is None:
    # tied_models hides torchao for its worker processes, not for this one: collected before
    # tests/training/, it would skip the fp8 tests of the whole pytest process
    del sys.modules["torchao"]


def TiedNet():  # noqa: N802 - stands where the class stood
    """The multi-process tie checks' plain model (tests/strategies/tied_models.py), at unit-test sizes."""
    return tied_models.TiedNet(vocab=16, width=8)


class Outer(torch.nn.Module):
    """Both users of the tie inside one block (``inner``), which is itself inside the root."""

    def __init__(self):
        super().__init__()
        self.inner = TiedNet()
        self.out = torch.nn.Linear(16, 1)

    def forward(self, ids):
        return self.out(self.inner(ids))


def test_a_tie_is_two_slots_holding_one_parameter_and_a_shared_module_is_not_one():
    (tie,) = ties.find_ties(TiedNet())
    assert tie.names == ("embed.weight", "head.weight") and tie.kept()
    shared = torch.nn.Linear(2, 2)
    twice = torch.nn.ModuleDict({"a": shared, "b": shared})  # one module under two names: one slot
    assert ties.find_ties(twice) == [] and ties.find_ties(torch.nn.Linear(2, 2)) == []


def test_units_that_would_split_a_tie_are_not_made_and_the_user_is_told():
    model = TiedNet()
    blocks = [model.embed, model.blocks[0], model.blocks[1], model.head]
    with pytest.warns(UserWarning, match=r"embed.weight and head.weight are one parameter \(tied weights\); the wrap "
                                         r"policy made embed, head units of their own, which would shard it twice: they are sharded with the root "
                                         r"instead"):
        kept = ties.units_keeping_ties(model, blocks)
    assert kept == [model.blocks[0], model.blocks[1]]
    # both users inside one block: that block owns the tie and stays a unit; the ones inside it go
    outer = Outer()
    inner = outer.inner
    with pytest.warns(UserWarning, match=r"made inner.embed, inner.head units of their own.*sharded with unit inner "
                                         r"instead"):
        kept = ties.units_keeping_ties(outer, [inner.embed, inner.blocks[0], inner.head, inner])
    assert kept == [inner.blocks[0], inner]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to change: no warning
        assert ties.units_keeping_ties(model, [model.blocks[0]]) == [model.blocks[0]]
        assert ties.units_keeping_ties(model, [model.blocks[0]], warn=False) == [model.blocks[0]]


def test_a_tie_replaced_by_two_equal_parameters_is_restored_else_refused_naming_both():
    model = TiedNet()
    tied = ties.find_ties(model)
    model.head.weight = torch.nn.Parameter(model.embed.weight.detach().clone())  # what TP does, module by module
    assert not tied[0].kept()
    ties.restore(tied, "the tensor-parallel plan")
    assert model.head.weight is model.embed.weight
    model.head.weight = torch.nn.Parameter(model.embed.weight.detach() + 1)
    with pytest.raises(ValueError, match=r"embed.weight and head.weight are one parameter \(tied weights\), but the "
                                         r"tensor-parallel plan made them two parameters \(they hold different values"):
        ties.restore(tied, "the tensor-parallel plan")
    with pytest.raises(RuntimeError, match=r"FSDP2 untied embed.weight and head.weight"):
        ties.check_kept(tied, "FSDP2")


def test_tensor_parallel_styles_that_cut_the_weight_differently_are_refused(group_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    same = TiedNet()
    tied = ties.find_ties(same)
    parallelize_module(same, mesh, {"embed": RowwiseParallel(input_layouts=Replicate()),
                                    "head": ColwiseParallel(output_layouts=Replicate())})
    assert not tied[0].kept()  # parallelize_module made two DTensors
    ties.restore(tied, "the tensor-parallel plan")  # both Shard(0): one DTensor again
    assert same.head.weight is same.embed.weight and type(same.head.weight).__name__ == "DTensor"
    assert same(torch.tensor([[1, 2, 3]])).shape == (1, 3, 16)
    other = TiedNet()
    tied = ties.find_ties(other)
    parallelize_module(other, mesh, {"embed": ColwiseParallel(), "head": ColwiseParallel()})
    with pytest.raises(ValueError, match=r"sharded differently\): embed.weight became a DTensor \(16, 8\) "
                                         r"\[Shard\(dim=1\)\] on mesh dims \['tp'\], head.weight a DTensor \(16, 8\) "
                                         r"\[Shard\(dim=0\)\]"):
        ties.restore(tied, "the tensor-parallel plan")
    alone = TiedNet()
    tied = ties.find_ties(alone)
    parallelize_module(alone, mesh, {"head": ColwiseParallel()})
    with pytest.raises(ValueError, match=r"one is sharded and the other is not\): embed.weight became a plain tensor"):
        ties.restore(tied, "the tensor-parallel plan")


def test_a_gathered_state_dict_holds_one_tensor_per_tie():
    model = TiedNet()
    state = {k: v.clone() for k, v in model.state_dict().items()}  # what gathering shards gives: copies
    assert state["head.weight"] is not state["embed.weight"]
    assert ties.share_tied_entries(model, state) is state and state["head.weight"] is state["embed.weight"]
    assert ties.share_tied_entries(model, {}) == {}  # ranks other than 0 receive nothing


def test_fsdp_in_one_process_keeps_a_tie_its_policy_would_split(group_of_one):
    from anyaccel import Accelerator
    from anyaccel.plugins import FullyShardedDataParallelPlugin

    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(
        transformer_cls_names_to_wrap=["Block", "Embedding"]))
    try:
        with pytest.warns(UserWarning, match="tied weights"):
            model = accelerator.prepare(TiedNet())
        inner = accelerator.unwrap_model(model)
        assert inner.head.weight is inner.embed.weight and type(inner.embed.weight).__name__ == "DTensor"
        model(torch.tensor([[1, 2, 3]])).sum().backward()
        state = accelerator.get_state_dict(model)
        assert state["head.weight"] is state["embed.weight"]
    finally:
        accelerator.end_training()


@pytest.mark.torch_versions  # a private DTensor helper (sharded_load.local_index): run on torch 2.9 too
def test_a_meta_model_keeps_its_tie_and_is_filled_once_like_an_eager_build(group_of_one):
    """init_empty_weights keeps a tie made by assignment; FSDP2 fills the tied shard from its first
    user's initialisation only (the head still draws its numbers, as an eager build does), so the
    model equals the eager build bit for bit."""
    from anyaccel import Accelerator, init_empty_weights

    torch.manual_seed(3)
    eager = TiedNet()
    torch.manual_seed(3)
    with init_empty_weights():
        empty = TiedNet()
    assert empty.head.weight is empty.embed.weight and empty.embed.weight.is_meta
    accelerator = Accelerator(cpu=True, strategy="fsdp")
    try:
        model = accelerator.prepare(empty)
        inner = accelerator.unwrap_model(model)
        assert inner.head.weight is inner.embed.weight
        full = {k: v.full_tensor() for k, v in inner.state_dict().items()}
        assert all(torch.equal(full[k], v) for k, v in eager.state_dict().items())
    finally:
        accelerator.end_training()


def test_without_data_parallelism_nd_leaves_the_policy_units_alone():
    """One process under the nd strategy: nothing is sharded, so a policy that would split the tie
    changes nothing and says nothing (its blocks only carry activation checkpointing)."""
    from anyaccel import Accelerator, ParallelismConfig
    from anyaccel.strategies.options import FSDPOptions

    policy = FSDPOptions(transformer_cls_names_to_wrap=("Block", "Embedding"), activation_checkpointing=True)
    accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig(fsdp=policy))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = accelerator.prepare(TiedNet())
        assert not [w for w in caught if "tied weights" in str(w.message)]
        inner = accelerator.unwrap_model(model)
        assert inner.head.weight is inner.embed.weight
        assert "forward" in vars(inner.embed)  # the Embedding block kept its activation checkpointing
    finally:
        accelerator.end_training()


@pytest.fixture
def group_of_one():
    """A default process group of one for the test (none is left behind)."""
    import torch.distributed as dist

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if made and dist.is_initialized():
        dist.destroy_process_group()
