"""Single-process tests of what Accelerate's example scripts need (issue 29): the DDP hook options,
LocalSGD with one process, the FSDP plugin's state-dict configs, and a one-process DataLoader with
workers that draws exactly what plain PyTorch draws. The 2-process checks are in
tests/compat/test_compat_features_multiprocess.py."""

import random
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from anyaccel import Accelerator, DistributedDataParallelKwargs, FullyShardedDataParallelPlugin, skip_first_batches
from anyaccel.local_sgd import LocalSGD
from anyaccel.strategies.options import DDPOptions
from anyaccel.utils import DDPCommunicationHookType


# ---- DDP communication hooks -------------------------------------------------------------------
def test_comm_hook_options_take_accelerates_enum_and_values_and_stay_out_of_ddps_arguments():
    kwargs = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.POWER_SGD,
                                           comm_wrapper=DDPCommunicationHookType.FP16,
                                           comm_state_option={"matrix_approximation_rank": 2})
    options = kwargs.to_options()
    assert options.comm_hook_spec() == ("power_sgd", "fp16", {"matrix_approximation_rank": 2})
    assert kwargs.to_kwargs() == {} and "comm_hook" not in kwargs.to_dict()  # not DDP constructor arguments
    assert DistributedDataParallelKwargs(comm_hook="FP16").to_options().comm_hook == "fp16"
    assert DDPOptions().comm_hook_spec() is None
    for bad, message in ((dict(comm_hook="int8"), "comm_hook='int8'.*choose one of no, fp16, bf16, power_sgd"),
                         (dict(comm_hook="fp16", comm_wrapper="power_sgd"), "comm_wrapper='power_sgd'.*no, fp16, bf16"),
                         (dict(comm_hook="power_sgd", comm_state_option={"rank": 2}), r"unknown PowerSGDState option.*'rank'"),
                         (dict(comm_hook="power_sgd", comm_state_option=[1]), "must be a dict")):
        with pytest.raises(ValueError, match=message):
            DistributedDataParallelKwargs(**bad)


def test_comm_hook_settings_without_effect_say_so():
    """Accelerate ignores a wrapper without a hook, PowerSGD options for another hook, and a hook
    where DDP does not wrap the model (one process); anyaccel accepts them (the script starts)
    and warns, naming the setting."""
    with pytest.warns(UserWarning, match="comm_wrapper='fp16'.*comm_hook='no': it has no effect"):
        DistributedDataParallelKwargs(comm_wrapper="fp16")
    with pytest.warns(UserWarning, match="configures PowerSGD, but comm_hook='fp16'"):
        DistributedDataParallelKwargs(comm_hook="fp16", comm_state_option={"matrix_approximation_rank": 2})
    with pytest.warns(UserWarning, match="comm_hook='fp16'.*no effect: this job uses the 'single' strategy"):
        Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(comm_hook="fp16")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])


# ---- LocalSGD ----------------------------------------------------------------------------------
def test_local_sgd_with_one_process_is_disabled_and_counts_steps():
    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(2, 1))
    before = [p.detach().clone() for p in model.parameters()]
    with LocalSGD(accelerator=acc, model=model, local_sgd_steps=2) as local_sgd:
        for _ in range(3):
            local_sgd.step()
    assert local_sgd.enabled is False and local_sgd.num_steps == 3
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_local_sgd_refuses_what_it_cannot_average():
    with pytest.warns(UserWarning, match="nothing to shard"):
        acc = Accelerator(cpu=True, strategy="fsdp")
    try:
        with pytest.raises(NotImplementedError, match="distributed_type is FSDP.*strategy='ddp'"):
            LocalSGD(accelerator=acc, model=torch.nn.Linear(2, 1), local_sgd_steps=2)
    finally:
        acc.end_training()
        torch.distributed.destroy_process_group()  # (FSDP's one-process group stays after end_training: a later test makes its own)


# ---- FSDP plugin: state_dict_config / optim_state_dict_config ---------------------------------------
def test_fsdp_state_dict_configs_choose_the_checkpoint_format():
    from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig, LocalStateDictConfig,
                                        ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType)

    full = FullyShardedDataParallelPlugin(state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
                                          optim_state_dict_config=FullOptimStateDictConfig())
    assert full.state_dict_type == "FULL_STATE_DICT" and full.to_options().checkpoint_format == "full"
    assert full.state_dict_config.rank0_only is False  # kept for scripts that read it
    sharded = FullyShardedDataParallelPlugin(state_dict_config=ShardedStateDictConfig(offload_to_cpu=True),
                                             optim_state_dict_config=ShardedOptimStateDictConfig())
    assert sharded.to_options().checkpoint_format == "sharded"
    assert FullyShardedDataParallelPlugin().state_dict_type == "SHARDED_STATE_DICT"
    assert FullyShardedDataParallelPlugin(state_dict_type=StateDictType.FULL_STATE_DICT,
                                          state_dict_config={"offload_to_cpu": True}).state_dict_type == "FULL_STATE_DICT"
    with pytest.raises(ValueError, match="state_dict_type='SHARDED_STATE_DICT', state_dict_config=FullStateDictConfig "
                                         "ask for different checkpoint formats"):
        FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT", state_dict_config=FullStateDictConfig())
    with pytest.raises(ValueError, match="optim_state_dict_config=FullOptimStateDictConfig ask for different"):
        FullyShardedDataParallelPlugin(state_dict_config=ShardedStateDictConfig(),
                                       optim_state_dict_config=FullOptimStateDictConfig())
    with pytest.raises(ValueError, match="FSDP2 has no local state dict; use FullStateDictConfig or Sharded"):
        FullyShardedDataParallelPlugin(state_dict_config=LocalStateDictConfig())
    with pytest.raises(ValueError, match="pass torch.distributed.fsdp's FullStateDictConfig"):
        FullyShardedDataParallelPlugin(state_dict_config="full")


def test_set_state_dict_type_switches_the_format_and_drops_configs_of_the_other_kind():
    """Accelerate's set_state_dict_type (transformers' Trainer calls it before its last save): the
    plugin's format changes; a config object of the other kind would contradict it and goes; a bad
    value names itself; None keeps the type. from_options gives the plugin a strategy amounts to."""
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

    from anyaccel.strategies.options import FSDPOptions

    plugin = FullyShardedDataParallelPlugin(state_dict_config=ShardedStateDictConfig(offload_to_cpu=True),
                                            optim_state_dict_config=ShardedOptimStateDictConfig())
    plugin.set_state_dict_type(None)
    assert plugin.state_dict_type == "SHARDED_STATE_DICT" and plugin.state_dict_config is not None
    plugin.set_state_dict_type(StateDictType.FULL_STATE_DICT)
    assert plugin.state_dict_type == "FULL_STATE_DICT" and plugin.to_options().checkpoint_format == "full"
    assert plugin.state_dict_config is None and plugin.optim_state_dict_config is None
    plugin.set_state_dict_type("sharded_state_dict")
    assert plugin.to_options().checkpoint_format == "sharded"
    with pytest.raises(ValueError, match="state_dict_type='LOCAL'; choose"):
        plugin.set_state_dict_type("LOCAL")
    options = FSDPOptions(transformer_cls_names_to_wrap=("Block",), checkpoint_format="full", cpu_offload=False,
                          reshard_after_forward=False, sync_module_states=False)
    assert FullyShardedDataParallelPlugin.from_options(options).to_options() == options
    with warnings.catch_warnings():  # "nothing to shard" with one process
        warnings.simplefilter("ignore")
        acc = Accelerator(cpu=True, strategy="fsdp")  # no plugin given: Accelerate always has one under FSDP
    try:
        assert acc.state.fsdp_plugin.state_dict_type == "SHARDED_STATE_DICT"
    finally:
        acc.end_training()


# ---- one process reproduces plain PyTorch, DataLoader workers included ------------------------------
class _Crops(Dataset):
    """Randomness drawn in the worker processes (torch, random, numpy), as random crops draw it."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.tensor([float(i), torch.rand(()).item(), random.random(), float(np.random.rand())])


def _epochs(with_anyaccel, generator, persistent, epochs=2):
    torch.manual_seed(42)
    random.seed(42)
    np.random.seed(42)
    loader = DataLoader(_Crops(), batch_size=3, shuffle=True, num_workers=2, persistent_workers=persistent,
                        generator=torch.Generator().manual_seed(7) if generator else None)
    if with_anyaccel:
        loader = Accelerator(cpu=True).prepare(loader)
    out = []
    for _ in range(epochs):
        out += list(loader)
        out.append(torch.rand(1, 4))  # the main process's RNG after the epoch (dropout, init...)
    return torch.cat(out)


@pytest.mark.parametrize("generator,persistent", [(False, False), (True, False), (False, True)])
def test_one_process_with_workers_gives_plain_pytorchs_numbers_bitwise(generator, persistent):
    """Same seed, same DataLoader (shuffle, 2 workers): the order, every value drawn inside the
    workers and the main process's RNG afterwards equal the script without anyaccel, bitwise —
    with the global RNG, with a loader generator, with persistent workers."""
    plain = _epochs(False, generator, persistent)
    ours = _epochs(True, generator, persistent)
    assert torch.equal(plain, ours), (plain - ours).abs().max()


def test_skipped_batches_are_skipped_with_workers():
    """A loader with workers makes iter() of its sampler twice per epoch: skip_first_batches
    (and a resumed position) must hold for the iterator that is read."""
    loader = Accelerator(cpu=True).prepare(DataLoader(list(range(10)), batch_size=2, num_workers=2))
    skip_first_batches(loader, 3)
    assert [b.tolist() for b in loader] == [[6, 7], [8, 9]]
    assert len([b for b in loader]) == 5
