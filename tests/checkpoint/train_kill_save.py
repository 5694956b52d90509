"""SIGKILL a process in the middle of save_state; the previous checkpoint must stay loadable.

    train_kill_save.py OUT CKPT POINT [KILL_RANK]

Trains 5 steps, save_state(CKPT) (checkpoint A; weights in OUT/a.pt), trains 5 more (weights in
OUT/b.pt), then calls save_state(CKPT) again and the process of rank KILL_RANK (default 0) sends
itself SIGKILL at POINT:

    write:N    while writing its N-th checkpoint file (the file is left half written)
    manifest   while writing the manifest (left half written)
    rename:1   just before the previous checkpoint is moved aside
    rename:2   between moving the previous checkpoint aside and renaming the new one into place
    cleanup    after the new checkpoint is in place, before the previous one is deleted

Runs in one process (plain python) or under torchrun. If the kill never happens the script
writes OUT/not_killed and exits 3.
"""

import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))  # train_common
import train_common as tc  # noqa: E402

from anyaccel import Accelerator  # noqa: E402

out, ckpt, point = sys.argv[1], sys.argv[2], sys.argv[3]
kill_rank = int(sys.argv[4]) if len(sys.argv) > 4 else 0

acc = Accelerator()
model, opt, loader, sched = tc.build(acc, seed=0, n=60, batch_size=3)
progress = tc.Progress()
acc.register_for_checkpointing(progress)


def train(steps):
    it = iter(loader)
    for _ in range(steps):
        tc.train_step(acc, model, opt, sched, next(it))
        progress.step += 1


train(5)
acc.save_state(ckpt)
if acc.is_main_process:
    torch.save(tc.weights(acc, model), os.path.join(out, "a.pt"))
train(5)
if acc.is_main_process:
    torch.save(tc.weights(acc, model), os.path.join(out, "b.pt"))
acc.wait_for_everyone()


def die():
    os.kill(os.getpid(), signal.SIGKILL)


if acc.process_index == kill_rank:
    kind, _, arg = point.partition(":")
    from anyaccel.checkpoint import layout, serialize, training_state

    original_write = training_state.write_synced
    count = {"write": 0, "rename": 0}

    def write_then_die_half_way(path, write):
        count["write"] += 1
        is_manifest = os.path.basename(path) == layout.MANIFEST
        if (kind == "write" and count["write"] == int(arg)) or (kind == "manifest" and is_manifest):
            write(path)
            size = os.path.getsize(path)
            with open(path, "rb+") as fh:
                fh.truncate(size // 2)
            die()
        return original_write(path, write)

    original_rename = os.rename

    def rename(src, dst):
        count["rename"] += 1
        if kind == "rename" and count["rename"] == int(arg):
            die()
        return original_rename(src, dst)

    original_rmtree = layout.remove_tree

    def rmtree(path):
        if kind == "cleanup" and path.endswith(".anyaccel-old") and count["rename"] == 2:
            die()
        return original_rmtree(path)

    training_state.write_synced = serialize.write_synced = write_then_die_half_way  # every file of a save
    os.rename = rename
    layout.remove_tree = rmtree

train(0)
acc.save_state(ckpt)
open(os.path.join(out, "not_killed"), "w").close()
sys.exit(3)
