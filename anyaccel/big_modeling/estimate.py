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
are read from the shapes.

Pipeline stages (``--pp P``): the numbered blocks (``layers.0``, ``h.1``, ...) are cut into ``P``
contiguous stages as anyaccel cuts them (earlier stages take one block more when the count does not
divide), embeddings go with the first stage and the other parameters outside the blocks (final
norm, head) with the last (from names alone: in an ``nn.Sequential`` every numbered child counts
as a block, where ``prepare`` puts an embedding and a head with their neighbours); each stage's
``N / P`` processes split its state as above, and the row is the largest stage's (every stage's
total in ``stages``). Activations per stage count its blocks and, under 1F1B with ``m``
micro-batches, the ``min(m, P - s)`` micro-batches of ``batch / m`` that stage ``s`` holds at once.
``--pp`` with ``--sp`` is refused, as ``prepare`` refuses it.

Expert parallelism (``--ep E``, nd only): the parameters under an ``experts`` module (transformers'
fused ``mlp.experts.gate_up_proj``, an ``ExpertList``'s ``experts.3.w1.weight``) are split over the
``E`` processes of an ep group and FSDP-sharded over the rest of ``dp_shard x sp`` — together over
``N / (replicas x tp)`` processes, not times ``tp`` (the experts run whole on every tp rank); the
other parameters as above. ``E`` must divide ``N / (replicas x tp x pp)``. Local; prints a table (or JSON).
"""

from __future__ import annotations

import collections
import importlib
import os
import re
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..errors import CLIError
from .empty_init import init_empty_weights

__all__ = ["estimate_memory", "model_shapes"]

_OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd": 0, "sgd-momentum": 4}
_EXPERTS = re.compile(r"(^|\.)experts(\.|$)")  # a parameter of an experts module (split by --ep)


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
                    sp: int = 1, pp: int = 1, microbatches: int = 0, ep: int = 1) -> Dict[str, Any]:
    """Bytes per process: ``params``, ``grads``, ``optimizer``, ``activations``, ``total``, under
    strategy ``layout`` (its name, for the row), which splits the state over the processes when
    ``sharded`` and keeps a full copy per process otherwise; ``sp``: the sequence-parallel degree
    (activations split by it; ``seq_len`` must be a multiple); with ``pp`` > 1 the largest pipeline
    stage's (``microbatches``: 0 means ``pp``), every stage's total in ``stages``; ``ep``: the
    expert-parallel degree (see the module's docstring). Local."""
    if num_processes % (replicate * tp * sp * pp):
        raise CLIError(f"{num_processes} processes do not divide into --replicate {replicate} x --tp {tp} x --sp {sp}"
                       + (f" x --pp {pp}" if pp > 1 else ""))
    if sp > 1 and seq_len % sp:
        raise CLIError(f"--seq-len {seq_len} is not a multiple of --sp {sp}: each sp rank holds an equal slice")
    if sp > 1 and pp > 1:
        raise CLIError(f"--sp {sp} with --pp {pp}: pipeline stages with sequence parallelism are not supported "
                       "together yet (prepare refuses them: the stages after the first would need the sequence slices "
                       "and the loss across them); estimate one of them")
    if ep > 1:
        borrowed = num_processes // (replicate * tp * pp)
        if borrowed % ep:
            raise CLIError(f"--ep {ep} does not divide the {borrowed} processes it borrows ({num_processes} / (--replicate "
                           f"{replicate} x --tp {tp} x --pp {pp})): ep splits the FSDP shards; choose a divisor of {borrowed}")
        if not any(_EXPERTS.search(name) for name in shapes):
            raise CLIError(f"--ep {ep}: the model has no parameter under an 'experts' module (e.g. "
                           "model.layers.0.mlp.experts.gate_up_proj) to split over ep ranks")
    if optimizer not in _OPTIMIZER_BYTES:
        raise CLIError(f"optimizer={optimizer!r}; use one of {sorted(_OPTIMIZER_BYTES)}")
    if pp > 1:
        m = microbatches or pp
        stages = [_estimate(part, num_processes // pp, layout, sharded, replicate, tp, optimizer, dtype,
                            batch_size, seq_len, in_flight=min(m, pp - s) / m, ep=ep)
                  for s, part in enumerate(stage_shapes(shapes, pp))]
        out = dict(max(stages, key=lambda r: r["total"]))
        out.update(processes=num_processes, parameters=sum(_numel(s) for s, _ in shapes.values()),
                   layout=f"{layout} (pp {pp}" + (f", replicate {replicate}" if replicate > 1 else "")
                   + (f", tp {tp}" if tp > 1 else "") + ")", stages=[r["total"] for r in stages])
        return out
    return _estimate(shapes, num_processes, layout, sharded, replicate, tp, optimizer, dtype, batch_size, seq_len, sp,
                     ep=ep)


def stage_shapes(shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]],
                 pp: int) -> List[Dict[str, Tuple[Tuple[int, ...], torch.dtype]]]:
    """The parameters of each of ``pp`` pipeline stages, cut at numbered blocks (see the module
    docstring). Raises :class:`CLIError` when there are fewer blocks than stages. Local."""
    found = {n: m for n in shapes for m in [re.search(r"(?:^|\.)(\d+)\.", n)] if m}
    prefixes = collections.Counter(n[:m.start(1)] for n, m in found.items())
    prefix = prefixes.most_common(1)[0][0] if prefixes else None
    index = {n: int(m.group(1)) for n, m in found.items() if n[:m.start(1)] == prefix}
    blocks = sorted(set(index.values()))
    if len(blocks) < pp:
        raise CLIError(f"--pp {pp}: the model has {len(blocks)} numbered block(s) to cut into pipeline stages")
    base, extra = divmod(len(blocks), pp)
    stage_of_block, start = {}, 0
    for s in range(pp):
        size = base + (1 if s < extra else 0)
        stage_of_block.update({b: s for b in blocks[start:start + size]})
        start += size
    parts: List[Dict[str, Tuple[Tuple[int, ...], torch.dtype]]] = [{} for _ in range(pp)]
    for name, shape in shapes.items():
        if name in index:
            stage = stage_of_block[index[name]]
        else:
            stage = 0 if re.search(r"embed|wte|wpe|tok", name) else pp - 1
        parts[stage][name] = shape
    return parts


def _estimate(shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]], num_processes: int, layout: str, sharded: bool,
              replicate: int, tp: int, optimizer: str, dtype: Optional[torch.dtype], batch_size: int, seq_len: int,
              sp: int = 1, in_flight: float = 1.0, ep: int = 1) -> Dict[str, Any]:
    elements = sum(_numel(s) for s, _ in shapes.values())
    split = tp * (num_processes // (replicate * tp) if sharded else 1)
    experts = num_processes // (replicate * tp) if sharded else ep  # ep x efsdp; whole on every tp rank
    dense, expert = [0, 0], [0, 0]  # elements, bytes: the dense parameters split by `split`, experts by `experts`
    for name, (shape, d) in shapes.items():
        part = expert if ep > 1 and _EXPERTS.search(name) else dense
        part[0] += _numel(shape)
        part[1] += _numel(shape) * torch.empty((), dtype=dtype or d).element_size()
    param_bytes = dense[1] // split + expert[1] // experts  # per process
    optimizer_bytes = _OPTIMIZER_BYTES[optimizer] * dense[0] // split + _OPTIMIZER_BYTES[optimizer] * expert[0] // experts
    hidden, layers = _hidden_and_layers(shapes)
    acts = int(34 * seq_len * batch_size * hidden * layers * in_flight) // (tp * sp) if batch_size and seq_len else 0
    split_by = f"replicate {replicate}, tp {tp}" + (f", sp {sp}" if sp > 1 else "") + (f", ep {ep}" if ep > 1 else "")
    plain = replicate == tp == sp == ep == 1
    out = {"processes": num_processes, "layout": layout if plain else f"{layout} ({split_by})", "parameters": elements,
           "params": param_bytes, "grads": param_bytes,
           "optimizer": optimizer_bytes, "activations": acts}
    out["total"] = out["params"] + out["grads"] + out["optimizer"] + acts
    return out


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
