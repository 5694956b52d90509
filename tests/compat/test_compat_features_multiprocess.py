"""The multi-process tests (one real 2-process launch, marked slow) of what Accelerate's example
scripts need (issue 29): DDP communication hooks, LocalSGD, the FSDP plugin's state-dict configs,
DataLoader worker seeds. The single-process ones are in tests/compat/test_compat_features.py.

One launch of tests/compat/compat_features_checks.py runs every check; the tests read its results."""

import pytest

from conftest import launch_checks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch_checks("compat_features_checks.py", tmp_path_factory.mktemp("compat_features"), timeout=420)


@pytest.mark.slow
def test_fp16_hook_all_reduces_half_precision_gradients(ranks):
    """comm_hook=fp16: the gradients are exactly the fp16 all-reduce of each rank's gradient / 2
    (not the fp32 one), within Accelerate's tolerance of it, and the same on both ranks."""
    for r in ranks:
        run = r["hooks"]["fp16"]
        assert run["registered"] == 1
        for step in run["steps"]:
            assert step["equals_cast"] and not step["equals_exact"] and step["close_to_exact"] and step["ranks_agree"]
        plain = r["hooks"]["no"]  # without a hook: DDP's fp32 all-reduce, and nothing registered
        assert plain["registered"] == 0 and all(s["equals_exact"] for s in plain["steps"])


@pytest.mark.slow
def test_power_sgd_hook_compresses_after_its_start_iteration(ranks):
    """comm_hook=power_sgd, rank 1, start_powerSGD_iter=2: two plain all-reduces, then each weight
    gradient is the rank-1 product P Q^T (the exact mean has full rank); the state counted 3
    iterations. With comm_wrapper=fp16 the first steps are fp16 all-reduces."""
    for r in ranks:
        run = r["hooks"]["power_sgd"]
        assert run["powersgd_iter"] == 3
        assert [s["equals_exact"] for s in run["steps"]] == [True, True, False]
        assert run["steps"][2]["weight_ranks"] == [1, 1] and min(run["steps"][2]["exact_weight_ranks"]) > 1
        assert all(s["ranks_agree"] for s in run["steps"])
        wrapped = r["hooks"]["power_sgd+fp16"]
        assert wrapped["powersgd_iter"] == 3
        assert [s["equals_cast"] for s in wrapped["steps"]] == [True, True, False]


@pytest.mark.slow
def test_hooks_torch_cannot_run_here_are_refused_at_prepare_naming_the_alternative(ranks):
    """bf16 (torch: CUDA + NCCL or XPU only) and batched_power_sgd (torch 2.13 fails at the
    first compressed step) stop at prepare with one line naming what works instead."""
    for r in ranks:
        assert "use 'fp16'" in r["hooks"]["bf16"]["error"]
        assert "use comm_hook='power_sgd'" in r["hooks"]["batched_power_sgd"]["error"]


@pytest.mark.slow
def test_local_sgd_matches_a_hand_written_loop_bitwise(ranks):
    """LocalSGD(local_sgd_steps=3) over 7 steps under DDP: parameters differ between ranks after
    local steps, agree after steps 3 and 6 and after the block, and equal bitwise those of plain
    DDP under no_sync with an all-reduce / world size every 3 steps and at the end (same
    element-wise operations on 2 ranks, so bitwise; see the Accelerate guide for more ranks).
    enabled=False: DDP all-reduces every step, as the plain loop does."""
    for r in ranks:
        run = r["local_sgd"]
        assert run["enabled"] and run["num_steps"] == 7
        assert run["agree_during"] == [False, False, True, False, False, True, False]
        assert run["agree_after"] and run["equals_hand_written"] and run["max_diff"] == 0.0
        off = r["local_sgd_disabled"]
        assert not off["enabled"] and all(off["agree_during"]) and off["equals_hand_written"]


@pytest.mark.slow
def test_dataloader_workers_of_every_rank_get_the_base_seed_one_plain_process_draws(ranks):
    """With 2 processes, num_workers=2: each rank's workers are seeded base + worker id with the
    base seed plain torch draws after the same manual_seed (rank 0's generator state is shared,
    as Accelerate shares it), while the ranks see disjoint samples."""
    for r in ranks:
        seeds = r["worker_seeds"]
        assert seeds["base_seeds"] == [seeds["expected_base_seed"]]
    assert sorted(ranks[0]["worker_seeds"]["samples"] + ranks[1]["worker_seeds"]["samples"]) == list(range(8))


@pytest.mark.slow
def test_fsdp_plugin_full_state_dict_config_writes_full_checkpoints(ranks):
    """The fsdp_with_peak_mem_tracking example's FullyShardedDataParallelPlugin(state_dict_config=
    FullStateDictConfig(...), optim_state_dict_config=FullOptimStateDictConfig(...)) runs FSDP2
    and save_state writes one full model file and one optimizer file (rank 0), not shards."""
    for r in ranks:
        assert r["fsdp"]["distributed_type"] == "FSDP" and r["fsdp"]["checkpoint_format"] == "full"
        assert r["fsdp"]["plugin_state_dict_type"] == "FULL_STATE_DICT"
        assert {"model.safetensors", "optimizer.bin"} <= set(r["fsdp"]["files"])
        assert not any(name.startswith("sharded") for name in r["fsdp"]["files"])
