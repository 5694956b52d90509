"""find_executable_batch_size and free_memory."""

from __future__ import annotations

import pytest
import torch

from anyaccel import Accelerator, find_executable_batch_size, free_memory
from anyaccel.memory import should_reduce_batch_size


def test_halves_on_a_real_cpu_out_of_memory_error():
    tried = []

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size, scale):
        tried.append(batch_size)
        # > 4: ask the CPU allocator for terabytes, which it refuses with a real RuntimeError
        size = (batch_size - 4) * scale if batch_size > 4 else 8
        return torch.empty(size, dtype=torch.uint8).numel() and batch_size

    with pytest.warns(UserWarning) as record:
        assert train(2**42) == 4
    assert tried == [128, 64, 32, 16, 8, 4]
    messages = [str(w.message) for w in record]
    assert len(messages) == 5 and messages[0].startswith("out of memory with batch_size=128")
    assert "DefaultCPUAllocator" in messages[0] and messages[-1].endswith("retrying with 4")


@pytest.mark.parametrize("message", [
    "CUDA out of memory. Tried to allocate 20.00 MiB",
    "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate 1",
    "RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 1.00G.",
    "XPU out of memory. Tried to allocate",
])
def test_recognises_out_of_memory_messages(message):
    assert should_reduce_batch_size(RuntimeError(message))


def test_recognises_torch_out_of_memory_error():
    assert should_reduce_batch_size(torch.OutOfMemoryError("CUDA out of memory"))
    assert not should_reduce_batch_size(RuntimeError("shape mismatch"))
    assert not should_reduce_batch_size(ValueError("out of memory"))  # only allocator errors count


def test_other_errors_propagate_at_once():
    tried = []

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size):
        tried.append(batch_size)
        raise ValueError("bug in the training loop")

    with pytest.raises(ValueError, match="bug in the training loop"):
        train()
    assert tried == [8]


def test_gives_up_at_zero_with_the_sizes_tried():
    @find_executable_batch_size(starting_batch_size=4)
    def train(batch_size):
        raise RuntimeError("CUDA out of memory.")

    with pytest.warns(UserWarning, match="retrying"), pytest.raises(RuntimeError, match=r"every batch size tried \(4, 2, 1\)"):
        train()


def test_passing_the_batch_size_yourself_is_an_error():
    @find_executable_batch_size(starting_batch_size=4)
    def train(batch_size, model):
        return batch_size

    with pytest.raises(TypeError, match="call it without the batch size"):
        train(16, "model")
    with pytest.raises(TypeError, match="do not pass 'batch_size'"):
        train(model="m", batch_size=3)
    assert train("model") == 4


def test_free_memory_returns_nones_and_accelerator_forgets_prepared_objects():
    acc = Accelerator()
    model = acc.prepare(torch.nn.Linear(2, 2))
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    model, opt = acc.free_memory(model, opt)
    assert model is None and opt is None
    assert acc._models == [] and acc._optimizers == []
    assert free_memory(1, 2, 3) == [None, None, None]
