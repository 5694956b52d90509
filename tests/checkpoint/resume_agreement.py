"""Every rank loads the checkpoint rank 0 chose, or every rank raises. Run on 2 processes (warm launcher, torchrun or anyaccel launch).

    resume_agreement.py OUT save      2 training steps, then save_state() into OUT/shared/checkpoints
    resume_agreement.py OUT resume    rank 0's project_dir is OUT/shared, rank 1's OUT/empty (as if
                                      its node saw a stale or node-local directory): resume() on both;
                                      then load_state() with a different directory on each rank, and
                                      with a directory that does not exist

Each rank writes OUT/<mode>_rank<r>.json.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))  # train_common
import rank_results  # noqa: E402
import train_common as tc  # noqa: E402

from anyaccel import Accelerator  # noqa: E402
from anyaccel.utils import ProjectConfiguration  # noqa: E402

out, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
project = os.path.join(out, "shared" if mode == "save" or rank == 0 else "empty")
os.makedirs(project, exist_ok=True)
acc = Accelerator(project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True))
model, opt, loader, sched = tc.build(acc, seed=0, n=24, batch_size=3)
result = {}
if mode == "save":
    for step, batch in enumerate(loader):
        tc.train_step(acc, model, opt, sched, batch)
        if step == 1:
            break
    result["saved"] = acc.save_state()
else:
    point = acc.resume()
    result["resume"] = [point.epoch, point.step, point.checkpoint]
    result["weights"] = float(sum(p.detach().sum() for p in model.parameters()))
    for name, path in (("different", point.checkpoint if rank == 0 else point.checkpoint + "_elsewhere"),
                       ("missing", os.path.join(out, "no_such_checkpoint"))):
        try:
            acc.load_state(path)
            result[name] = "loaded"
        except Exception as exc:  # what each rank raised
            result[name] = f"{type(exc).__name__}: {exc}"
acc.wait_for_everyone()
rank_results.write(out, mode, rank, result)
acc.end_training()  # as the other check scripts; leaving without it is tests/accelerator/exit_without_teardown.py's case
