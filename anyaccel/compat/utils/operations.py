"""``anyaccel.utils.operations``: Accelerate's ``accelerate.utils.operations`` names.

* Collectives, with Accelerate's signatures and defaults, over :mod:`anyaccel.ops` (shape-checked:
  a mismatch raises :class:`DistributedOperationException` on every rank instead of hanging).
  Notably ``reduce`` here averages (``"mean"``), like ``accelerate.utils.reduce``, while
  ``Accelerator.reduce`` sums, like Accelerate's method.
* Local helpers over nested tuples/lists/dicts of tensors (``recursively_apply``,
  ``find_batch_size``, ``concatenate``, ``slice_tensors``, ...): Accelerate's semantics; this
  module is their home in anyaccel (the library itself walks nested data with
  :mod:`anyaccel.tree`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, List, Optional

import torch

from ... import ops
from ...environment.devices import send_to_device as _send_to_device
from ...errors import ShapeMismatchError
from ... import precision

__all__ = [
    # collectives (Collective: every rank calls them in the same order)
    "gather", "gather_object", "broadcast", "broadcast_object_list", "reduce", "pad_across_processes",
    "copy_tensor_to_devices",
    # local
    "send_to_device", "convert_to_fp32", "convert_outputs_to_fp32", "recursively_apply", "honor_type",
    "is_namedtuple", "is_torch_tensor", "is_tensor_information", "TensorInformation", "get_data_structure",
    "initialize_tensors", "find_batch_size", "ignorant_find_batch_size", "find_device", "listify",
    "slice_tensors", "concatenate", "pad_input_tensors", "DistributedOperationException",
    "CannotPadNestedTensorWarning", "GatheredParameters",
]

#: Accelerate's name for the error a mismatched collective raises (anyaccel's ShapeMismatchError,
#: which CollectiveMismatchError extends: ranks in different collectives).
DistributedOperationException = ShapeMismatchError


class CannotPadNestedTensorWarning(UserWarning):
    """Accelerate's warning category for padding a nested tensor (``torch.nested``), which
    ``pad_across_processes`` leaves as it is."""




def GatheredParameters(params: Any, modifier_rank: Any = None, fwd_module: Any = None, enabled: bool = True) -> Any:
    """DeepSpeed ZeRO-3's context that gathers partitioned parameters for the block
    (``deepspeed.zero.GatheredParameters``; needs ``pip install anyaccel[deepspeed]``). Collective."""
    from ...strategies.deepspeed import import_deepspeed

    return import_deepspeed().zero.GatheredParameters(params, modifier_rank=modifier_rank, fwd_module=fwd_module,
                                                     enabled=enabled)


# ---- collectives ---------------------------------------------------------------------------
def gather(tensor: Any) -> Any:
    """All-gather tensors (nested allowed) along dim 0; every rank receives the concatenation in
    rank order. Collective."""
    return ops.gather(tensor)


def gather_object(object: Any) -> List[Any]:
    """All-gather picklable objects; a list from each rank is concatenated, anything else becomes
    one element per rank. Every rank receives the whole. Collective."""
    return ops.gather_object(object)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Every rank receives rank ``from_process``'s tensors (nested allowed). Collective."""
    return ops.broadcast(tensor, from_process=from_process)


def broadcast_object_list(object_list: List[Any], from_process: int = 0) -> List[Any]:
    """Every rank's ``object_list`` is filled in place with rank ``from_process``'s picklable
    objects (and returned). Collective."""
    return ops.broadcast_object_list(object_list, from_process=from_process)


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """All-reduce tensors (nested allowed) with ``"mean"`` (the default, as
    ``accelerate.utils.reduce``), ``"sum"``, ``"max"`` or ``"min"``, then multiply by ``scale``;
    every rank receives the result. Collective."""
    return ops.reduce(tensor, reduction=reduction, scale=scale)


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """Pad tensors (nested allowed) along ``dim`` with ``pad_index`` to the largest size any rank
    has (at the start with ``pad_first``); each rank receives its own padded tensors. Collective."""
    return ops.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)


def copy_tensor_to_devices(tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A tensor that exists on the main process only (``None`` elsewhere) arrives on every rank's
    device: rank 0 sends its shape and dtype, then the values. Collective; rank 0 must pass a
    tensor."""
    meta = [(tuple(tensor.shape), tensor.dtype, str(tensor.device)) if tensor is not None else None]
    ops.broadcast_object_list(meta, from_process=0)
    if meta[0] is None:
        raise ValueError("copy_tensor_to_devices: the main process passed None; it must pass the tensor to copy")
    shape, dtype, _ = meta[0]
    if tensor is None:
        from ..state import PartialState

        tensor = torch.empty(shape, dtype=dtype, device=PartialState().device)
    return ops.broadcast(tensor, from_process=0)


# ---- local helpers -------------------------------------------------------------------------
def convert_to_fp32(tensor: Any) -> Any:
    """``tensor`` (nested allowed) with every fp16/bf16 tensor converted to fp32 (Accelerate's
    parameter name over :func:`anyaccel.precision.convert_to_fp32`). Local."""
    return precision.convert_to_fp32(tensor)


def send_to_device(tensor: Any, device: Any, non_blocking: bool = False, skip_keys: Any = None) -> Any:
    """Move every tensor (and object with ``.to``) in a nested structure to ``device``, as
    Accelerate's does: mapping entries named in ``skip_keys`` stay where they are, at every
    depth (:func:`anyaccel.devices.send_to_device`). Local."""
    return _send_to_device(tensor, device, non_blocking, skip_keys)


def is_torch_tensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.Tensor``. Local."""
    return isinstance(tensor, torch.Tensor)


@dataclasses.dataclass
class TensorInformation:
    """The shape and dtype of a tensor, without its values (see :func:`get_data_structure`)."""

    shape: torch.Size
    dtype: torch.dtype


def is_tensor_information(tensor_info: Any) -> bool:
    """Whether ``tensor_info`` is a :class:`TensorInformation`. Local."""
    return isinstance(tensor_info, TensorInformation)


def is_namedtuple(data: Any) -> bool:
    """Whether ``data`` is a namedtuple (a tuple with ``_fields`` and ``_asdict``). Local."""
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def honor_type(obj: Any, generator: Any) -> Any:
    """A container of ``obj``'s type (tuple, list, namedtuple) filled from ``generator``. Local."""
    if is_namedtuple(obj):
        return type(obj)(*list(generator))
    return type(obj)(generator)


def recursively_apply(func: Callable[..., Any], data: Any, *args: Any,
                      test_type: Callable[[Any], bool] = is_torch_tensor, error_on_other_type: bool = False,
                      **kwargs: Any) -> Any:
    """``data`` (nested tuples, lists, namedtuples, mappings) with ``func(x, *args, **kwargs)`` in
    place of every leaf ``x`` for which ``test_type(x)``; other leaves are kept, or raise
    ``TypeError`` with ``error_on_other_type``. Containers keep their type. Local."""
    if isinstance(data, (tuple, list)):
        return honor_type(data, (recursively_apply(func, o, *args, test_type=test_type,
                                                   error_on_other_type=error_on_other_type, **kwargs) for o in data))
    if isinstance(data, Mapping):
        return type(data)({k: recursively_apply(func, v, *args, test_type=test_type,
                                                error_on_other_type=error_on_other_type, **kwargs)
                           for k, v in data.items()})
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        raise TypeError(f"Unsupported types ({type(data)}) passed to `{getattr(func, '__name__', func)}`. Only nested "
                        f"list/tuple/dicts of objects that are valid for `{test_type.__name__}` should be passed.")
    return data


def get_data_structure(data: Any) -> Any:
    """``data`` with a :class:`TensorInformation` (shape, dtype) in place of every tensor. Local."""
    return recursively_apply(lambda t: TensorInformation(shape=t.shape, dtype=t.dtype), data)


def initialize_tensors(data_structure: Any) -> Any:
    """The inverse of :func:`get_data_structure`: an uninitialised tensor (``torch.empty``, on the
    CPU) for each :class:`TensorInformation`. Local."""
    return recursively_apply(lambda info: torch.empty(*info.shape, dtype=info.dtype), data_structure,
                             test_type=is_tensor_information)


def find_batch_size(data: Any) -> int:
    """The size of dim 0 of the first tensor in ``data`` (first element of a tuple/list, first
    value of a mapping). ``ValueError`` for an empty container, ``TypeError`` for a non-tensor
    leaf. Local."""
    if isinstance(data, (tuple, list, Mapping)) and len(data) == 0:
        raise ValueError(f"Cannot find the batch size from empty {type(data)}.")
    if isinstance(data, (tuple, list)):
        return find_batch_size(data[0])
    if isinstance(data, Mapping):
        return find_batch_size(next(iter(data.values())))
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"Can only find the batch size of tensors but got {type(data)}.")
    return data.shape[0]


def ignorant_find_batch_size(data: Any) -> Optional[int]:
    """:func:`find_batch_size`, or None where it raises ``ValueError``/``TypeError``. Local."""
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def find_device(data: Any) -> Optional[torch.device]:
    """The device of the first tensor found in ``data`` (None when there is none). Local."""
    if isinstance(data, torch.Tensor):
        return data.device
    values = data.values() if isinstance(data, Mapping) else data if isinstance(data, (tuple, list)) else ()
    for obj in values:
        device = find_device(obj)
        if device is not None:
            return device
    return None


def listify(data: Any) -> Any:
    """``data`` with every tensor turned into (nested) Python numbers via ``tolist()`` (bf16 goes
    through fp32, which NumPy-free ``tolist`` also needs). Local."""
    def to_list(tensor: torch.Tensor) -> Any:
        tensor = tensor.detach().cpu()
        return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).tolist()

    return recursively_apply(to_list, data)


def slice_tensors(data: Any, tensor_slice: Any, process_index: Optional[int] = None,
                  num_processes: Optional[int] = None) -> Any:
    """``data`` with ``tensor[tensor_slice]`` in place of every tensor (the process arguments are
    Accelerate's and unused, as there). Local."""
    return recursively_apply(lambda t: t[tensor_slice], data)


def concatenate(data: Any, dim: int = 0) -> Any:
    """One structure from a list of structures of the same layout, each tensor the
    ``torch.cat`` of the corresponding tensors along ``dim``; a single non-tensor element is
    returned as is, other leaves raise ``TypeError``. Local."""
    first = data[0]
    if isinstance(first, (tuple, list)):
        return honor_type(first, (concatenate([d[i] for d in data], dim=dim) for i in range(len(first))))
    if isinstance(first, Mapping):
        return type(first)({k: concatenate([d[k] for d in data], dim=dim) for k in first.keys()})
    if isinstance(first, torch.Tensor):
        return torch.cat(data, dim=dim)
    if isinstance(data, (tuple, list)) and len(data) == 1:
        return first
    raise TypeError(f"Can only concatenate tensors but got {type(first)}")


def pad_input_tensors(tensor: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Zero-pad dim 0 of every tensor in ``tensor`` (``batch_size`` rows) to a size that
    ``num_processes`` processes can share, as Accelerate's function of the same name computes it
    (for pipeline inference). ``TypeError`` for a non-tensor leaf. Local."""
    def pad(t: torch.Tensor) -> torch.Tensor:
        per_process = batch_size // num_processes
        last_inputs = batch_size - per_process * num_processes
        to_pad = num_processes - batch_size if per_process == 0 else num_processes - per_process
        if last_inputs > to_pad & to_pad < 1:  # Accelerate's expression, precedence included
            to_pad = last_inputs - to_pad
        new_size = list(t.shape)
        new_size[0] = batch_size + to_pad
        out = t.new_zeros(tuple(new_size))
        out[tuple(slice(0, t.shape[dim]) if i == dim else slice(None) for i in range(len(new_size)))] = t
        return out

    return recursively_apply(pad, tensor, error_on_other_type=True)


class _ForwardInFp32:
    """Picklable wrapper: the forward's outputs converted to fp32 (see :func:`convert_outputs_to_fp32`)."""

    def __init__(self, model_forward: Callable[..., Any]):
        self.model_forward = model_forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return precision.convert_to_fp32(self.model_forward(*args, **kwargs))


def convert_outputs_to_fp32(model_forward: Callable[..., Any]) -> Callable[..., Any]:
    """``model_forward`` whose fp16/bf16 output tensors are converted to fp32 (``__wrapped__``
    gives the original back, as Accelerate's decorator does). Local."""
    wrapper = _ForwardInFp32(model_forward)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return wrapper(*args, **kwargs)

    forward.__wrapped__ = wrapper
    return forward
