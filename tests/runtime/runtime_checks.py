"""Worker for tests/runtime/test_runtime_multiprocess.py: what an Accelerator registers with the process's hang doctor
and signal handlers is released by end_training() and by garbage collection (2 real ranks)."""

import gc
import json
import signal
import sys
from pathlib import Path

import torch

from anyaccel import Accelerator, doctor

out = Path(sys.argv[1])


def timeouts():
    return sorted(s.hang_timeout for s in doctor.current().subscriptions)


first = Accelerator(cpu=True, hang_timeout=5)
second = Accelerator(cpu=True, hang_timeout=50)
report = {"both": timeouts(), "effective": doctor.current().hang_timeout,
          "own": [first._runtime.subscription.hang_timeout, second._runtime.subscription.hang_timeout]}
first.prepare(torch.utils.data.DataLoader(torch.arange(8), batch_size=2))
del first
gc.collect()
report["after_gc"] = timeouts()
report["effective_after_gc"] = doctor.current().hang_timeout
most = 0
for i in range(10):  # a notebook re-running its cell (the collector runs now and then; here each time)
    acc = Accelerator(cpu=True, hang_timeout=7 + i)
    acc.prepare(torch.utils.data.DataLoader(torch.arange(8), batch_size=2))
    gc.collect()
    most = max(most, len(timeouts()))
report["most_in_loop"] = most
del acc
gc.collect()
report["after_loop_gc"] = timeouts()
second.prepare(torch.utils.data.DataLoader(torch.arange(8), batch_size=2))
report["handler_installed"] = signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
second.end_training()
report["after_end_training"] = timeouts()
report["handler_after_end_training"] = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
(out / f"rank{second.process_index}.json").write_text(json.dumps(report))
