"""Run with 2 processes (anyaccel launch --num_processes 2 --cpu lifetime_family.py MODE OUT): each
rank starts a family of processes that would outlive it — persistent DataLoader workers, a plain
``os.fork`` child, and a program started with ``subprocess`` in a session of its own — writes their
pids to OUT/family<r>.json, then either ends normally once OUT/go exists (MODE ``finish``) or waits to be stopped
(MODE ``wait``: the test signals the launcher). tests/process/test_lifetime_multiprocess.py checks that
none of them outlives the launch.
"""

import json
import os
import subprocess
import sys
import time

import psutil
import torch
from torch.utils.data import DataLoader, TensorDataset

from anyaccel import Accelerator


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    acc = Accelerator()
    data = TensorDataset(torch.arange(64.0)[:, None])
    loader = acc.prepare(DataLoader(data, batch_size=2, num_workers=2, persistent_workers=True))
    batches = iter(loader)
    next(batches)  # the workers run now
    workers = [c.pid for c in psutil.Process().children()]  # the DataLoader's two workers
    child = os.fork()
    if child == 0:  # a plain fork that would sleep for ten minutes
        time.sleep(600)
        os._exit(0)
    program = subprocess.Popen(["sleep", "600"], start_new_session=True)
    family = {"rank": os.getpid(), "dataloader_workers": workers, "fork": child, "subprocess": program.pid}
    with open(os.path.join(out, f"family{acc.process_index}.json"), "w") as f:
        json.dump(family, f)
    if mode == "wait":
        time.sleep(600)
    while not os.path.exists(os.path.join(out, "go")):  # the test has seen the whole family alive
        time.sleep(0.1)
    acc.end_training()


if __name__ == "__main__":
    main()
