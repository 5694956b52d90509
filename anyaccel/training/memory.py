"""Out-of-memory helpers: :func:`find_executable_batch_size` and :func:`free_memory`.

Both are local to the calling process. In a multi-process job every rank runs the decorated
function on its own; they stay in agreement only if they run out of memory at the same batch size
(same devices, same model) — a rank that fails alone leaves the others waiting in their next
collective, so prefer finding the batch size in a single process and passing it to the job.
"""

from __future__ import annotations

import functools
import gc
import inspect
import warnings
from typing import Any, Callable, List, Optional

import torch

__all__ = ["find_executable_batch_size", "free_memory", "release_memory", "should_reduce_batch_size"]

# Substrings of the messages PyTorch and its backends raise when an allocation fails.
_OOM_MESSAGES = (
    "out of memory",  # CUDA ("CUDA out of memory"), XPU, MPS, NPU, HIP
    "DefaultCPUAllocator: can't allocate memory",  # CPU
    "can't allocate memory",
    "RESOURCE_EXHAUSTED",  # XLA / TPU
    "CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN gives this for too-large workspaces
    "CUBLAS_STATUS_ALLOC_FAILED",
)


def free_memory(*objects: Any) -> List[None]:
    """Run the garbage collector and return cached device memory to the driver (every device
    whose runtime is started in this process: CUDA, MPS, ...). Local. Returns ``[None] * len(objects)`` so that ``a, b = free_memory(a, b)`` drops the
    caller's references too (the objects themselves can only be freed once no name refers to them)."""
    objects = list(objects)
    for i in range(len(objects)):
        objects[i] = None
    gc.collect()
    from ..backends import started_backends

    for backend in started_backends():
        backend.empty_cache()
    return objects


release_memory = free_memory  # Accelerate's name


def should_reduce_batch_size(exception: BaseException) -> bool:
    """True when ``exception`` means an allocation failed: ``torch.cuda.OutOfMemoryError``, a
    ``RuntimeError`` from the CPU allocator ("DefaultCPUAllocator: can't allocate memory"), any
    backend's "out of memory", or XLA's ``RESOURCE_EXHAUSTED``."""
    oom_type = getattr(torch, "OutOfMemoryError", None)  # torch < 2.5: recognised by its message below
    if oom_type is not None and isinstance(exception, oom_type):
        return True
    if isinstance(exception, MemoryError):
        return True
    if isinstance(exception, RuntimeError) or type(exception).__name__ in ("XlaRuntimeError", "OutOfMemoryError"):
        message = str(exception)
        return any(m in message for m in _OOM_MESSAGES)
    return False


def find_executable_batch_size(function: Optional[Callable] = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Optional[Callable[[int], int]] = None) -> Callable:
    """Decorator: call ``function(batch_size, *args, **kwargs)`` with ``starting_batch_size``;
    whenever it runs out of memory (see :func:`should_reduce_batch_size`), free memory, halve the
    batch size (or apply ``reduce_batch_size_fn``) and call it again. Other exceptions propagate
    unchanged. Raises ``RuntimeError`` when the batch size reaches zero. Local to the process::

        @find_executable_batch_size(starting_batch_size=256)
        def train(batch_size, model):
            ...

        train(model)          # batch_size is supplied by the decorator

    The decorated function must take the batch size as its first parameter; do not pass it
    yourself. Everything allocated inside it must be created inside it (a tensor kept from a
    failed attempt keeps its memory).
    """
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    if int(starting_batch_size) < 1:
        raise ValueError(f"starting_batch_size must be >= 1, got {starting_batch_size}")
    reduce = reduce_batch_size_fn or (lambda size: size // 2)

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        _check_call(function, args, kwargs)
        batch_size = int(starting_batch_size)
        tried: List[int] = []
        while True:
            if batch_size < 1:
                raise RuntimeError(
                    f"find_executable_batch_size: {function.__qualname__} ran out of memory at every batch size "
                    f"tried ({', '.join(map(str, tried))}); no executable batch size found"
                )
            tried.append(batch_size)
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - filtered just below
                if not should_reduce_batch_size(exc):
                    raise
                message = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            # Outside the except block: the exception and its frames (holding the failed
            # attempt's tensors) are gone before we collect and retry.
            free_memory()
            new_size = int(reduce(batch_size))
            if new_size >= batch_size:
                raise RuntimeError(f"reduce_batch_size_fn({batch_size}) returned {new_size}; it must return less")
            warnings.warn(f"out of memory with batch_size={batch_size} ({message}); retrying with {new_size}",
                          stacklevel=2)
            batch_size = new_size

    return decorator


def _check_call(function: Callable, args: tuple, kwargs: dict) -> None:
    """Raise TypeError if the caller passed the batch size itself (a common mistake)."""
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # builtins, C functions
        return
    if not params:
        raise TypeError(f"{function.__qualname__} must take the batch size as its first parameter")
    if params[0].name in kwargs:
        raise TypeError(f"do not pass {params[0].name!r} to {function.__qualname__}: find_executable_batch_size "
                        "supplies it")
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if not has_varargs and len(args) + 1 > len(positional):
        raise TypeError(
            f"{function.__qualname__} takes {len(positional)} positional argument(s) including the batch size, "
            f"but was called with {len(args)} more: call it without the batch size (the decorator passes it)"
        )
