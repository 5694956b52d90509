"""A notebook session, played as a script: ``launch_notebook_session.py OUT``.

Like cells of a Kaggle/Colab CPU notebook, in this order: train with ``notebook_launcher`` on 2
CPU processes (the function is a closure, so it cannot be pickled: the workers must be forked),
see a worker's exception come back, use ``debug_launcher``, then make the mistakes the launcher
must refuse before starting anything. Results go to OUT/session.json (and OUT/rank{R}.json).
"""

import json
import os
import signal
import sys
import time

import psutil

from anyaccel import debug_launcher, notebook_launcher

# Ctrl-C as a notebook kernel has it (a pytest-xdist worker starts its children with SIGINT ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)

out = sys.argv[1]
results = {"parent_pid": os.getpid()}


def make_training(out_dir, samples):
    def training_function(batch_size):  # a closure: pickle (and so "spawn") cannot send it
        # made in the kernel before the fork (not again in each worker): the registries Accelerator() reads
        made_in_kernel = {name: key in vars(sys.modules[name]) for name, key in (
            ("anyaccel.strategies", "_REGISTRY"), ("anyaccel.backends", "_REGISTRY"),
            ("anyaccel.environment.devices", "_DEVICES"), ("anyaccel.optionspec", "_BY_NAME"), ("anyaccel.envvars", "ALL"))}
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        from anyaccel import Accelerator

        acc = Accelerator()
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = TensorDataset(torch.arange(samples), torch.randn(samples, 4))
        loader = DataLoader(data, batch_size=batch_size, shuffle=True)
        model, opt, loader = acc.prepare(model, opt, loader)
        seen, gathered = [], []
        for idx, x in loader:
            seen += idx.tolist()
            loss = model(x).pow(2).mean()
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            gathered += acc.gather_for_metrics(idx).tolist()
        mine = {"rank": acc.process_index, "world": acc.num_processes, "pid": os.getpid(), "seen": seen,
                "gathered": gathered, "device": str(acc.device), "mixed_precision": acc.mixed_precision,
                "made_in_kernel": made_in_kernel}  # fmt: skip
        with open(os.path.join(out_dir, f"rank{acc.process_index}.json"), "w") as f:
            json.dump(mine, f)
        return {"rank0_says": "hello", "world": acc.num_processes, "rank": acc.process_index}

    return training_function


# Cell 1: train on 2 CPU processes.
results["returned"] = notebook_launcher(make_training(out, 37), args=(4,), num_processes=2, mixed_precision="bf16")


# Cell 2: a worker raises; rank 0 is waiting in a collective meanwhile.
def failing(tag):
    from anyaccel import Accelerator

    acc = Accelerator()
    if acc.process_index == 1:
        with open(os.path.join(out, "failed_at"), "w") as f:
            f.write(repr(time.time()))
        raise ValueError(f"bad value {tag} on rank 1")
    acc.wait_for_everyone()
    time.sleep(120)


try:
    notebook_launcher(failing, args=("x",), num_processes=2)
    results["failure"] = None
except Exception as exc:
    results["failure"] = {
        "type": type(exc).__name__,
        "rank": getattr(exc, "rank", None),
        "original": repr(getattr(exc, "original", None)),
        "cause": repr(exc.__cause__),
        "message": str(exc),
        "stopped_after": time.time() - float(open(os.path.join(out, "failed_at")).read()),
    }
results["children_left"] = [p.pid for p in psutil.Process().children(recursive=True)]
results["sigint_handler_restored"] = signal.getsignal(signal.SIGINT) is signal.default_int_handler
results["sigint_handler"] = repr(signal.getsignal(signal.SIGINT))  # what it was instead, for the message


# Cell 3: debug_launcher.
def where_am_i():
    from anyaccel import Accelerator

    acc = Accelerator()
    return {"world": acc.num_processes, "device": str(acc.device), "use_cpu": os.environ.get("ANYACCEL_USE_CPU")}


results["debug"] = debug_launcher(where_am_i)
results["env_restored"] = "ANYACCEL_USE_CPU" not in os.environ and "ANYACCEL_MIXED_PRECISION" not in os.environ


# Cell 4: mistakes refused before anything starts.
def refused(call):
    before = time.time()
    try:
        call()
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.time() - before}
    return None


import anyaccel.devices as devices  # noqa: E402

real_count, real_init = devices.cuda_device_count, devices.cuda_initialized
devices.cuda_device_count = lambda: 1  # a machine with one GPU
results["too_many"] = refused(lambda: notebook_launcher(where_am_i, num_processes=2))
devices.cuda_device_count = real_count
devices.cuda_initialized = lambda: True  # as after `model.cuda()` in an earlier cell
results["cuda_initialized"] = refused(lambda: notebook_launcher(where_am_i, num_processes=2))
devices.cuda_initialized = real_init

from anyaccel import Accelerator  # noqa: E402

accelerator = Accelerator()  # created in the notebook itself
results["accelerator_in_parent"] = refused(lambda: notebook_launcher(where_am_i, num_processes=2))
results["accelerator_in_parent_debug"] = refused(lambda: debug_launcher(where_am_i))
results["one_process_runs_here"] = notebook_launcher(lambda: os.getpid(), num_processes=1) == os.getpid()
results["children_at_end"] = [p.pid for p in psutil.Process().children(recursive=True)]

with open(os.path.join(out, "session.json"), "w") as f:
    json.dump(results, f)
