"""Run on 2 processes (tests/accelerator: forked by the suite's warm launcher; torchrun or anyaccel launch work the same): checks of the core collectives and data sharding.

Each check appends to a result list; rank r writes <outdir>/rank<r>.json at the end. Then
tests/accelerator/ddp_equivalence.py's training with batch 4 runs in this job (<outdir>/two.pt).
"""

import json
import os
import sys

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

# 11. the fused gather: many leaves (more than the header has room for), every dtype, uneven
#     sizes -- compared with one plain all_gather per leaf
import torch.distributed as dist  # noqa: E402

from anyaccel import ops  # noqa: E402

dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64]
leaves = {str(d): (torch.arange(6 * (r + 1)).reshape(-1, 3) % 5 + r).to(d) for d in dtypes}
leaves["scalar"] = torch.tensor(float(r))
leaves["wide"] = torch.full((r + 1, 2, 2), float(r))
got = ops.gather_uneven(leaves)
fused_ok = {}
for k, t in leaves.items():
    t1 = t.unsqueeze(0) if t.dim() == 0 else t
    sizes = [None, None]
    dist.all_gather_object(sizes, t1.shape[0])
    parts = [torch.zeros((n,) + tuple(t1.shape[1:]), dtype=t1.dtype) for n in sizes]
    padded = [torch.zeros((max(sizes),) + tuple(t1.shape[1:]), dtype=t1.dtype) for _ in sizes]
    mine = torch.cat([t1, torch.zeros((max(sizes) - t1.shape[0],) + tuple(t1.shape[1:]), dtype=t1.dtype)])
    dist.all_gather_object(padded, mine)  # objects: works for every dtype on gloo
    expected = torch.cat([p[:n] for p, n in zip(padded, sizes)])
    fused_ok[k] = bool(got[k].dtype == expected.dtype and torch.equal(got[k], expected))
results["fused_gather"] = fused_ok
same = {"a": torch.arange(4.0) + r * 4, "b": (torch.arange(4) + r * 4).to(torch.int16)}  # fused, equal sizes
got_same = ops.gather(same)
results["fused_gather_equal"] = {"a": bool(torch.equal(got_same["a"], torch.arange(8.0))),
                                 "b": bool(torch.equal(got_same["b"], torch.arange(8, dtype=torch.int16)))}

# 11b. small gathers travel with their shape header: one collective per call once the group has
#      seen the size, with the same results for every dtype, for sizes that grow, shrink, differ
#      between ranks or are empty; a rank in another collective then still raises on both
calls = {"n": 0}
# torch 2.13 names it all_gather_single (anyaccel's transport prefers it); torch 2.9 has only
# all_gather_into_tensor: count whichever the transport calls
_GATHER_NAME = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_real_all_gather = getattr(dist, _GATHER_NAME)


def _counted(*args, **kwargs):
    calls["n"] += 1
    return _real_all_gather(*args, **kwargs)


setattr(dist, _GATHER_NAME, _counted)
plan = [(3, 3), (3, 3), (2, 1), (0, 2), (5, 5), (5, 5), (1, 0), (4, 4)]  # rows per rank, per call
carried = {"same": True, "collectives": []}
wide_dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int16, torch.int8, torch.bool,
               torch.complex128] + [getattr(torch, n) for n in ("uint16", "uint32") if hasattr(torch, n)]  # <= 11 leaves
for call, rows in enumerate(plan):
    data = {str(d): ((torch.arange(rows[r] * 3).reshape(-1, 3) + 7 * call + 100 * r) % 50).to(d) for d in wide_dtypes}
    before = calls["n"]
    got = ops.gather_uneven(data)
    carried["collectives"].append(calls["n"] - before)
    for k, t in data.items():  # the reference travels as raw bytes (uint16/uint32 tensors do not unpickle)
        parts = [None, None]
        dist.all_gather_object(parts, t.contiguous().view(torch.uint8).numpy().tobytes())
        expected = torch.cat([torch.frombuffer(bytearray(b), dtype=torch.uint8).view(t.dtype).reshape(-1, 3)
                              if b else t.new_zeros((0, 3)) for b in parts])
        carried["same"] &= bool(got[k].dtype == t.dtype and torch.equal(got[k], expected))
for _ in range(2):
    before = calls["n"]
    ops.gather(torch.full((4,), float(r)))
    carried["collectives"].append(calls["n"] - before)
setattr(dist, _GATHER_NAME, _real_all_gather)
try:
    if r == 0:
        ops.gather(torch.full((4,), float(r)))
    else:
        acc.wait_for_everyone()
    carried["mismatch"] = "no error"
except ShapeMismatchError as exc:
    carried["mismatch"] = str(exc)
results["carried_gather"] = carried

# 12. ranks in different collectives at the same point: an error naming both, not a hang
try:
    if r == 0:
        acc.gather(torch.zeros(3))
    else:
        acc.reduce(torch.zeros(3))
    results["op_mismatch"] = "no error"
except ShapeMismatchError as exc:
    results["op_mismatch"] = str(exc)
results["after_op_mismatch"] = acc.reduce(torch.tensor([1.0]), "sum").tolist()

# 13. pad_across_processes: only the padded dimension may differ
try:
    acc.pad_across_processes(torch.zeros(2, r + 2), dim=0)
    results["pad_mismatch"] = "no error"
except ShapeMismatchError as exc:
    results["pad_mismatch"] = str(exc)
results["reduce_max_min"] = [acc.reduce(torch.tensor([float(r)]), "max").tolist(),
                             acc.reduce(torch.tensor([float(r)]), "min").tolist()]

# 14. even_batches=False: the last batches stay uneven (Accelerate's example: 3 samples, batch 1)
uneven = Accelerator(even_batches=False)
ds3 = TensorDataset(torch.arange(3))
results["uneven_batches"] = [b[0].tolist() for b in uneven.prepare(DataLoader(ds3, batch_size=1))]
loader7 = uneven.prepare(DataLoader(TensorDataset(torch.arange(7)), batch_size=2))  # 2 batches each, 2+2 / 2+1
seen7 = []
for (i7,) in loader7:
    seen7 += uneven.gather_for_metrics(i7).tolist()
results["uneven_gather_for_metrics"] = seen7
results["uneven_len"] = [len(uneven.prepare(DataLoader(ds3, batch_size=1))), len(loader7)]

# 15. save_state with a different directory on each rank (each its own temporary directory, as
#     Accelerate's test_distributed_data_loop does): under DDP each writes a whole checkpoint there,
#     and load_state with each rank's own directory restores it
model_s = acc.prepare(torch.nn.Linear(2, 2))
own = os.path.join(out_dir, f"ckpt_rank{r}")
try:
    acc.save_state(own)
    saved_weight = acc.unwrap_model(model_s).weight.detach().clone()
    with torch.no_grad():
        acc.unwrap_model(model_s).weight.add_(1.0)
    acc.load_state(own)
    results["save_dirs"] = {"files": sorted(os.listdir(own)),
                            "restored": bool(torch.equal(acc.unwrap_model(model_s).weight, saved_weight))}
except Exception as exc:  # noqa: BLE001
    results["save_dirs"] = f"{type(exc).__name__}: {exc}"

# 16. a directory per process: the directories loaded must hold one checkpoint (DDP replicas would
#     diverge); two paths to one directory (a symlink) write it once; two paths that do not resolve
#     alike (as two machines' mounts of one share) are caught by the writers' stamps
acc16 = Accelerator()
m16 = torch.nn.Linear(1, 1)
o16 = torch.optim.SGD(m16.parameters(), lr=0.1)
m16, o16, l16 = acc16.prepare(m16, o16, DataLoader(torch.arange(16).float().unsqueeze(1), batch_size=2))


def train16(steps):
    for i, x in enumerate(l16):
        acc16.backward(m16(x).sum())
        o16.step()
        o16.zero_grad()
        if i + 1 == steps:
            break


def attempt(call):
    try:
        call()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - every rank must raise, none may wait
        return f"{type(exc).__name__}: {exc}"


train16(1)
acc16.save_state(os.path.join(out_dir, f"a_{r}"))
train16(3)
acc16.save_state(os.path.join(out_dir, f"b_{r}"))
checks16 = {"mixed": attempt(lambda: acc16.load_state(os.path.join(out_dir, "a_0" if r == 0 else "b_1")))}
checks16["own"] = attempt(lambda: acc16.load_state(os.path.join(out_dir, f"a_{r}")))
checks16["own_weights"] = acc16.gather(acc16.unwrap_model(m16).weight.detach().reshape(1)).tolist()
real, link = os.path.join(out_dir, "real16"), os.path.join(out_dir, "link16")
if r == 0:
    os.makedirs(real)
    os.symlink(real, link)
acc16.wait_for_everyone()
checks16["symlink_save"] = attempt(lambda: acc16.save_state(os.path.join(real if r == 0 else link, "ck")))
checks16["symlink_files"] = sorted(os.listdir(os.path.join(real, "ck"))) if r == 0 else None
checks16["symlink_load"] = attempt(lambda: acc16.load_state(os.path.join(real if r == 0 else link, "ck")))
realpath = os.path.realpath
if r == 1:  # as on another machine: this path does not resolve to process 0's, yet names its directory
    os.path.realpath = lambda path, *args, **kwargs: os.path.abspath(path)
checks16["alias_save"] = attempt(lambda: acc16.save_state(os.path.join(real if r == 0 else link, "ck2")))
os.path.realpath = realpath
acc16.wait_for_everyone()
checks16["alias_left"] = sorted(os.listdir(real)) if r == 0 else None
results["own_directories"] = checks16

with open(os.path.join(out_dir, f"rank{acc.process_index}.json"), "w") as fh:
    json.dump(results, fh)
acc.end_training()

# last: 2 processes with batch 4 each, to compare with one process with batch 8 (the test runs that
# one); its own Accelerator on the group end_training() kept, in this job instead of a launch of its own
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddp_equivalence  # noqa: E402

ddp_equivalence.main(os.path.join(out_dir, "two.pt"), 4)
