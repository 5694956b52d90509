"""The ``anyaccel estimate-memory`` and ``anyaccel merge-weights`` sub-commands: argument parsing
and printing only (no torch at registration; :mod:`.estimate` and :mod:`.merge` do the work).
Local to the calling process."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable, Dict, List

from ..errors import CLIError

__all__ = ["add_estimate_parser", "add_merge_parser"]

_OPTIMIZERS = ["adam", "adamw", "sgd", "sgd-momentum"]


def add_estimate_parser(subparsers: "argparse._SubParsersAction",
                        layouts: Callable[[], Dict[str, bool]]) -> argparse.ArgumentParser:
    """Register ``estimate-memory``. ``layouts()`` answers ``{strategy name: shards its state}``
    (the strategy registry's, asked only when the command runs: this layer is below it)."""
    p = subparsers.add_parser(
        "estimate-memory", help="memory per process to train a model under DDP / FSDP2 / N-D layouts",
        description="Estimate parameters, gradients, optimizer state and (with --batch-size/--seq-len) activations "
        "per process, from a model built on meta (pkg.module:factory) or a checkpoint's headers. Nothing is "
        "allocated or downloaded.")
    p.add_argument("model", help="pkg.module:factory (a callable returning an nn.Module) or a safetensors file, "
                   "Hugging Face directory or model.safetensors.index.json")
    p.add_argument("--num_processes", "--num-processes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--layout", default="all", help="a strategy that says how it holds the model's state (the "
                   "built-in ones: ddp, fsdp, nd), or all (default)")
    p.add_argument("--replicate", type=int, default=1, help="HSDP: replicas of the FSDP2 shards")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--sp", type=int, default=1, help="sequence-parallel degree (nd: activations per rank / sp)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages: the largest stage's memory per process")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (nd): the experts split over ep of the "
                   "FSDP shards")
    p.add_argument("--pp_microbatches", "--pp-microbatches", type=int, default=0,
                   help="micro-batches per batch under pp (default: --pp); activations held at once")
    p.add_argument("--optimizer", choices=_OPTIMIZERS, default="adamw")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="train in this dtype")
    p.add_argument("--batch_size", "--batch-size", type=int, default=0)
    p.add_argument("--seq_len", "--seq-len", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON rows")
    p.add_argument("--debug", action="store_true", help="show the Python traceback on errors")
    p.set_defaults(func=_estimate, layouts=layouts)
    return p


def _import_from_working_directory() -> None:
    """Make modules in the current directory importable, as they are for ``python -c`` (the
    ``anyaccel`` console script's ``sys.path`` starts with its own folder instead)."""
    import sys

    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)


def _estimate(args: argparse.Namespace) -> int:
    import torch

    from ..errors import CheckpointError
    from .estimate import estimate_memory, model_shapes
    from .sizes import human_size

    if not os.path.exists(args.model):  # pkg.module:factory, imported as `python -c` would: from here too
        _import_from_working_directory()
    try:
        shapes = model_shapes(args.model)
    except CheckpointError as exc:
        raise CLIError(str(exc)) from exc
    dtype = getattr(torch, args.dtype) if args.dtype else None
    known = args.layouts()
    if args.layout != "all" and args.layout not in known:
        raise CLIError(f"--layout {args.layout}: choose one of {', '.join(known)} or all")
    layouts = list(known) if args.layout == "all" else [args.layout]
    for flag, value in (("--sp", args.sp), ("--ep", args.ep)):  # sequence and expert parallelism: nd layouts only
        if value > 1:
            layouts = [name for name in layouts if name == "nd"]
            if not layouts:
                raise CLIError(f"{flag} {value} needs --layout nd (or all): it is a ParallelismConfig layout")
    split = args.replicate * args.tp * args.sp * args.pp
    rows: List[Dict[str, Any]] = [estimate_memory(shapes, n, layout, known[layout], args.replicate, args.tp,
                                                  args.optimizer, dtype, args.batch_size, args.seq_len, sp=args.sp,
                                                  pp=args.pp, microbatches=args.pp_microbatches, ep=args.ep)
                                  for layout in layouts for n in args.num_processes if n % split == 0]
    if not rows:
        raise CLIError(f"no process count in {args.num_processes} divides into --replicate {args.replicate} x "
                       f"--tp {args.tp} x --sp {args.sp}" + (f" x --pp {args.pp}" if args.pp > 1 else ""))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{args.model}: {rows[0]['parameters']:,} parameters")
    print(f"{'layout':<30}{'procs':>6}{'params':>12}{'grads':>12}{'optimizer':>12}{'activations':>13}{'total':>12}")
    for r in rows:
        print(f"{r['layout']:<30}{r['processes']:>6}{human_size(r['params']):>12}{human_size(r['grads']):>12}"
              f"{human_size(r['optimizer']):>12}{human_size(r['activations']):>13}{human_size(r['total']):>12}")
    if not (args.batch_size and args.seq_len):
        print("activations: pass --batch-size and --seq-len for the rough per-process term")
    return 0


def add_merge_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Register ``merge-weights``."""
    p = subparsers.add_parser(
        "merge-weights", help="merge a sharded checkpoint into one safetensors file (streaming)",
        description="Merge a sharded checkpoint (torch.distributed.checkpoint / anyaccel save_state directory, or a "
        "Hugging Face directory with model.safetensors.index.json) into one safetensors file. Tensors are streamed "
        "one at a time: memory is bounded by the largest tensor, not the model.")
    p.add_argument("checkpoint", help="the checkpoint directory (or index / file)")
    p.add_argument("output", help="the output file (*.safetensors) or directory (model.safetensors inside)")
    p.add_argument("--debug", action="store_true", help="show the Python traceback on errors")
    p.set_defaults(func=_merge)
    return p


def _merge(args: argparse.Namespace) -> int:
    from ..errors import CheckpointError
    from .merge import merge_weights
    from .sizes import human_size

    try:
        path = merge_weights(args.checkpoint, args.output)
    except (CheckpointError, OSError, ValueError) as exc:
        raise CLIError(str(exc)) from exc
    print(f"wrote {path} ({human_size(os.path.getsize(path))})")
    return 0
