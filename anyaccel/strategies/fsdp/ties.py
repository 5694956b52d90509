"""Tied parameters: one ``Parameter`` registered under several names, kept one through wrapping.

A tie is what ``tie_word_embeddings=True`` makes (Llama-3.2, Qwen3, Gemma: ``lm_head.weight is
model.embed_tokens.weight``), or a user's ``self.head.weight = self.embed.weight``. Both names
must stay one parameter after ``prepare``, or the job trains (and saves) two weights where the user
built one. What can split a tie, and what this module does about it:

* **Tensor parallelism** (``parallelize_module``) replaces each module's parameters by new DTensor
  parameters, one module at a time: a tie becomes two DTensors holding the same values. When both
  have the same layout — transformers' plans do: the embedding ``rowwise`` and the head
  ``colwise`` both shard the (vocab, hidden) weight on dim 0 — :func:`restore` re-points every
  name at the first one's DTensor; when the layouts differ (a plan that cuts one and not the other,
  or cuts them along different dimensions) it raises, naming both parameters and both layouts.
* **FSDP2** manages the parameters of each ``fully_shard`` unit; a parameter in two units would be
  sharded twice (torch >= 2.13 refuses it). :func:`units_keeping_ties` removes from the wrap
  policy's units those that would split a tie, so the tied parameter lands in the smallest unit
  that holds every module using it (often the root), and warns naming what moved.
* **State dicts**: a gathered full state dict holds one copy per name; :func:`share_tied_entries`
  makes the names of a tie hold one tensor again, so ``save_model`` stores it once (as DDP's
  ``state_dict`` and transformers' ``save_pretrained`` do) and ``from_pretrained`` re-ties it.

:func:`check_kept` is the defence in depth after every transformation: a tie that did not survive
is an error naming both parameters, never a silently untied model. Local; nothing here
communicates.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["Tie", "find_ties", "restore", "check_kept", "units_keeping_ties", "share_tied_entries"]


@dataclasses.dataclass(frozen=True)
class Tie:
    """One parameter held by several ``(module, attribute)`` slots. ``names``: their fully
    qualified names in registration order (``names[0]``, the first user, owns the tie);
    ``slots``: the modules and attribute names, one per name."""

    names: Tuple[str, ...]
    slots: Tuple[Tuple[torch.nn.Module, str], ...]

    def params(self) -> List[torch.nn.Parameter]:
        """What each slot holds now."""
        return [module._parameters[attr] for module, attr in self.slots]  # type: ignore[misc]

    def kept(self) -> bool:
        """Whether every slot still holds one object."""
        first, *rest = self.params()
        return all(p is first for p in rest)

    def users(self) -> List[torch.nn.Module]:
        return [module for module, _ in self.slots]


def find_ties(root: torch.nn.Module) -> List[Tie]:
    """Every parameter of ``root`` registered in two or more ``(module, attribute)`` slots. A
    module registered twice (one object under two names) is one slot: whatever replaces its
    parameters replaces them for both names. Local."""
    by_param: Dict[int, Dict[Tuple[int, str], Tuple[str, torch.nn.Module, str]]] = {}
    for prefix, module in root.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is None:
                continue
            slots = by_param.setdefault(id(param), {})
            slots.setdefault((id(module), attr), (f"{prefix}.{attr}" if prefix else attr, module, attr))
    found = []
    for slots in by_param.values():
        if len(slots) > 1:
            entries = list(slots.values())
            found.append(Tie(tuple(n for n, _, _ in entries), tuple((m, a) for _, m, a in entries)))
    return found


def _layout(t: torch.Tensor) -> str:
    spec = getattr(t, "_spec", None)
    if spec is None:
        return f"a plain tensor {tuple(t.shape)} (not parallelized)"
    mesh = spec.mesh
    dims = mesh.mesh_dim_names or tuple(range(mesh.ndim))
    return f"a DTensor {tuple(t.shape)} {list(spec.placements)} on mesh dims {list(dims)}"


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (the tensor itself for a plain tensor)."""
    local: torch.Tensor = t.to_local() if hasattr(t, "to_local") else t
    return local


def _why_not_one(first: torch.Tensor, other: torch.Tensor) -> Optional[str]:
    """Why ``other`` cannot be replaced by ``first`` (None when it can: same layout, same values)."""
    a, b = getattr(first, "_spec", None), getattr(other, "_spec", None)
    if (a is None) != (b is None):
        return "one is sharded and the other is not"
    if a is not None and b is not None and (a.mesh != b.mesh or tuple(a.placements) != tuple(b.placements)):
        return "they are sharded differently"
    if first.shape != other.shape or first.dtype != other.dtype or first.requires_grad != other.requires_grad:
        return "their shapes, dtypes or requires_grad differ"
    mine, theirs = _local(first), _local(other)
    if mine.is_meta or theirs.is_meta:
        return None  # no values yet: they are filled after sharding, once per parameter
    with torch.no_grad():
        if mine.device != theirs.device or not torch.equal(mine, theirs):
            return "they hold different values"
    return None


def restore(tied: Sequence[Tie], by: str) -> None:
    """After ``by`` (e.g. tensor parallelism) replaced parameters module by module: make every
    name of each tie hold the first name's parameter again. Allowed when the replacements have one
    layout (same mesh, placements, shape, dtype) and equal local values; otherwise ``ValueError``
    naming both parameters and their layouts — a tie is never left split. Local."""
    for tie in tied:
        params = tie.params()
        first = params[0]
        for name, (module, attr), param in zip(tie.names[1:], tie.slots[1:], params[1:]):
            if param is first:
                continue
            problem = _why_not_one(first, param)
            if problem is not None:
                what = "lays them out differently" if "sharded" in problem else "made them two parameters"
                raise ValueError(
                    f"{tie.names[0]} and {name} are one parameter (tied weights), but {by} {what} ({problem}): "
                    f"{tie.names[0]} became {_layout(first)}, {name} {_layout(param)}; trained so, they would drift "
                    "apart. Give both modules styles that shard the weight the same way (an embedding "
                    "'rowwise'/'embedding_rowwise' and a linear head 'colwise'/'colwise_gather_output' both shard "
                    "dim 0), leave both out of the plan, or untie them in the model (tie_word_embeddings=False)")
            module._parameters[attr] = first


def check_kept(tied: Sequence[Tie], by: str) -> None:
    """Raise ``RuntimeError`` naming the parameters of every tie ``by`` split (a tie anyaccel
    could not keep is an error, never a silently untied model). Local."""
    broken = [t for t in tied if not t.kept()]
    if broken:
        names = "; ".join(" and ".join(t.names) for t in broken)
        raise RuntimeError(f"{by} untied {names}: each name now holds its own parameter, so they would train apart. "
                           "Please report this (with the model and the options); meanwhile untie them in the model "
                           "or prepare it with another strategy")


def units_keeping_ties(root: torch.nn.Module, blocks: Sequence[torch.nn.Module],
                       warn: bool = True) -> List[torch.nn.Module]:
    """``blocks`` (FSDP2 units other than the root, children before parents) without those that
    would put the users of one tied parameter in different units: each tied parameter then belongs
    to the innermost block that contains all its users, or to the root. With ``warn``, says which
    units the policy asked for were not made. Local."""
    tied = find_ties(root)
    kept = list(blocks)
    if not tied or not kept:
        return kept
    names = {id(m): n for n, m in root.named_modules()}
    dropped: List[Tuple[Tie, List[torch.nn.Module], Optional[torch.nn.Module]]] = []
    changed = True
    while changed:  # dropping merges units, which may merge others: until nothing splits a tie
        changed = False
        members = {id(b): {id(m) for m in b.modules()} for b in kept}
        for tie in tied:
            users = tie.users()
            units = {next((id(b) for b in kept if id(u) in members[id(b)]), None) for u in users}
            if len(units) <= 1:
                continue
            owner = next((b for b in kept if all(id(u) in members[id(b)] for u in users)), None)
            inside = [b for b in kept if b is not owner and (owner is None or id(b) in members[id(owner)])
                      and any(id(u) in members[id(b)] for u in users)]
            kept = [b for b in kept if all(b is not d for d in inside)]
            dropped.append((tie, inside, owner))
            changed = True
            break
    if warn and dropped:
        lines = [_moved(t, [names.get(id(b), "?") for b in inside],
                        f"unit {names.get(id(owner), '?')}" if owner is not None else "the root")
                 for t, inside, owner in dropped]
        warnings.warn("FSDP: " + "; ".join(lines) + " (so the tie holds; untie the weights in the model to shard "
                      "them apart)", stacklevel=4)
    return kept


def _moved(tie: Tie, units: List[str], owner: str) -> str:
    made = f"{units[0]} a unit of its own" if len(units) == 1 else f"{', '.join(units)} units of their own"
    return (f"{' and '.join(tie.names)} are one parameter (tied weights); the wrap policy made {made}, which would "
            f"shard it twice: {'it is' if len(units) == 1 else 'they are'} sharded with {owner} instead")


def share_tied_entries(root: torch.nn.Module, state: Dict[str, Any]) -> Dict[str, Any]:
    """``state`` (a full state dict of ``root``, e.g. gathered from shards) with every name of a
    tie holding the first name's tensor, as ``root.state_dict()`` of an unsharded model does (so
    the tensor is stored once). Returns ``state``, changed in place. Local."""
    for tie in find_ties(root):
        if tie.names[0] not in state:
            continue
        for name in tie.names[1:]:
            if name in state:
                state[name] = state[tie.names[0]]
    return state
