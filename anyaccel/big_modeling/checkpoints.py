"""Read model weights one tensor (or one slice) at a time, whatever the layout on disk.

:func:`open_checkpoint` takes

* one ``.safetensors`` file (read through ``safe_open``: a slice reads only its bytes);
* a directory in the Hugging Face layout: ``model.safetensors``, or shards listed by
  ``model.safetensors.index.json`` (``save_pretrained``, anyaccel's ``save_model``); the
  ``pytorch_model*.bin`` variants are memory-mapped (``torch.load(mmap=True)``);
* a ``torch.distributed.checkpoint`` directory (one with ``.metadata``), or an anyaccel
  ``save_state`` directory holding one under ``sharded/`` (the model's keys are those under
  ``model_0.``).

and returns a :class:`CheckpointReader` with the names, shapes and dtypes (from headers, nothing
read) and ``read``/``read_slice``. :func:`check_checkpoint` compares those with a model before
anything is loaded: missing keys, unexpected keys and wrong shapes are named in one error.

Everything here is local to the calling process.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..errors import CheckpointError

__all__ = ["CheckpointReader", "open_checkpoint", "check_checkpoint", "model_tensor_shapes", "tied_names"]

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
              "F8_E5M2": getattr(torch, "float8_e5m2", None)}


class CheckpointReader:
    """Names, shapes and dtypes of a checkpoint's tensors, and reads of one tensor or one slice
    (a tuple of ``slice`` objects, one per dimension). Local."""

    kind = "?"
    path = ""

    def keys(self) -> List[str]:
        raise NotImplementedError

    def shape(self, name: str) -> Tuple[int, ...]:
        raise NotImplementedError

    def dtype(self, name: str) -> torch.dtype:
        raise NotImplementedError

    def read(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def read_slice(self, name: str, index: Tuple[slice, ...]) -> torch.Tensor:
        return self.read(name)[index]

    def read_into(self, name: str, index: Tuple[slice, ...], out: torch.Tensor) -> bool:
        """Read slice ``index`` of ``name`` straight into ``out`` when the layout allows it (no
        intermediate copy); return False (nothing read) when the caller must use ``read_slice``."""
        return False

    def file_of(self, name: str) -> Optional[str]:
        """The safetensors file holding ``name`` (offload indexes point at it instead of copying)."""
        return None

    def aliases(self) -> Dict[str, str]:
        """Tied names stored once: ``{dropped name: stored name}`` (anyaccel's ``save_model``)."""
        return {}

    def nbytes(self, name: str) -> int:
        shape = self.shape(name)
        n = 1
        for d in shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype(name)).element_size()

    def close(self) -> None:
        pass

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Safetensors(CheckpointReader):
    kind = "safetensors"

    def __init__(self, path: str, weight_map: Dict[str, str]):
        from safetensors import safe_open

        self.path = path
        self._map = weight_map
        self._handles: Dict[str, Any] = {}
        self._aliases: Dict[str, str] = {}
        self._headers: Dict[str, Dict[str, Any]] = {}
        self._base: Dict[str, int] = {}
        self._fds: Dict[str, int] = {}
        for file in sorted(set(weight_map.values())):
            try:
                handle = safe_open(file, framework="pt", device="cpu")
            except Exception as exc:  # noqa: BLE001 - safetensors has its own error types
                raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from exc
            self._handles[file] = handle
            self._aliases.update(json.loads((handle.metadata() or {}).get("anyaccel_aliases", "{}")))
        missing = [k for k, f in weight_map.items() if k not in self._handles[f].keys()]
        if missing:
            raise CheckpointError(f"{path}: the index lists {missing[:5]} in files that do not contain them")

    def keys(self) -> List[str]:
        return list(self._map)

    def _slice(self, name: str) -> Any:
        try:
            return self._handles[self._map[name]].get_slice(name)
        except KeyError:
            raise CheckpointError(f"{self.path} has no tensor {name!r}") from None

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        code = self._slice(name).get_dtype()
        if _ST_DTYPES.get(code) is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} has dtype {code}, which this torch cannot hold")
        return _ST_DTYPES[code]

    def read(self, name: str) -> torch.Tensor:
        """A fresh tensor read with ``pread`` (no memory map stays resident), or through safe_open."""
        info = self._header(self._map[name]).get(name) if name in self._map else None
        if info and _ST_DTYPES.get(info["dtype"]) is not None and info["shape"]:
            out = torch.empty(info["shape"], dtype=_ST_DTYPES[info["dtype"]])
            if self.read_into(name, (), out):
                return out
        return self._handles[self._map[name]].get_tensor(name)

    def read_slice(self, name: str, index: Tuple[slice, ...]) -> torch.Tensor:
        if not index:
            return self.read(name)
        return self._slice(name)[index]

    def read_into(self, name: str, index: Tuple[slice, ...], out: torch.Tensor) -> bool:
        """Rows ``index[0]`` of a tensor (its other dimensions whole) are one byte range of the file:
        read it with ``pread`` into ``out``'s memory. Neither a memory map nor a temporary holds
        the bytes, so the process's resident memory grows by ``out`` alone."""
        file = self._map.get(name)
        if file is None or out.device.type != "cpu" or not out.is_contiguous() or out.numel() == 0:
            return False
        info = self._header(file).get(name)
        shape = info["shape"] if info else None
        if not info or _ST_DTYPES.get(info["dtype"]) != out.dtype or not shape:
            return False
        rows = index[0] if index else slice(0, shape[0])
        if any(s.start != 0 or s.stop != n for s, n in zip(index[1:], shape[1:])):
            return False
        row_bytes = out.element_size()
        for n in shape[1:]:
            row_bytes *= n
        nbytes = (rows.stop - rows.start) * row_bytes
        if nbytes != out.numel() * out.element_size():
            return False
        offset = self._base[file] + info["data_offsets"][0] + rows.start * row_bytes
        view = memoryview((ctypes.c_char * nbytes).from_address(out.data_ptr())).cast("B")
        fd = self._fds.setdefault(file, os.open(file, os.O_RDONLY))
        done = 0
        while done < nbytes:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"{file} ends before tensor {name!r} does: the file is truncated")
            done += got
        return True

    def _header(self, file: str) -> Dict[str, Any]:
        if file not in self._headers:
            with open(file, "rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                self._headers[file] = json.loads(fh.read(size))
            self._base[file] = 8 + size
        return self._headers[file]

    def file_of(self, name: str) -> Optional[str]:
        return self._map.get(name)

    def aliases(self) -> Dict[str, str]:
        return dict(self._aliases)

    def close(self) -> None:
        self._handles.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class _TorchBins(CheckpointReader):
    """``pytorch_model*.bin``: memory-mapped, so a slice touches only its pages."""

    kind = "torch"

    def __init__(self, path: str, files: Sequence[str]):
        self.path = path
        self._state: Dict[str, torch.Tensor] = {}
        for file in files:
            try:
                part = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as exc:  # noqa: BLE001
                raise CheckpointError(f"{file} cannot be read as a torch checkpoint: {exc}") from exc
            self._state.update({k: v for k, v in part.items() if isinstance(v, torch.Tensor)})

    def keys(self) -> List[str]:
        return list(self._state)

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._state[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._state[name].dtype

    def read(self, name: str) -> torch.Tensor:
        return self._state[name].clone()

    def read_slice(self, name: str, index: Tuple[slice, ...]) -> torch.Tensor:
        return self._state[name][index].clone()


class _DCP(CheckpointReader):
    """A torch.distributed.checkpoint directory; reads one tensor at a time (``no_dist``)."""

    kind = "dcp"

    def __init__(self, path: str, prefix: str):
        import torch.distributed.checkpoint as dcp

        self.path = path
        self.prefix = prefix
        meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        self._meta = {k[len(prefix):]: v for k, v in meta.items()
                      if k.startswith(prefix) and hasattr(v, "size") and hasattr(v, "properties")}

    def keys(self) -> List[str]:
        return list(self._meta)

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._meta[name].size)

    def dtype(self, name: str) -> torch.dtype:
        return self._meta[name].properties.dtype

    def read(self, name: str) -> torch.Tensor:
        import warnings

        import torch.distributed.checkpoint as dcp

        out = torch.empty(self.shape(name), dtype=self.dtype(name))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load({self.prefix + name: out}, checkpoint_id=self.path, no_dist=True)
        return out


def _dcp_prefix(path: str) -> str:
    import torch.distributed.checkpoint as dcp

    keys = list(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    for prefix in ("model_0.", "model."):  # anyaccel save_state; torchtitan/Accelerate style
        if keys and any(k.startswith(prefix) for k in keys):
            return prefix
    return ""


def open_checkpoint(checkpoint: Any) -> CheckpointReader:
    """A reader for ``checkpoint`` (a file or a directory, layouts above). Local. Raises
    :class:`~anyaccel.errors.CheckpointError` saying what was found when nothing fits."""
    path = os.path.abspath(os.fspath(checkpoint))
    if os.path.isfile(path):
        if path.endswith(".index.json"):
            return _from_index(path)
        if path.endswith(".safetensors"):
            return _Safetensors(path, _weight_map_of([path]))
        return _TorchBins(path, [path])
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    for sub in ("", "sharded"):
        if os.path.isfile(os.path.join(path, sub, ".metadata")):
            where = os.path.join(path, sub)
            return _DCP(where, _dcp_prefix(where))
    entries = sorted(os.listdir(path))
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if index in entries:
            return _from_index(os.path.join(path, index))
    safes = [e for e in entries if e.endswith(".safetensors")]
    if safes:
        files = [os.path.join(path, e) for e in safes]
        return _Safetensors(path, _weight_map_of(files))
    bins = [e for e in entries if e.endswith(".bin") and ("model" in e)]
    if bins:
        return _TorchBins(path, [os.path.join(path, e) for e in bins])
    raise CheckpointError(f"{path} holds no weights anyaccel can read: expected a .safetensors file, "
                          "model.safetensors.index.json, pytorch_model*.bin or a torch.distributed.checkpoint "
                          f"directory (.metadata); found {entries[:10]}")


def _weight_map_of(files: Iterable[str]) -> Dict[str, str]:
    from safetensors import safe_open

    out: Dict[str, str] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as fh:
                out.update({k: file for k in fh.keys()})
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from exc
    return out


def _from_index(index_path: str) -> CheckpointReader:
    folder = os.path.dirname(index_path)
    try:
        with open(index_path) as fh:
            weight_map = json.load(fh)["weight_map"]
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{index_path} is not a checkpoint index (a JSON object with 'weight_map'): {exc}") \
            from exc
    files = {k: os.path.join(folder, f) for k, f in weight_map.items()}
    absent = sorted({f for f in files.values() if not os.path.isfile(f)})
    if absent:
        raise CheckpointError(f"{index_path} lists files that are not there: {absent[:5]}")
    if index_path.endswith(".safetensors.index.json"):
        return _Safetensors(folder, files)
    return _TorchBins(folder, sorted(set(files.values())))


def model_tensor_shapes(model: torch.nn.Module) -> Dict[str, Tuple[int, ...]]:
    """The global shape of every entry of ``model.state_dict()`` (a sharded DTensor's full shape)."""
    return {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}


def tied_names(model: torch.nn.Module) -> Dict[str, str]:
    """``{name: first name of the same parameter}`` for parameters registered under several names."""
    first: Dict[int, str] = {}
    tied: Dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


def check_checkpoint(model: torch.nn.Module, reader: CheckpointReader, strict: bool = False,
                     must_load: Optional[Iterable[str]] = None) -> Dict[str, str]:
    """Compare ``reader`` with ``model`` before anything is loaded; return ``{model key: checkpoint
    key}`` of what to load.
    Wrong shapes always raise; keys the model has and the checkpoint lacks raise when ``strict``
    or when they are in ``must_load`` (tensors with no value yet, e.g. on meta); unexpected keys
    raise when ``strict``. Tied parameters need only one of their names. Local."""
    import warnings

    shapes = model_tensor_shapes(model)
    stored = set(reader.keys())
    aliases = reader.aliases()
    tied = tied_names(model)
    source = {k: (k if k in stored else aliases.get(k, tied.get(k, k))) for k in shapes}
    missing = sorted(k for k, s in source.items() if s not in stored)
    wrong = [f"{k}: checkpoint {list(reader.shape(source[k]))}, model {list(s)}" for k, s in shapes.items()
             if source[k] in stored and tuple(reader.shape(source[k])) != s]
    unexpected = sorted(stored - set(shapes) - set(aliases.values()))
    needed = set(must_load or ()) & set(missing)
    problems = []
    if wrong:
        problems.append(f"{len(wrong)} tensors have other shapes than the model's: " + "; ".join(wrong[:10]))
    if missing and (strict or needed):
        problems.append(f"{len(missing)} model keys are not in the checkpoint: {missing[:10]}"
                        + (" (they have no value yet: the model was built on meta)" if needed else ""))
    if unexpected and strict:
        problems.append(f"{len(unexpected)} checkpoint keys are not in the model: {unexpected[:10]}")
    if problems:
        raise CheckpointError(f"checkpoint {reader.path} does not fit this model; nothing was loaded. "
                              + " ".join(problems) + ". Check that the checkpoint was saved from this model class "
                              "and configuration.")
    if missing or unexpected:
        warnings.warn(f"checkpoint {reader.path}: {len(missing)} model keys not in it (kept as they are: "
                      f"{missing[:5]}), {len(unexpected)} keys not in the model (ignored: {unexpected[:5]})",
                      stacklevel=4)
    return {k: s for k, s in source.items() if s in stored}
