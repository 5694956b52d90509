"""``anyaccel estimate-memory``: memory per process to train a model, for DDP, FSDP2 and N-D
layouts over N processes, from the model's shapes alone (nothing allocated, nothing downloaded).

The model comes from ``pkg.module:factory`` (called under ``init_empty_weights``, so it is built on
meta) or from a checkpoint's headers (a safetensors file, a Hugging Face directory or index).

Per process, with P parameters of b bytes: parameters P·b/s, gradients P·b/s (trainable
parameters), optimizer state (AdamW: two fp32 moments, 8·P/s; SGD with momentum 4·P/s; plain SGD 0),
where s is how many ways the weights are split: 1 for DDP, N/replicas for FSDP2 (HSDP with
``--replicate``; under sequence parallelism FSDP2 shards over ``dp_shard x sp``, so that is still
N/replicas), times the tensor-parallel degree. Activations, only with ``--batch-size`` and
``--seq-len``: the rough transformer estimate 34·seq·batch·hidden·layers bytes (16-bit activations,
no recomputation; Korthikanti et al. 2022), divided by the tensor-parallel degree and by the
sequence-parallel degree ``--sp`` (each sp rank holds 1/sp of every sequence; inside attention
it holds the whole sequence for 1/sp of the heads, the same amount); hidden size and layer count
are read from the shapes. Local; prints a table (or JSON).
"""

from __future__ import annotations

import collections
import importlib
import os
import re
from typing import Any, Dict, Optional, Tuple

import torch

from ..errors import CLIError
from .empty_init import init_empty_weights

__all__ = ["estimate_memory", "model_shapes"]

_OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd": 0, "sgd-momentum": 4}


def model_shapes(source: str) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """``{name: (shape, dtype)}`` of the parameters of ``source`` (``pkg.module:factory`` or a
    checkpoint path). Local."""
    if os.path.exists(source):
        from .checkpoints import open_checkpoint

        with open_checkpoint(source) as reader:
            return {k: (reader.shape(k), reader.dtype(k)) for k in reader.keys()}
    module_name, _, attr = source.partition(":")
    if not attr:
        raise CLIError(f"{source!r} is neither a file/directory nor a Python path 'pkg.module:factory'")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise CLIError(f"cannot import {source!r}: {exc}") from exc
    with init_empty_weights():
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise CLIError(f"{source} returned {type(model).__name__}, not a torch.nn.Module")
    return {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}


def _hidden_and_layers(shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]]) -> Tuple[int, int]:
    dims = collections.Counter(s[-1] for s, _ in shapes.values() if len(s) == 2)
    layers = {m.group(1) for n in shapes for m in [re.search(r"\.(\d+)\.", n)] if m}
    return (dims.most_common(1)[0][0] if dims else 0), max(len(layers), 1)


def estimate_memory(shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]], num_processes: int, layout: str,
                    sharded: bool, replicate: int = 1, tp: int = 1, optimizer: str = "adamw",
                    dtype: Optional[torch.dtype] = None, batch_size: int = 0, seq_len: int = 0,
                    sp: int = 1) -> Dict[str, Any]:
    """Bytes per process: ``params``, ``grads``, ``optimizer``, ``activations``, ``total``, under
    strategy ``layout`` (its name, for the row), which splits the state over the processes when
    ``sharded`` and keeps a full copy per process otherwise; ``sp``: the sequence-parallel degree
    (activations split by it; ``seq_len`` must be a multiple). Local."""
    if num_processes % (replicate * tp * sp):
        raise CLIError(f"{num_processes} processes do not divide into --replicate {replicate} x --tp {tp} x --sp {sp}")
    if sp > 1 and seq_len % sp:
        raise CLIError(f"--seq-len {seq_len} is not a multiple of --sp {sp}: each sp rank holds an equal slice")
    if optimizer not in _OPTIMIZER_BYTES:
        raise CLIError(f"optimizer={optimizer!r}; use one of {sorted(_OPTIMIZER_BYTES)}")
    elements = sum(_numel(s) for s, _ in shapes.values())
    param_bytes = sum(_numel(s) * torch.empty((), dtype=dtype or d).element_size() for s, d in shapes.values())
    split = tp * (num_processes // (replicate * tp) if sharded else 1)
    hidden, layers = _hidden_and_layers(shapes)
    acts = 34 * seq_len * batch_size * hidden * layers // (tp * sp) if batch_size and seq_len else 0
    split_by = f"replicate {replicate}, tp {tp}" + (f", sp {sp}" if sp > 1 else "")
    out = {"processes": num_processes, "layout": layout if replicate == tp == sp == 1 else f"{layout} ({split_by})",
           "parameters": elements,
           "params": param_bytes // split, "grads": param_bytes // split,
           "optimizer": _OPTIMIZER_BYTES[optimizer] * elements // split, "activations": acts}
    out["total"] = out["params"] + out["grads"] + out["optimizer"] + acts
    return out


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
