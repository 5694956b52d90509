"""How big each module is, how much memory each device offers, and the device map that places a
model's layers in order on the devices, then host memory, then disk (``infer_auto_device_map``).

Accelerate's names and algorithm: devices are filled in order (GPUs by index, then ``"cpu"``,
then ``"disk"``); a module that does not fit is split into its children unless its class is in
``no_split_module_classes``, else it goes to the next device. The main device (the first GPU, or
the CPU) keeps room for the largest undividable block, because offloaded layers are brought there
to run. All functions are local to the calling process.
"""

from __future__ import annotations

import re
from collections import OrderedDict, defaultdict
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from ..backends import device_types, free_memory, named_map_devices
from ..environment.devices import device_facts
from .notices import no_effect
from .placement import named_module_tensors

__all__ = ["convert_file_size_to_int", "human_size", "dtype_byte_size", "compute_module_sizes", "get_max_memory",
           "get_max_layer_size", "get_balanced_memory", "infer_auto_device_map", "clean_device_map"]

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def convert_file_size_to_int(size: Union[int, str], what: str = "size") -> int:
    """Bytes in ``size``: an int, or a string such as ``"10GB"`` (10**9 bytes) or ``"500MiB"``
    (2**20). ``what`` names the argument in the error."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(size))
    if not match or (match.group(2).upper() or "B") not in _UNITS:
        raise ValueError(f"{what}={size!r} is not a size; use an int (bytes) or e.g. '10GB', '500MB', '2GiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper() or "B"])


def human_size(n: float) -> str:
    """``n`` bytes as text: ``512 B``, ``1.5 KiB``, ``3.2 GiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def dtype_byte_size(dtype: torch.dtype) -> float:
    """Bytes per element of ``dtype`` (1/8 for bool, as Accelerate counts it)."""
    if dtype == torch.bool:
        return 1 / 8
    return torch.empty((), dtype=dtype).element_size()


def compute_module_sizes(model: torch.nn.Module, dtype: Any = None, special_dtypes: Optional[Dict[str, Any]] = None,
                         buffers_only: bool = False) -> Dict[str, int]:
    """Bytes of every module and tensor of ``model`` by name (``""`` is the whole model); floating
    tensors counted in ``dtype`` when given, ``special_dtypes`` per tensor name."""
    sizes: Dict[str, int] = defaultdict(int)
    tensors = model.named_buffers() if buffers_only else named_module_tensors(model, recurse=True)
    for name, tensor in tensors:
        if special_dtypes and name in special_dtypes:
            size = tensor.numel() * dtype_byte_size(special_dtypes[name])
        elif dtype is not None and tensor.is_floating_point():
            size = tensor.numel() * min(dtype_byte_size(dtype), dtype_byte_size(tensor.dtype))
        else:
            size = tensor.numel() * dtype_byte_size(tensor.dtype)
        parts = name.split(".")
        for i in range(len(parts) + 1):
            sizes[".".join(parts[:i])] += int(size)
    return sizes


def _device_key(d: Any) -> Any:
    if isinstance(d, str) and d.isdigit():
        return int(d)
    if isinstance(d, str) and ":" in d:
        try:
            d = torch.device(d)
        except RuntimeError:
            return d
    if isinstance(d, torch.device):
        indexed = d.type in device_types() and device_facts(d.type).indexed
        return d.index if indexed and d.index is not None else d.type
    return d


def get_max_memory(max_memory: Optional[Dict[Any, Union[int, str]]] = None) -> Dict[Any, int]:
    """The memory budget per device: ``max_memory`` with sizes converted to bytes, or, when
    None, the free memory of every GPU (every device the backend registry reports memory for)
    and the available host memory. Local."""
    if max_memory is None:
        import psutil

        found: Dict[Any, int] = free_memory()
        found["cpu"] = psutil.virtual_memory().available
        return found
    out = {_device_key(k): convert_file_size_to_int(v, what=f"max_memory[{k!r}]") for k, v in max_memory.items()}
    named = named_map_devices() + ("cpu", "disk")
    unknown = [k for k in out if not isinstance(k, int) and k not in named]
    if unknown:
        raise ValueError(f"max_memory has keys {unknown} that are not devices; use GPU indices (0, 1, ...), "
                         f"{', '.join(repr(n) for n in named)}")
    gpus = sorted(k for k in out if isinstance(k, int))
    others = [k for k in named if k in out]
    return OrderedDict((k, out[k]) for k in gpus + others)


def _no_split(module: Any, classes: List[str]) -> bool:
    return isinstance(module, torch.nn.Module) and module.__class__.__name__ in classes


def get_max_layer_size(modules: List[Tuple[str, Any]], module_sizes: Dict[str, int],
                       no_split_module_classes: List[str]) -> Tuple[int, List[str]]:
    """The size and names of the largest undividable block among ``modules`` (leaves, tensors and
    modules of a class in ``no_split_module_classes``)."""
    best, names = 0, []
    queue = list(modules)
    while queue:
        name, module = queue.pop(0)
        children = [] if not isinstance(module, torch.nn.Module) else list(module.named_children())
        if not children or _no_split(module, no_split_module_classes):
            size = module_sizes[name]
            if size > best:
                best, names = size, [name]
            elif size == best:
                names.append(name)
        else:
            queue = [(f"{name}.{n}" if name else n, m) for n, m in children] + queue
    return best, names


def get_balanced_memory(model: torch.nn.Module, max_memory: Optional[Dict[Any, Union[int, str]]] = None,
                        no_split_module_classes: Optional[List[str]] = None, dtype: Any = None,
                        special_dtypes: Optional[Dict[str, Any]] = None, low_zero: bool = False) -> Dict[Any, int]:
    """A ``max_memory`` that spreads the model evenly over the GPUs (GPU 0 as little as possible
    with ``low_zero``); unchanged with fewer than two GPUs."""
    budget = get_max_memory(max_memory)
    gpus = [k for k, v in budget.items() if isinstance(k, int) and v > 0]
    if len(gpus) <= 1:
        return budget
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    top = list(model.named_parameters(recurse=False)) + list(model.named_children())
    layer, _ = get_max_layer_size(top, sizes, list(no_split_module_classes or []))
    per_gpu = sizes[""] // (len(gpus) - 1 if low_zero else len(gpus)) + layer
    for g in gpus[:-1]:
        budget[g] = min(budget[g], per_gpu)
    if low_zero:
        rest = sum(budget[g] for g in gpus[1:])
        budget[gpus[0]] = min(budget[gpus[0]], max(0, sizes[""] - rest))
    return budget


def infer_auto_device_map(model: torch.nn.Module, max_memory: Optional[Dict[Any, Union[int, str]]] = None,
                          no_split_module_classes: Optional[List[str]] = None, dtype: Any = None,
                          special_dtypes: Optional[Dict[str, Any]] = None, verbose: bool = False,
                          clean_result: bool = True, offload_buffers: bool = False,
                          fallback_allocation: bool = False) -> Dict[str, Any]:
    """``{module name: device}`` placing ``model`` in order on the devices of ``max_memory``
    (GPU indices, ``"cpu"``, then ``"disk"``), splitting modules that do not fit unless their
    class is in ``no_split_module_classes``. Works on a model built on meta. Raises ValueError
    when no device other than the disk can hold the largest undividable block (it could not run
    anywhere). ``verbose`` prints each decision; ``fallback_allocation`` is accepted (Accelerate's
    search for a smaller block to keep a device used) and ``offload_buffers`` (decided when loading)
    are accepted and have no effect (a warning says so). Local."""
    if fallback_allocation:
        no_effect("infer_auto_device_map", "fallback_allocation")
    if offload_buffers:
        no_effect("infer_auto_device_map", "offload_buffers")
    no_split = list(no_split_module_classes or [])
    if isinstance(no_split, str):
        no_split = [no_split]
    budget = get_max_memory(max_memory)
    devices = list(budget) + ([] if "disk" in budget else ["disk"])
    gpus = [d for d in devices if d not in ("cpu", "disk")]
    main = [gpus[0], "cpu"] if gpus else ["cpu"]
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    queue: List[Tuple[str, Any]] = (list(model.named_parameters(recurse=False)) + list(model.named_children())
                                    + list(model.named_buffers(recurse=False)))
    layer, layer_names = get_max_layer_size(queue, sizes, no_split)
    usable = [d for d in devices if d != "disk"]
    if layer and not any(budget.get(d, 0) >= layer for d in usable):
        raise ValueError(
            f"max_memory is too small for the largest block that cannot be split: {layer_names[:3]} needs "
            f"{human_size(layer)} and the largest budget is "
            f"{human_size(max((budget.get(d, 0) for d in usable), default=0))} ({dict(budget)}). Every layer, "
            "offloaded ones included, runs on a device: raise max_memory for one device, or let more module classes "
            "be split (no_split_module_classes)")
    device_map: Dict[str, Any] = OrderedDict()
    used: Dict[Any, int] = {}
    current = 0
    while queue:
        name, module = queue.pop(0)
        size = sizes[name]
        device = devices[current]
        limit = None if device == "disk" else budget[device] - (layer if device in main else 0)
        if limit is not None and used.get(device, 0) + size > limit:
            children = list(module.named_children()) if isinstance(module, torch.nn.Module) else []
            if not children or _no_split(module, no_split):
                if verbose:
                    print(f"{name} ({size} bytes) does not fit {device}: next device")
                current += 1
                queue.insert(0, (name, module))
            else:
                if verbose:
                    print(f"{name} ({size} bytes) does not fit {device}: split into its children")
                parts = list(module.named_parameters(recurse=False)) + children + list(module.named_buffers(recurse=False))
                queue = [(f"{name}.{n}", m) for n, m in parts] + queue
            continue
        used[device] = used.get(device, 0) + size
        device_map[name] = device
    return clean_device_map(device_map) if clean_result else dict(device_map)


def clean_device_map(device_map: Dict[str, Any], module_name: str = "") -> Dict[str, Any]:
    """Merge entries: a module whose children all go to one device is mapped as one entry."""
    prefix = f"{module_name}." if module_name else ""
    values = [v for k, v in device_map.items() if k == module_name or k.startswith(prefix)]
    if not module_name and values and len(set(map(str, values))) == 1:
        return {"": values[0]}
    if module_name and len(set(map(str, values))) == 1 and len(values) > 1:
        for k in [k for k in device_map if k.startswith(prefix)]:
            del device_map[k]
        device_map[module_name] = values[0]
    children = sorted({k[len(prefix):].split(".")[0] for k in device_map if k.startswith(prefix) and k != module_name
                       and len(k) > len(prefix)})
    for child in children:
        clean_device_map(device_map, prefix + child)
    return device_map
