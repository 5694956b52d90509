"""Run with `anyaccel launch --num_processes 2 --cpu`: Accelerate-compatible data and scheduler
semantics. Rank r writes <outdir>/rank<r>.json."""

import json
import os
import sys

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler, TensorDataset

from anyaccel import Accelerator, ShapeMismatchError
from anyaccel.data import DataLoaderConfiguration

out_dir = sys.argv[1]
acc = Accelerator()
r, w = acc.process_index, acc.num_processes
res = {"rank": r, "world": w}


class Stream(IterableDataset):
    """0..n-1; counts how many items this process read."""

    def __init__(self, n):
        self.n, self.reads = n, 0

    def __iter__(self):
        for i in range(self.n):
            self.reads += 1
            yield i


# 1. dispatch_batches (the default for an iterable dataset): rank 0 reads, the others receive
stream = Stream(11)
loader = acc.prepare(DataLoader(stream, batch_size=2))
res["dispatch_batches"] = [b.tolist() for b in loader]
res["dispatch_reads"] = stream.reads
seen = []
for b in loader:
    seen += acc.gather_for_metrics(b).tolist()
res["dispatch_gather_for_metrics"] = seen

# the same stream with every rank reading it: the same batches
every = Accelerator(dispatch_batches=False)
stream2 = Stream(11)
res["every_rank_batches"] = [b.tolist() for b in every.prepare(DataLoader(stream2, batch_size=2))]
res["every_rank_reads"] = stream2.reads

# the same stream dispatched with whole_last_batches: rank 0 pads the last round to whole batches
#    of the stream's first samples (as every rank reading it does) and gather_for_metrics drops them
whole = Accelerator(dataloader_config=DataLoaderConfiguration(whole_last_batches=True))
stream3 = Stream(11)
whole_loader = whole.prepare(DataLoader(stream3, batch_size=2))
res["dispatch_whole"] = [b.tolist() for b in whole_loader]
res["dispatch_whole_reads"] = stream3.reads
res["dispatch_whole_gathered"] = [i for b in whole_loader for i in whole.gather_for_metrics(b).tolist()]
every_whole = Accelerator(dataloader_config=DataLoaderConfiguration(whole_last_batches=True, dispatch_batches=False))
res["every_rank_whole"] = [b.tolist() for b in every_whole.prepare(DataLoader(Stream(11), batch_size=2))]

# 2. iterable resume (bug 3): position 2 -> the next pass continues after it
resumable = acc.prepare(DataLoader(Stream(20), batch_size=2))
it = iter(resumable)
first = [next(it).tolist() for _ in range(2)]
state = resumable.state_dict()
del it
fresh = acc.prepare(DataLoader(Stream(20), batch_size=2))
fresh.load_state_dict(state)
res["iterable_resume"] = {"first": first, "state_position": state["position"],
                          "rest": [b.tolist() for b in fresh], "full": [b.tolist() for b in fresh]}

# 3. split_batches with an iterable dataset: each stream batch is split over the ranks
split = Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True))
res["iterable_split"] = [b.tolist() for b in split.prepare(DataLoader(Stream(8), batch_size=4))]

# 4. batch_size=None with a BatchSampler as sampler (bug 2)
ds = TensorDataset(torch.arange(10))
bn = acc.prepare(DataLoader(ds, sampler=BatchSampler(SequentialSampler(ds), 3, False), batch_size=None))
res["batch_sampler_as_sampler"] = [b[0].tolist() for b in bn]

# 5. the user's generator decides the global order; each rank takes its share of it
def shuffled():
    return DataLoader(TensorDataset(torch.arange(16)), batch_size=2, shuffle=True,
                      generator=torch.Generator().manual_seed(1234))


original = shuffled()
res["original_order"] = [[b[0].tolist() for b in original] for _ in range(2)]
prepared = acc.prepare(shuffled())
res["prepared_order"] = [[b[0].tolist() for b in prepared] for _ in range(2)]

# 6. the scheduler follows the single-process schedule: num_processes steps per optimizer step
def scheduler_steps(accelerator, steps):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    for _ in range(steps):
        accelerator.backward(model(torch.ones(1, 2)).sum())
        opt.step()
        sched.step()
        opt.zero_grad()
    return sched.scheduler.last_epoch


res["sched_default"] = scheduler_steps(acc, 3)
res["sched_split_batches"] = scheduler_steps(split, 3)
res["sched_per_optimizer_step"] = scheduler_steps(Accelerator(step_scheduler_per_process=False), 3)
onecycle_model = torch.nn.Linear(2, 1)
onecycle_opt = torch.optim.SGD(onecycle_model.parameters(), lr=0.1)
onecycle = torch.optim.lr_scheduler.OneCycleLR(onecycle_opt, max_lr=0.1, total_steps=5)
onecycle_model, onecycle_opt, onecycle = acc.prepare(onecycle_model, onecycle_opt, onecycle)
for _ in range(4):  # 8 steps wanted, 5 allowed: never stepped past total_steps (no error)
    onecycle_opt.step()
    onecycle.step()
res["onecycle_steps"] = onecycle.scheduler.last_epoch

# 7. pad_across_processes: a different number of dimensions, or another dimension, raises on every rank
for name, tensor in (("pad_ndim", torch.zeros(2, 3) if r == 0 else torch.zeros(2, 3, 1)),
                     ("pad_other_dim", torch.zeros(r + 1, 3 + r))):
    try:
        acc.pad_across_processes(tensor, dim=0)
        res[name] = "no error"
    except ShapeMismatchError as exc:
        res[name] = str(exc)
res["pad_ok"] = acc.pad_across_processes(torch.ones(r + 1, 2), dim=0).shape[0]

with open(os.path.join(out_dir, f"rank{r}.json"), "w") as fh:
    json.dump(res, fh)
acc.end_training()
