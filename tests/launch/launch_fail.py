"""Worker script for the failure tests: ``launch_fail.py MODE OUT``.

Every rank writes its pid to OUT/pid{RANK}-{ATTEMPT} once the group is formed, then:
  raise    rank 1 raises RuntimeError; rank 0 waits in a barrier that never completes
  kill     rank 1 kills itself with SIGKILL; rank 0 keeps computing (no collective)
  restart  rank 1 raises on the first attempt only; then both ranks all-reduce and exit 0
  hang     every rank sleeps (the launcher is stopped from outside)
"""

import os
import signal
import sys
import time

import torch

from anyaccel import Accelerator

mode, out = sys.argv[1], sys.argv[2]
acc = Accelerator()
rank = acc.process_index
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
acc.wait_for_everyone()
with open(os.path.join(out, f"pid{rank}-{attempt}"), "w") as f:
    f.write(str(os.getpid()))


def fail_here():
    with open(os.path.join(out, "failed_at"), "w") as f:
        f.write(repr(time.time()))
    raise RuntimeError(f"deliberate failure on rank {rank}")


if mode == "raise":
    if rank == 1:
        time.sleep(0.5)
        fail_here()
    acc.wait_for_everyone()
    time.sleep(120)
elif mode == "kill":
    if rank == 1:
        with open(os.path.join(out, "failed_at"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.time() + 120
    while time.time() < deadline:
        torch.randn(64, 64) @ torch.randn(64, 64)
        time.sleep(0.01)
elif mode == "restart":
    if rank == 1 and attempt == "0":
        fail_here()
    total = acc.reduce(torch.tensor([1.0]), reduction="sum")
    assert total.item() == 2.0, total
    print(f"attempt {attempt} rank {rank} all_reduce ok", flush=True)
elif mode == "hang":
    time.sleep(300)
else:
    raise SystemExit(f"unknown mode {mode}")
