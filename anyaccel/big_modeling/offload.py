"""The disk offload folder: one raw ``<name>.dat`` file per tensor plus ``index.json``
(``{name: {"dtype", "shape"}}``, or ``{"safetensors_file", "weight_name"}`` for weights read in
place from a checkpoint). The same format as Accelerate's offload folders, so folders written by
either load in the other. Files are written and memory-mapped through torch (no NumPy).

Everything here is local to the calling process.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional

import torch

from ..fileio import atomic_write_bytes

__all__ = ["offload_weight", "load_offloaded_weight", "save_offload_index", "offload_state_dict",
           "PrefixedDataset", "OffloadedWeightsLoader", "extract_submodules_state_dict", "check_writable"]

# dtypes stored under another name (NumPy has no bfloat16/float8; Accelerate stores their bits as ints)
_STORED_AS = {"bfloat16": torch.int16, "float8_e4m3fn": torch.int8, "float8_e5m2": torch.int8}


def _dtype(name: str) -> torch.dtype:
    name = name.replace("torch.", "")
    aliases = {"float": "float32", "double": "float64", "half": "float16", "bool_": "bool"}
    return getattr(torch, aliases.get(name, name))


def check_writable(folder: Any) -> str:
    """Create ``folder`` when needed and prove it is writable (a temporary file); raise a
    ``PermissionError`` naming it otherwise. Local."""
    folder = os.path.abspath(os.fspath(folder))
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".anyaccel-probe-"):
            pass
    except OSError as exc:
        raise PermissionError(f"offload folder {folder} is not writable ({exc.strerror or exc}); pass an "
                              "offload_folder on a disk with room for the offloaded weights") from exc
    return folder


def offload_weight(weight: torch.Tensor, weight_name: str, offload_folder: str,
                   index: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
    """Write ``weight`` to ``offload_folder/<weight_name>.dat`` and record it in ``index``."""
    dtype_name = str(weight.dtype).replace("torch.", "")
    flat = weight.detach().to("cpu").contiguous().reshape(-1)
    path = os.path.join(offload_folder, f"{weight_name}.dat")
    nbytes = flat.numel() * flat.element_size()
    if index is not None:
        index[weight_name] = {"dtype": dtype_name, "shape": list(weight.shape)}
    if nbytes == 0:
        open(path, "wb").close()
        return index
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
    torch.empty(0, dtype=flat.dtype).set_(storage, 0, flat.shape).copy_(flat)
    del storage
    return index


def load_offloaded_weight(weight_file: str, weight_info: Dict[str, Any]) -> torch.Tensor:
    """The tensor in ``weight_file`` (memory-mapped, read lazily), as ``weight_info`` describes."""
    shape = tuple(weight_info["shape"])
    numel = 1
    for d in shape:
        numel *= d
    dtype = _dtype(weight_info["dtype"])
    stored = _STORED_AS.get(weight_info["dtype"], dtype)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.from_file(weight_file, shared=False, size=numel, dtype=stored)
    return flat.view(dtype).reshape(shape) if stored != dtype else flat.reshape(shape)


def save_offload_index(index: Dict[str, Any], offload_folder: str) -> None:
    """Merge ``index`` into ``offload_folder/index.json`` (written atomically)."""
    if not index:
        return
    path = os.path.join(offload_folder, "index.json")
    current: Dict[str, Any] = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            current = json.load(fh)
    current.update(index)
    atomic_write_bytes(path, json.dumps(current, indent=2).encode())


def offload_state_dict(save_dir: Any, state_dict: Dict[str, torch.Tensor]) -> None:
    """Write every tensor of ``state_dict`` into ``save_dir`` with its index."""
    save_dir = check_writable(save_dir)
    index: Dict[str, Any] = {}
    for name, tensor in state_dict.items():
        offload_weight(tensor, name, save_dir, index=index)
    save_offload_index(index, save_dir)


class PrefixedDataset(Mapping):
    """The entries of ``dataset`` under ``prefix``, keyed without it."""

    def __init__(self, dataset: Mapping, prefix: str):
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, key: str) -> Any:
        return self.dataset[f"{self.prefix}{key}"]

    def __iter__(self) -> Iterator[str]:
        return iter(k[len(self.prefix):] for k in self.dataset if k.startswith(self.prefix))

    def __len__(self) -> int:
        return sum(1 for k in self.dataset if k.startswith(self.prefix))


class OffloadedWeightsLoader(Mapping):
    """Weights by name, from ``state_dict`` (first) or from the offload folder's index; tensors on
    disk are read when asked for (safetensors files in place, ``.dat`` files memory-mapped)."""

    def __init__(self, state_dict: Optional[Dict[str, torch.Tensor]] = None, save_folder: Optional[str] = None,
                 index: Optional[Mapping] = None, device: Any = None):
        if state_dict is None and save_folder is None and index is None:
            raise ValueError("OffloadedWeightsLoader needs a state_dict, a save_folder or an index")
        self.state_dict = {} if state_dict is None else state_dict
        self.save_folder = save_folder
        if index is None and save_folder is not None:
            path = os.path.join(save_folder, "index.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{save_folder} has no index.json: it is not an offload folder "
                                        "(write one with offload_state_dict or disk_offload)")
            with open(path, encoding="utf-8") as fh:
                index = json.load(fh)
        self.index = dict(index or {})
        self.all_keys: List[str] = list(self.state_dict) + [k for k in self.index if k not in self.state_dict]
        self.device = device
        self._handles: Dict[str, Any] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state_dict:
            return self.state_dict[key]
        info = self.index[key]
        if info.get("safetensors_file") is not None:
            file = info["safetensors_file"]
            if file not in self._handles:
                from safetensors import safe_open

                self._handles[file] = safe_open(file, framework="pt", device="cpu")
            tensor = self._handles[file].get_tensor(info.get("weight_name", key))
            if "dtype" in info:
                tensor = tensor.to(_dtype(info["dtype"]))
        else:
            tensor = load_offloaded_weight(os.path.join(self.save_folder or "", f"{key}.dat"), info)
        return tensor if self.device is None else tensor.to(self.device)

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)


def extract_submodules_state_dict(state_dict: Dict[str, torch.Tensor], submodule_names: List[str]) -> Dict[str, torch.Tensor]:
    """The entries of ``state_dict`` that belong to one of ``submodule_names``."""
    return {k: v for k, v in state_dict.items()
            if any(k == m or k.startswith(m + ".") for m in submodule_names)}
