"""Reading another checkpoint format as full states, without a DeepSpeed engine: what lets one
checkpoint move between DeepSpeed, FSDP2, DDP and one process.

* :func:`read_full_states` — full fp32 weights and the full optimizer state (torch's layout) from a
  DeepSpeed checkpoint written by anyaccel's ``save_state``, for any ZeRO stage and process count:
  the weights as DeepSpeed's ``zero_to_fp32`` merges them, the Adam moments by the same merge
  applied to the moment partitions. Other strategies load a DeepSpeed checkpoint through it
  (``anyaccel.checkpoint.training_state``); the deepspeed strategy, one of another process count.
* :func:`read_dcp_states` — an FSDP2 (torch.distributed.checkpoint) checkpoint's model 0 and
  optimizer 0 as full tensors keyed by parameter name, for the deepspeed strategy.

Every process reads the whole checkpoint: converting holds one full copy of the state per process
while it loads. Local.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from ...errors import CheckpointError
from ..dcp import nested_optimizer_state
from .checkpoint import DEEPSPEED_DIR, INDEX_FILE, _hyper

__all__ = ["read_full_states", "read_dcp_states"]


def _index(directory: str) -> Dict[str, Any]:
    path = os.path.join(directory, DEEPSPEED_DIR, INDEX_FILE)
    try:
        with open(path, "r", encoding="utf-8") as fh:
            index: Dict[str, Any] = json.load(fh)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is missing or unreadable ({exc}): this is not a DeepSpeed checkpoint written by "
                              "anyaccel's save_state") from exc
    return index


def read_full_states(directory: str) -> Tuple[Dict[str, torch.Tensor], Optional[Dict[str, Any]]]:
    """Full fp32 weights (with buffers) and the full optimizer state in torch's layout (parameters
    numbered in the saving optimizer's param-group order; None when it never stepped) from the
    DeepSpeed checkpoint under ``directory``, for any ZeRO stage and number of processes. Local
    (every process reads every file)."""
    from deepspeed.utils import zero_to_fp32 as z

    index = _index(directory)
    folder = os.path.join(directory, DEEPSPEED_DIR, index["tag"])
    with _silenced():
        model_files = z.get_model_state_files(folder)
        model_states = z.parse_model_states(model_files)
        optim_files = sorted(glob.glob(os.path.join(folder, "*_optim_states.pt")), key=z.natural_keys)
        if not optim_files:
            raise CheckpointError(f"{folder} has no optimizer partitions (*_optim_states.pt)")
        optim = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"] for f in optim_files]
    stage = int(optim[0]["zero_stage"])
    world = optim[0]["partition_count"]
    world = max(world) if isinstance(world, list) else int(world)
    if world != len(optim):
        raise CheckpointError(f"{folder}: {len(optim)} optimizer partitions for {world} processes")
    flat_key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    base_key = "optimizer_state_dict" if stage == 3 else "base_optimizer_state"

    def merged(flat_groups: List[Any]) -> Dict[str, torch.Tensor]:
        with _silenced():
            if stage == 3:
                sd = z._get_fp32_state_dict_from_zero3_checkpoint(world, flat_groups, model_states, False)
            else:
                sd = z._get_fp32_state_dict_from_zero2_checkpoint(
                    world, flat_groups, model_states, False, optim[0].get("param_alignment_paddings"))
            return z.to_torch_tensor(sd)

    weights = merged([o[flat_key] for o in optim])
    base_states = [_base_state(o[base_key]) for o in optim]
    if not base_states[0]["state"]:
        return weights, None
    per_group = base_states[0]["state"]
    sample = per_group[min(per_group)]
    element_keys = [k for k, v in sample.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
    moments = {key: merged([[s["state"][g][key] for g in sorted(s["state"])] for s in base_states])
               for key in element_keys}
    shared = {k: v for k, v in sample.items() if k not in element_keys}
    names = [n for group in index["param_names"] for n in group]
    state = {i: {**{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in shared.items()},
                 **{key: moments[key][name] for key in element_keys}} for i, name in enumerate(names)}
    groups, start = [], 0
    saved_groups = base_states[0]["param_groups"]
    for g, group_names in enumerate(index["param_names"]):
        hyper = _hyper(saved_groups[g]) if g < len(saved_groups) else {}
        groups.append({**hyper, "params": list(range(start, start + len(group_names)))})
        start += len(group_names)
    return weights, {"state": state, "param_groups": groups}


def _base_state(saved: Any) -> Dict[str, Any]:
    """DeepSpeed's saved base optimizer state as ``{"state": {group: {...}}, "param_groups": [...]}``
    (stage 1/2 may store it as a list of per-group states)."""
    if isinstance(saved, dict):
        return saved
    state, groups = {}, []
    for i, part in enumerate(saved):
        state[i] = part.get("state", part)
        groups.append(part.get("param_groups", [{}])[0] if isinstance(part.get("param_groups"), list) else {})
    return {"state": state, "param_groups": groups}


@contextlib.contextmanager
def _silenced() -> Any:
    """zero_to_fp32 prints progress and a summary to stdout/stderr: keep them out of the job's."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield


def read_dcp_states(directory: str) -> Tuple[Dict[str, torch.Tensor], Optional[Dict[str, Any]]]:
    """Full weights and the optimizer state (keyed by parameter name; None when the checkpoint has
    none) of model 0 / optimizer 0 of the torch.distributed.checkpoint (FSDP2) checkpoint under
    ``directory/sharded``. Local (every process reads all of it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    source = os.path.join(directory, "sharded")
    try:
        metadata = dcp.FileSystemReader(source).read_metadata()
        state: Dict[str, Any] = {}
        for key, meta in metadata.state_dict_metadata.items():  # the saved structure, full-size tensors
            path = (metadata.planner_data or {}).get(key, (key,))
            value = torch.empty(meta.size, dtype=meta.properties.dtype) \
                if isinstance(meta, TensorStorageMetadata) else None
            _set_path(state, path, value)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load(state, checkpoint_id=source, no_dist=True)
    except Exception as exc:  # noqa: BLE001 - DCP's own error types
        raise CheckpointError(f"{source} cannot be read as a torch.distributed.checkpoint: {exc}") from exc
    if "model_0" not in state:
        raise CheckpointError(f"{source} has no model_0")
    optimizer = state.get("optimizer_0")  # stored per parameter name, flat (dcp.save_sharded)
    return state["model_0"], None if optimizer is None else nested_optimizer_state(optimizer)


def _set_path(root: Dict[str, Any], path: Tuple[Any, ...], value: Any) -> None:
    """``root[p0][p1]... = value``, making dicts (lists where the next key is an int)."""
    node: Any = root
    for part, following in zip(path[:-1], path[1:]):
        empty: Any = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            while len(node) <= part:
                node.append(None)
            if node[part] is None:
                node[part] = empty
            node = node[part]
        else:
            node = node.setdefault(part, empty)
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value
