"""Worker of fault (b) (tests/cluster/test_faults.py): a model whose gradient all-reduce is large
enough (2.1 MB per step) for a shaped link to bound the step time. Prints one line
``LOOP <seconds> BYTES <gradient bytes per step> STEPS <n>`` (rank 0) and saves the final weights.

    anyaccel launch ... wide_worker.py OUT.pt [STEPS]
"""

import sys
import time

import torch

from anyaccel import Accelerator, set_seed

out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8
acc = Accelerator(cpu=True)
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
model, opt = acc.prepare(model, opt)
g = torch.Generator().manual_seed(1 + acc.process_index)  # each rank its own batches
batches = [(torch.randn(8, 256, generator=g), torch.randn(8, 256, generator=g)) for _ in range(steps)]
acc.wait_for_everyone()
t0 = time.monotonic()
for x, y in batches:
    acc.backward(torch.nn.functional.mse_loss(model(x), y))
    opt.step()
    opt.zero_grad()
acc.wait_for_everyone()
loop = time.monotonic() - t0
if acc.is_main_process:
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"LOOP {loop:.3f} BYTES {grad_bytes} STEPS {steps}", flush=True)
    torch.save({k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}, out)
acc.end_training()
