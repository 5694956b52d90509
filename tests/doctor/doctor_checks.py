"""Worker for tests/doctor/test_doctor_multiprocess.py: one hang-doctor scenario per run (``anyaccel launch
--num_processes 2 --cpu doctor_checks.py MODE``)."""

import datetime
import sys
import time

import torch

from anyaccel import Accelerator, InitProcessGroupKwargs
from anyaccel.errors import CollectiveMismatchError

mode = sys.argv[1]
pg = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=12)) if mode == "hang" else None
acc = Accelerator(cpu=True, kwargs_handlers=[pg] if pg else None, hang_timeout=3 if mode in ("hang", "backward") else None)
rank = acc.process_index
x = torch.ones(2) * (rank + 1)

if mode == "hang":  # rank 1 is busy in its own code while rank 0 waits in reduce
    if rank == 1:
        time.sleep(25)
    acc.reduce(x)
elif mode == "mismatch_barrier":  # rank 0 in a barrier, rank 1 in gather at the same point
    try:
        if rank == 0:
            acc.wait_for_everyone()
        else:
            acc.gather(x)
    except CollectiveMismatchError as exc:
        print(f"rank {rank} MISMATCH: {exc}", flush=True)
        sys.exit(0)
    sys.exit(3)
elif mode == "left":  # rank 1 skips the collective and exits 0; rank 0 waits in reduce
    acc.gather(x)
    if rank == 1:
        sys.exit(0)
    time.sleep(1)
    acc.reduce(x)
elif mode == "backward":  # rank 0 gathers alone while rank 1 goes on into backward's gradient all-reduce
    model = acc.prepare(torch.nn.Linear(2, 2))
    for _ in range(3):  # steps together (DDP rebuilds its buckets, a broadcast in forward, at the second)
        acc.backward(model(x).sum())
    if rank == 0:
        acc.gather(x)
    acc.backward(model(x).sum())
print(f"rank {rank} done", flush=True)
