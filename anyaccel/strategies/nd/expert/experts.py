"""The experts interface: what a mixture-of-experts layer hands anyaccel so that its experts can be
split over processes.

An **experts module** is an ``nn.Module`` with

* ``forward(hidden_states, top_k_index, top_k_weights)``: ``hidden_states`` ``(T, D)``,
  ``top_k_index`` ``(T, K)`` expert ids, ``top_k_weights`` ``(T, K)`` the router's weights;
  returns ``(T, D)``, ``sum_k weight[t, k] * expert[index[t, k]](hidden[t])`` — transformers 5's
  contract for its ``*Experts`` classes (Qwen3-MoE, Mixtral, ...), kept so that one dispatcher
  serves theirs and yours;
* ``num_experts``: how many experts it holds;
* its per-expert state in one of two layouts:

  - **fused**: every parameter's dimension 0 is the expert (``gate_up_proj`` ``(E, 2I, D)``,
    ``down_proj`` ``(E, D, I)``, biases ``(E, ...)``); its forward indexes them by expert id, so it
    also runs on a block of experts with ids counted from the block's start (what each ep rank
    does). :class:`FusedExperts` is anyaccel's SwiGLU one, in transformers' layout; transformers'
    own experts classes are such modules;
  - **a list**: :class:`ExpertList`, an ``nn.ModuleList`` of expert modules (each maps ``(n, D)``
    to ``(n, D)``) that also has the forward above; parameter names stay those of a plain
    ``ModuleList`` (``experts.3.w1.weight``).

The router stays yours (anything that produces ``top_k_index`` / ``top_k_weights``); put the
experts behind this interface and :func:`~anyaccel.strategies.nd.expert.shard.shard_experts` splits
them. Both classes here run the same dispatcher in one process as under ep (with no exchange).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, List, Optional

import torch

from .dispatch import moe_forward
from .group import ExpertGroup

__all__ = ["FusedExperts", "ExpertList", "RemoteExpert", "local_parameters"]


@contextlib.contextmanager
def local_parameters(module: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``module``'s own DTensor parameters are replaced by their local shards (the
    gradient still reaches the DTensor parameter), so code written for plain tensors runs on this
    rank's experts. Local."""
    swapped = {}
    for name, param in list(module._parameters.items()):
        if param is not None and hasattr(param, "to_local"):
            swapped[name] = param
            module._parameters[name] = param.to_local()
    try:
        yield
    finally:
        module._parameters.update(swapped)


class FusedExperts(torch.nn.Module):
    """``num_experts`` SwiGLU experts in fused weights, transformers' layout: ``gate_up_proj``
    ``(E, 2 * intermediate, hidden)`` (gate rows first), ``down_proj`` ``(E, hidden, intermediate)``;
    expert ``e`` computes ``down_proj[e] @ (act(gate) * up)``. ``activation`` defaults to SiLU.
    Initialised like transformers' (normal, ``std``). A checkpoint of a Qwen3-MoE/Mixtral experts
    module loads into it (same names and shapes). Local (its forward is collective once sharded)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 activation: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, std: float = 0.02):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = torch.nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = torch.nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act_fn = activation if activation is not None else torch.nn.functional.silu
        torch.nn.init.normal_(self.gate_up_proj, std=std)
        torch.nn.init.normal_(self.down_proj, std=std)

    def forward_grouped(self, rows: torch.Tensor, counts: List[int]) -> torch.Tensor:
        """``rows`` grouped by expert (``counts[e]`` rows for expert ``e`` of this module's
        parameters, in order) through their experts. Local."""
        outs = []
        for e, chunk in enumerate(torch.split(rows, counts)):
            gate, up = torch.nn.functional.linear(chunk, self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e]))
        return torch.cat(outs)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """The experts forward of the interface (module docstring), in one process. Local; once
        :func:`~.shard.shard_experts` split the module, collective over the ep group."""
        return moe_forward(hidden_states, top_k_index, top_k_weights,
                           lambda rows, counts, ids: self.forward_grouped(rows, counts), self.num_experts,
                           ExpertGroup())

    def extra_repr(self) -> str:
        e, two_i, d = self.gate_up_proj.shape
        return f"num_experts={self.num_experts}, hidden={d}, intermediate={two_i // 2}"


class ExpertList(torch.nn.ModuleList):
    """An ``nn.ModuleList`` of experts (each maps ``(n, D)`` to ``(n, D)``) with the experts forward
    ``(hidden_states, top_k_index, top_k_weights)``. Parameter names are a ``ModuleList``'s
    (``experts.3.w1.weight``), so a state dict of your existing ``ModuleList`` loads into it.
    Once sharded, the experts of other ep ranks are placeholders without parameters: this
    process's state dict holds its own experts under their unsharded names. Local (its forward is
    collective once sharded)."""

    def __init__(self, experts: Optional[Iterable[torch.nn.Module]] = None):
        super().__init__(experts)
        #: the experts this process holds (all of them until sharded)
        self.held = range(len(self))

    @property
    def num_experts(self) -> int:
        """Every expert of the layer, held here or not. Local."""
        return len(self)

    def forward_grouped(self, rows: torch.Tensor, counts: List[int]) -> torch.Tensor:
        """``rows`` grouped by held expert (``counts[l]`` rows for the ``l``-th held expert) through
        their experts; every held expert runs, on no row if it got none (so each has a gradient).
        Local."""
        chunks = torch.split(rows, counts)
        return torch.cat([self[self.held[i]](chunk) for i, chunk in enumerate(chunks)])

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """The experts forward of the interface (module docstring), in one process. Local; once
        :func:`~.shard.shard_experts` split the module, collective over the ep group."""
        return moe_forward(hidden_states, top_k_index, top_k_weights,
                           lambda rows, counts, ids: self.forward_grouped(rows, counts), self.num_experts,
                           ExpertGroup())


class RemoteExpert(torch.nn.Module):
    """Stands in an :class:`ExpertList` for an expert another ep rank holds: no parameters, and
    calling it is an error (only the dispatcher reaches experts). Local."""

    def __init__(self, index: int, owner: int):
        super().__init__()
        self.index, self.owner = index, owner

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError(f"expert {self.index} is held by ep rank {self.owner}, not by this process: call the "
                           "experts module (its forward dispatches tokens to the rank of each expert), not one expert")

    def extra_repr(self) -> str:
        return f"expert {self.index}, held by ep rank {self.owner}"
