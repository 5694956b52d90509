"""Weights tied across pipeline stages, kept equal as Megatron does.

A transformers model often ties its input embedding to its output head: one parameter under two
names (``model.embed_tokens.weight``, ``lm_head.weight``), which a pipeline cut puts in the first
and the last stage. Instead of refusing such models, every stage holding one of the names keeps a
copy; the copies start equal (every rank starts from rank 0's weights) and stay equal because
they receive the same gradient — the sum of every copy's gradient, which is the gradient of the
tied parameter — and the same optimizer updates:

* :meth:`TiedWeights.sync` (after the backward of the last micro-batch of an accumulation group)
  adds the copies on this process, all-reduces the sum over the processes holding the others (one
  group per tie and per pipeline, created once), and writes it back into every copy;
* :meth:`TiedWeights.counted` leaves all copies but the first stage's out of the gradient norm
  (clipping scales every copy);
* :meth:`TiedWeights.aliases` names each copy's optimizer state in checkpoints as the untied
  model does (its first name), and :meth:`TiedWeights.retie` gives a gathered state dict one
  tensor under every name, so checkpoints and ``save_model`` are those of the whole model.

Two stages on one process (the V schedules put the first and the last on pipeline rank 0) get
separate copies too (:meth:`TiedWeights.untie_local`): each stage is its own FSDP root, and FSDP
cannot shard one parameter in two roots.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from .split import StagePlan

__all__ = ["TiedWeights"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _Tie:
    """One weight tied across stages: its names, this process's copies (one per stage held here),
    the group of the processes holding copies (None when all are here), and the copy counted in
    the gradient norm (the first stage's, on the process holding it)."""

    def __init__(self, names: List[str], group: Any):
        self.names, self.group = names, group
        self.params: List[torch.nn.Parameter] = []
        self.counted: Optional[torch.nn.Parameter] = None


class TiedWeights:
    """The ties of one pipelined model (empty when it has none across stages)."""

    def __init__(self, plan: StagePlan, names: List[List[str]]):
        self.plan = plan
        self.names = names  #: each tie's names, in the whole model's order
        self._ties: List[_Tie] = []

    @classmethod
    def find(cls, model: torch.nn.Module, plan: StagePlan) -> "TiedWeights":
        """The parameters of the whole ``model`` that appear under names in different stages. Local."""
        by_id: Dict[int, List[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(name)
        return cls(plan, [names for names in by_id.values() if len({cls._stage(plan, n) for n in names}) > 1])

    @staticmethod
    def _stage(plan: StagePlan, name: str) -> int:
        return plan.stage_of(name.rpartition(".")[0])

    def untie_local(self, model: torch.nn.Module) -> None:
        """Give each stage held here its own copy of a tied weight; names within one stage keep
        sharing theirs. Local."""
        params = dict(model.named_parameters(remove_duplicate=False))
        for names in self.names:
            copies: Dict[int, torch.nn.Parameter] = {}
            for name in (n for n in names if n in params):
                stage = self._stage(self.plan, name)
                old = params[name]
                if not copies:
                    copies[stage] = old
                if stage not in copies:
                    copies[stage] = torch.nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)
                owner, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(owner), leaf, copies[stage])

    def start(self, model: torch.nn.Module, placement: Sequence[int], pp_rank: int, pp_size: int) -> None:
        """After tensor parallelism and sharding: find this process's copies and create, for each
        tie held on several pipeline ranks, the group of those ranks in every pipeline; check the
        copies are laid out alike. Collective (every rank creates every group, in the same order)."""
        import torch.distributed as dist

        world = dist.get_world_size()
        per_stage = world // pp_size
        offset = dist.get_rank() % per_stage  # pp is the outermost mesh dimension
        params = dict(model.named_parameters(remove_duplicate=False))
        for names in self.names:
            stage_of = {n: self._stage(self.plan, n) for n in names}
            holders = sorted({placement[s] for s in stage_of.values()})
            group = None
            if len(holders) > 1:
                for other in range(per_stage):
                    made = dist.new_group([r * per_stage + other for r in holders])
                    if other == offset and pp_rank in holders:
                        group = made
            tie = _Tie(names, group)
            for name in names:
                p = params.get(name)
                if p is not None and all(p is not q for q in tie.params):
                    tie.params.append(p)
                    if stage_of[name] == min(stage_of.values()):
                        tie.counted = p
            self._ties.append(tie)
        self._check_layouts()

    def _check_layouts(self) -> None:
        """Every copy must be cut alike (local shape and placements), else their gradients cannot
        be summed. Collective on the tie groups."""
        import torch.distributed as dist

        for tie in self._ties:
            layouts = {(tuple(_local(p).shape), str(getattr(p, "placements", ""))) for p in tie.params}
            if tie.group is not None:
                gathered: List[Any] = [None] * dist.get_world_size(tie.group)
                dist.all_gather_object(gathered, sorted(layouts), group=tie.group)
                layouts = {tuple(x) for g in gathered for x in g}
            if len(layouts) > 1:
                raise ValueError(f"the tied weights {tie.names} are laid out differently in their stages "
                                 f"({sorted(layouts)}); their gradients cannot be kept equal. Give both the same "
                                 "tensor-parallel style, or untie them in the model")

    def sync(self) -> None:
        """Sum each tie's gradients over its copies (this process's, then across the processes
        holding the others) into every copy. Collective on the tie groups."""
        import torch.distributed as dist

        for tie in self._ties:
            if not tie.params or (len(tie.params) == 1 and tie.group is None):
                continue  # no copy here (a middle stage), or the only one with no other to join
            for p in tie.params:  # a gradient laid out as its weight (an embedding's may come back replicated)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                elif hasattr(p, "placements") and p.grad.placements != p.placements:
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            grads = [p.grad for p in tie.params]
            total = _local(grads[0]).clone()
            for g in grads[1:]:
                total.add_(_local(g))
            if tie.group is not None:
                dist.all_reduce(total, group=tie.group)
            for g in grads:
                _local(g).copy_(total)

    def counted(self, parameters: Sequence[torch.nn.Parameter]) -> List[torch.nn.Parameter]:
        """``parameters`` without the copies another stage counts in the gradient norm. Local."""
        skip = {id(p) for tie in self._ties for p in tie.params if p is not tie.counted}
        return [p for p in parameters if id(p) not in skip]

    def add_copies(self, optimizer: torch.optim.Optimizer) -> None:
        """Put the copies made here (:meth:`untie_local`) into ``optimizer``, in the param group of
        the weight they copy. Local."""
        present = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for tie in self._ties:
            missing = [p for p in tie.params if id(p) not in present]
            home = next((g for g in optimizer.param_groups for p in g["params"]
                         if any(p is q for q in tie.params)), None)
            if missing and home is not None:
                home["params"].extend(missing)
                present.update(id(p) for p in missing)

    def aliases(self, model: torch.nn.Module) -> Dict[str, str]:
        """For each copy held here under another name than the tie's first, that first name: what
        its optimizer state is stored under in checkpoints (the untied model's name). Local."""
        held = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        return {n: names[0] for names in self.names for n in names[1:] if n in held}

    def retie(self, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """``state`` (a whole model's, gathered) with one tensor under all of a tie's names, as
        the untied model's state dict has (``save_model`` stores it once). Local."""
        for names in self.names:
            present = [n for n in names if n in state]
            for n in present[1:]:
                state[n] = state[present[0]]
        return state

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"TiedWeights({self.names})"

