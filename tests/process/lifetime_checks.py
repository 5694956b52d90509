"""Run with 2 processes (anyaccel launch --num_processes 2 --cpu lifetime_checks.py OUT): what a
process's groups, accelerators and forks do over its life (tests/process/test_lifetime_multiprocess.py).

Everything inside ``main()``, as users write it: an Accelerator trains and ends; a second one
trains again in the same process (the group is the same object); the group is left as
Accelerate's scripts leave it (``PartialState().destroy_process_group()``) and a third
Accelerator joins a new one and trains; DataLoader workers and a plain ``os.fork`` child report
what they inherited. Each rank writes OUT/rank<r>.json.
"""

import ctypes
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, TensorDataset

from anyaccel import Accelerator, PartialState, process_group


def _prctl_get_pdeathsig() -> int:
    value = ctypes.c_int(-1)
    ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(value), 0, 0, 0)  # PR_GET_PDEATHSIG
    return value.value


class Inherited(Dataset):
    """Each item: what the DataLoader worker that made it inherited from its rank."""

    def __init__(self, parent: int):
        self.parent = parent

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        from anyaccel import doctor

        return torch.tensor([_prctl_get_pdeathsig(), int(doctor.current() is None), int(os.getppid() == self.parent),
                             os.getpid()])


def train(acc: Accelerator, seed: int) -> float:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    model, opt, loader = acc.prepare(model, opt, loader)
    loss = torch.zeros(())
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    return float(acc.reduce(loss.detach(), "mean"))


def fork_child_report() -> dict:
    """A plain os.fork child (the at-fork hooks run): what it inherited, sent back through a pipe."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        from anyaccel import doctor

        os.close(read_end)
        os.write(write_end, json.dumps({"pdeathsig": _prctl_get_pdeathsig(),
                                        "doctor_forgotten": doctor.current() is None}).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        report = json.loads(f.read())
    os.waitpid(pid, 0)
    return report


def main() -> None:
    out = sys.argv[1]
    r: dict = {}
    first = Accelerator()
    rank = first.process_index
    group = dist.group.WORLD
    r["first_loss"] = train(first, 0)
    first.end_training()
    r["group_kept_after_end_training"] = dist.is_initialized() and dist.group.WORLD is group
    r["workers_idle_after_end_training"] = process_group.quiesce(5.0)

    second = Accelerator()  # a cross-validation loop's next fold
    r["second_reuses_the_group"] = dist.group.WORLD is group
    r["second_loss"] = train(second, 1)
    second.end_training()

    PartialState().destroy_process_group()  # how Accelerate's scripts leave it
    r["left"] = not dist.is_initialized()
    third = Accelerator()
    r["third_joined_a_new_group"] = dist.is_initialized() and dist.group.WORLD is not group
    r["third_loss"] = train(third, 2)
    r["third_gather"] = third.gather(torch.tensor([rank])).tolist()

    loader = third.prepare(DataLoader(Inherited(os.getpid()), batch_size=1, num_workers=2))
    rows = torch.cat([b for b in loader]).tolist()
    r["loader_workers"] = [{"pdeathsig": int(a), "doctor_forgotten": bool(b), "parent_is_rank": bool(c), "pid": int(d)}
                           for a, b, c, d in rows]
    r["fork_child"] = fork_child_report()
    r["sigkill"] = int(signal.SIGKILL)
    third.end_training()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(r, f)
    print(f"lifetime-ok rank {rank}", flush=True)


if __name__ == "__main__":
    main()
