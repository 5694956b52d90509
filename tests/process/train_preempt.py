"""Worker for tests/process/test_preemption_multiprocess.py and the SLURM preemption test: a small training run that
resumes with ``accelerator.resume()`` and writes its final weights.

    anyaccel launch --num_processes 2 --cpu train_preempt.py --project DIR --out W.pt
        [--sleep S] [--marker PATH --marker_step K] [--save_every N] [--kill_rank R --kill_step K]
"""

import argparse
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_common import build, train_step  # noqa: E402

from anyaccel import Accelerator, ProjectConfiguration  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--project", required=True)
p.add_argument("--out", required=True)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--marker")
p.add_argument("--marker_step", type=int, default=4)
p.add_argument("--save_every", type=int, default=0)
p.add_argument("--kill_rank", type=int)
p.add_argument("--kill_step", type=int, default=6)
args = p.parse_args()

acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=args.project,
                                                                automatic_checkpoint_naming=True))
model, opt, loader, sched = build(acc, seed=0, n=64, batch_size=4)
start = acc.resume()
print(f"rank {acc.process_index} resumed at epoch {start.epoch} step {start.step} from {start.checkpoint}", flush=True)
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and \
    os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
step = start.step
for epoch in range(start.epoch, args.epochs):
    for batch in loader:
        train_step(acc, model, opt, sched, batch)
        step += 1
        if args.save_every and step % args.save_every == 0:
            acc.save_state()
        if args.marker and step == args.marker_step and acc.is_main_process and start.checkpoint is None:
            open(args.marker, "w").close()
        if args.kill_rank == acc.process_index and step == args.kill_step and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.sleep)
if acc.is_main_process:
    torch.save({k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}, args.out)
    print(f"finished at step {step}", flush=True)
acc.end_training()
