"""One process of the ``bigmodel`` benchmark (run under torchrun by benchmarks/bigmodel.py).

    torchrun --nproc_per_node N bigmodel_worker.py --method M --checkpoint FILE --width W --layers L --out DIR

Loads a ``L x Linear(W, W)`` model from a safetensors file into FSDP2 shards over N CPU processes,
then runs one training step. Methods:

* ``anyaccel``            init_empty_weights -> prepare (FSDP2) -> load_checkpoint_in_model: each
                          rank reads only its rows of each tensor;
* ``anyaccel-broadcast``  the same with rank 0 reading each tensor and broadcasting it;
* ``raw``                 raw PyTorch: every rank builds the model, reads the whole file,
                          load_state_dict, then fully_shard (a full model per process);
* ``accelerate``          Accelerate's cpu_ram_efficient_loading path: rank 0 reads the whole file,
                          the others build on meta; fully_shard; accelerate.utils.fsdp_utils.
                          fsdp2_load_full_state_dict broadcasts rank 0's tensors.

Each rank writes DIR/rank<r>.json: resident memory before loading, the high-water mark after
(VmHWM), the bytes of parameter shards it holds, load and first-step times.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def hwm() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class Net(torch.nn.Module):
    def __init__(self, width, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _warm_up(acc):
    """Import and initialise what loading touches once (torch._dynamo comes with the first
    optimizer, FSDP and DTensor with the first fully_shard), so the memory and time measured are
    the loading's, not one-off imports (tens of MB, seconds)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    tiny = torch.nn.Linear(8, 8)
    if acc is not None:
        tiny = acc.prepare(tiny)
    else:
        fully_shard(tiny, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    torch.optim.SGD(tiny.parameters(), lr=0.1)
    tiny(torch.zeros(1, 8)).sum().backward()
    import safetensors.torch  # noqa: F401
    from torch.distributed.tensor import _utils  # noqa: F401


def weights_match(model, checkpoint, layers):
    """This rank's rows of every tensor equal the file's (the model is read back, not trusted)."""
    from safetensors import safe_open
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    with safe_open(checkpoint, "pt") as fh, torch.no_grad():
        for name, p in model.named_parameters():
            shape, off = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            if shape[0] and not torch.equal(p.to_local(), fh.get_slice(name)[off[0]:off[0] + shape[0]]):
                return False
    return True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--width", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.method.startswith("anyaccel"):
        from anyaccel import Accelerator
        from anyaccel.big_modeling import init_empty_weights, load_checkpoint_in_model
        from anyaccel.plugins import FullyShardedDataParallelPlugin

        acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    else:
        dist.init_process_group("gloo")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        if a.method == "accelerate":
            from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict
    from safetensors.torch import load_file

    rank = dist.get_rank()
    _warm_up(acc if a.method.startswith("anyaccel") else None)
    dist.barrier()
    before = rss()
    t0 = time.perf_counter()
    if a.method.startswith("anyaccel"):
        with init_empty_weights():
            model = Net(a.width, a.layers)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        load_checkpoint_in_model(model, a.checkpoint, broadcast_from_rank0=a.method == "anyaccel-broadcast")
    elif a.method == "raw":
        model = Net(a.width, a.layers)
        state = load_file(a.checkpoint)
        model.load_state_dict(state)
        del state
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    else:  # accelerate
        class _Acc:  # the one attribute fsdp2_load_full_state_dict reads
            is_main_process = rank == 0

        if rank == 0:
            model = Net(a.width, a.layers)
            state = load_file(a.checkpoint)
            model.load_state_dict(state)
            model = model.to("meta")  # what fsdp2_prepare_model does before sharding
        else:
            with torch.device("meta"):
                model = Net(a.width, a.layers)
            state = {}
        fully_shard(model, mesh=mesh)
        fsdp2_load_full_state_dict(_Acc(), model, state)
        del state
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    dist.barrier()
    t_load = time.perf_counter() - t0
    peak_load = hwm()
    ok = weights_match(model, a.checkpoint, a.layers)  # proof the shards hold the checkpoint's rows
    x = torch.randn(4, a.width)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    dist.barrier()
    t_step = time.perf_counter() - t0
    held = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    res = {"rank": rank, "rss_before": before, "hwm_after_load": peak_load, "hwm_after_step": hwm(),
           "held_param_bytes": held, "load_s": t_load, "first_step_s": t_step, "weights_match": ok}
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as fh:
        json.dump(res, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
