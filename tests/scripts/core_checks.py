"""Run under torchrun with 2 processes: checks of the core collectives and data sharding.

Each check appends to a result list; rank r writes <outdir>/rank<r>.json at the end.
"""

import json
import os
import sys
import tempfile

import torch
from torch.utils.data import DataLoader, TensorDataset

from anyaccel import Accelerator, ShapeMismatchError

out_dir = sys.argv[1]
acc = Accelerator()
results = {"rank": acc.process_index, "world": acc.num_processes, "device": str(acc.device),
           "distributed_type": acc.distributed_type.value}


def indices_loader(n, batch, drop_last, shuffle=True):
    ds = TensorDataset(torch.arange(n), torch.arange(n).float().unsqueeze(1))
    return acc.prepare(DataLoader(ds, batch_size=batch, shuffle=shuffle, drop_last=drop_last))


# 1. gather_for_metrics: each sample exactly once, uneven sizes, with and without drop_last
gfm = {}
for n in (37, 40, 5, 1, 9):
    for drop_last in (False, True):
        loader = indices_loader(n, 4, drop_last)
        seen, mine = [], []
        for idx, feat in loader:
            mine += idx.tolist()
            out = acc.gather_for_metrics({"idx": idx, "pair": (feat, idx * 2)})
            assert torch.equal(out["pair"][1], out["idx"] * 2)
            seen += out["idx"].tolist()
        gfm[f"{n}-{drop_last}"] = {"seen": seen, "mine": mine, "len": len(loader)}
results["gather_for_metrics"] = gfm

# 2. objects through gather_for_metrics (strings): also exact
loader = indices_loader(7, 2, False, shuffle=False)
names = []
for idx, _ in loader:
    names += acc.gather_for_metrics([f"s{i}" for i in idx.tolist()])
results["object_metrics"] = names

# 3. shape mismatch: a clear error on every rank, and the group keeps working afterwards
try:
    acc.gather(torch.zeros(acc.process_index + 2, 3))
    results["mismatch"] = "no error"
except ShapeMismatchError as exc:
    results["mismatch"] = str(exc)
try:
    acc.reduce({"a": torch.zeros(2), "b": torch.zeros(acc.process_index + 1)})
    results["mismatch_reduce"] = "no error"
except ShapeMismatchError as exc:
    results["mismatch_reduce"] = str(exc)
results["after_mismatch"] = acc.gather(torch.tensor([acc.process_index])).tolist()

# 4. nested collectives
r = acc.process_index
nested = acc.gather({"a": torch.full((2,), r), "b": (torch.tensor(float(r)), [torch.ones(1, 3) * r])})
results["nested_gather"] = {"a": nested["a"].tolist(), "b0": nested["b"][0].tolist(), "b1": nested["b"][1][0].tolist()}
results["int16_gather"] = acc.gather(torch.tensor([r, -r], dtype=torch.int16)).tolist()
results["int16_dtype"] = str(acc.gather(torch.tensor([r], dtype=torch.int16)).dtype)
results["reduce_sum"] = acc.reduce(torch.tensor([1.0, r]), "sum").tolist()
results["reduce_mean_int"] = acc.reduce(torch.tensor([2, 4 * r]), "mean").tolist()
results["broadcast"] = acc.broadcast({"x": torch.tensor([r + 10.0])}, from_process=1)["x"].tolist()
padded = acc.pad_across_processes(torch.ones(r + 1, 2), dim=0, pad_index=-1)
results["pad"] = padded.tolist()
results["pad_first"] = acc.pad_across_processes(torch.ones(2, r + 1), dim=1, pad_first=True).tolist()
results["gather_object"] = acc.gather_object([f"r{r}"])
results["gather_object_dict"] = acc.gather_object({"rank": r})
with acc.split_between_processes(list(range(5))) as part:
    results["split"] = part
with acc.split_between_processes(torch.arange(5), apply_padding=True) as part:
    results["split_padded"] = part.tolist()

# 5. main_process_first: rank 0 writes, the others read inside the block
marker = os.path.join(out_dir, "marker.txt")
with acc.main_process_first():
    if acc.is_main_process:
        with open(marker, "w") as fh:
            fh.write("ready")
    results["marker_seen"] = os.path.exists(marker)

# 6. mid-epoch evaluation does not disturb the training loader's end-of-data state
train = indices_loader(16, 4, False, shuffle=False)
evalset = indices_loader(6, 4, False, shuffle=False)
flags = []
for step, (idx, _) in enumerate(train):
    if step == 0:
        ev = [acc.gather_for_metrics(i).tolist() for i, _ in evalset]
        results["eval_mid_epoch"] = sum(ev, [])
    flags.append(acc.gradient_state.end_of_dataloader)
results["train_end_flags"] = flags

# 7. a second Accelerator in the same process is consistent and cheap
acc2 = Accelerator()
results["second"] = [acc2.process_index, acc2.num_processes, str(acc2.device)]

# 8. save() from the main process only, atomically
path = os.path.join(out_dir, "obj.pt")
acc.save({"w": torch.ones(2)}, path)
acc.wait_for_everyone()
results["saved"] = torch.load(path)["w"].tolist()
results["leftover_tmp"] = [f for f in os.listdir(out_dir) if f.startswith(".tmp")]

# 9. prepare rejects what it does not know, naming the type
try:
    acc.prepare(object())
    results["prepare_object"] = "accepted"
except TypeError as exc:
    results["prepare_object"] = str(exc)

# 10. check_trigger: a flag raised on one rank is seen by all
if acc.process_index == 1:
    acc.set_trigger()
results["trigger"] = acc.check_trigger()

with open(os.path.join(out_dir, f"rank{acc.process_index}.json"), "w") as fh:
    json.dump(results, fh)
acc.end_training()
