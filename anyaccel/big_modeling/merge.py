"""``anyaccel merge-weights CHECKPOINT OUT``: any checkpoint layout (a torch.distributed.checkpoint
directory, an anyaccel ``save_state`` directory with sharded weights, a Hugging Face sharded
directory) into one ``model.safetensors`` file, streamed.

Memory: the header is computed from the checkpoint's metadata, then each tensor is read, written
and freed before the next; peak memory is the largest tensor (twice that while a DCP reader
assembles a tensor stored in several chunks), never the model. The file is written atomically.
Local to the calling process.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from typing import Any, Dict


from ..errors import CheckpointError
from ..fileio import atomic_write
from .checkpoints import _ST_DTYPES, open_checkpoint

__all__ = ["merge_weights"]

_CODES = {v: k for k, v in _ST_DTYPES.items() if v is not None}


def merge_weights(checkpoint_dir: Any, output_path: Any, safe_serialization: bool = True,
                  remove_checkpoint_dir: bool = False) -> str:
    """Write every tensor of ``checkpoint_dir`` into one safetensors file (``output_path``, or
    ``output_path/model.safetensors`` when it is a directory); return its path. Accelerate's
    ``merge_fsdp_weights`` semantics for the arguments; ``safe_serialization=False`` is refused
    (the point is a file that needs no unpickling) and ``remove_checkpoint_dir`` is not done here
    (delete it yourself once the file is checked). Local."""
    if not safe_serialization:
        raise ValueError("merge_weights writes safetensors only (safe_serialization=True)")
    if remove_checkpoint_dir:
        raise ValueError("remove_checkpoint_dir=True: delete the checkpoint yourself after checking the merged file")
    reader = open_checkpoint(checkpoint_dir)
    out = os.path.abspath(os.fspath(output_path))
    if os.path.isdir(out) or out.endswith(os.sep) or not out.endswith(".safetensors"):
        os.makedirs(out, exist_ok=True)
        out = os.path.join(out, "model.safetensors")
    names = sorted(reader.keys())
    header: Dict[str, Any] = {}
    offset = 0
    for name in names:
        dtype = reader.dtype(name)
        if dtype not in _CODES:
            raise CheckpointError(f"{name} has dtype {dtype}, which safetensors cannot store")
        size = reader.nbytes(name)
        header[name] = {"dtype": _CODES[dtype], "shape": list(reader.shape(name)), "data_offsets": [offset, offset + size]}
        offset += size
    meta = {"format": "pt"}
    if reader.aliases():
        meta["anyaccel_aliases"] = json.dumps(reader.aliases(), sort_keys=True)
    header["__metadata__"] = meta
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(blob)))
            fh.write(blob)
            for name in names:
                tensor = reader.read(name).contiguous()
                nbytes = tensor.numel() * tensor.element_size()
                if nbytes:
                    fh.write(memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())))
                del tensor

    atomic_write(out, write)
    reader.close()
    return out
