"""Create an Accelerator, run a collective, and simply end: no end_training, no destroy."""
import torch
from anyaccel import Accelerator

acc = Accelerator()
print("sum", acc.reduce(torch.ones(1)).item())
