"""Worker for tests/checkpoint/test_async_checkpoint_multiprocess.py: asynchronous save_state under DDP or FSDP2.

    anyaccel launch --num_processes 2 --cpu [--strategy fsdp] async_checkpoint_checks.py OUT [--kill_during_write]

Default: train one epoch, saving asynchronously at step 3 while training goes on; then load that
checkpoint and train the rest of the epoch again: the weights must equal the first pass's bitwise
(the save took the step-3 state although its files are written only after the epoch).
``--kill_during_write``: save at step 2 (complete), start an asynchronous save at step 4 and SIGKILL
this process (rank 0) after its first file is written; a second run's ``resume()`` must load step 2.
"""

import argparse
import json
import os
import signal
import sys
import threading

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))  # train_common
from train_common import build, train_step  # noqa: E402

from anyaccel import Accelerator, ProjectConfiguration  # noqa: E402
from anyaccel.checkpoint import training_state  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--kill_during_write", action="store_true")
args = p.parse_args()

config = ProjectConfiguration(project_dir=os.path.join(args.out, "project"), automatic_checkpoint_naming=True,
                              async_save=True)
acc = Accelerator(cpu=True, project_config=config)  # the strategy: anyaccel launch --strategy
model, opt, loader, sched = build(acc, seed=0, n=64, batch_size=4)


def weights():
    return {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}


result = {"rank": acc.process_index}
if args.kill_during_write:
    start = acc.resume()
    result["resumed_from"] = start.checkpoint
    result["resumed_step"] = start.step
    if start.checkpoint is None:
        write = training_state.write_synced
        step = 0
        for batch in loader:
            train_step(acc, model, opt, sched, batch)
            step += 1
            if step == 2:
                acc.save_state()
                acc.wait_for_checkpoint()
            if step == 4:
                if acc.is_main_process:
                    def write_then_die(path, writer):
                        write(path, writer)
                        os.kill(os.getpid(), signal.SIGKILL)
                    training_state.write_synced = write_then_die
                acc.save_state()
else:
    # The write waits until the epoch is over: the checkpoint must hold the state of step 3 anyway.
    trained = threading.Event()
    write = training_state.write_synced
    training_state.write_synced = lambda path, writer: (trained.wait(), write(path, writer))[1]
    step = 0
    for batch in loader:
        train_step(acc, model, opt, sched, batch)
        step += 1
        if step == 3:
            directory = acc.save_state()  # asynchronous (ProjectConfiguration.async_save)
    first_pass = weights()
    trained.set()
    assert acc.wait_for_checkpoint() == directory
    acc.resume(directory)
    for batch in loader:  # the rest of the epoch, from the checkpoint's position (resume() restores it)
        train_step(acc, model, opt, sched, batch)
    second_pass = weights()
    result["directory"] = directory
    result["manifest"] = json.load(open(os.path.join(directory, "anyaccel_checkpoint.json")))
    result["bitwise"] = all(torch.equal(first_pass[k], second_pass[k]) for k in first_pass)
with open(os.path.join(args.out, f"rank{acc.process_index}.json"), "w") as fh:
    json.dump(result, fh)
acc.end_training()
