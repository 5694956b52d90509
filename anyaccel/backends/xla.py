"""XLA devices (TPU, or torch-xla's CPU device for tests) through torch-xla.

The only module of anyaccel that imports ``torch_xla``; it is imported only once the resolved
environment says the device is XLA (:func:`anyaccel.backends.create_backend`), so ``import
anyaccel`` never loads torch-xla.

:class:`XlaBackend` (the Backend), :class:`XlaTransport` (collectives) and the replica strategy
(:mod:`anyaccel.strategies.xla`) are written on the functions below. Who calls what, and across
which replicas:

* :func:`refine_environment`, :func:`device`, :func:`world_size` — local; read torch-xla's runtime
  (one replica per XLA device; torch-xla, not a launcher, owns the topology).
* :func:`all_gather`, :func:`all_gather_uneven`, :func:`gather_sizes`, :func:`all_reduce`,
  :func:`broadcast`, :func:`gather_object`, :func:`broadcast_object_list`, :func:`rendezvous`,
  :func:`reduce_gradients`, :func:`reduce_gradients_early`, :func:`broadcast_parameters` —
  **collective**: every replica calls them in the same order with tensors of the same shapes (XLA
  compiles one program per replica; a replica that skips a collective hangs the others).
* :func:`mark_step` — local: runs the graph recorded so far on this replica's device.
* :meth:`XlaBackend.feed` — torch-xla's parallel loader moves this replica's batches to the
  device in a background thread (the prepared loader counts what the loop consumed).
* :meth:`XlaBackend.host_copy` — see its docstring for the one XLA rule about saving.
* :func:`spawn` — ``notebook_launcher`` on TPU: one process per XLA device.

What differs between one replica and many is deliberately small: the collectives are the same
calls for any world size (torch-xla short-circuits them for one replica), except
:func:`reduce_gradients` (skipped for one replica, exactly like ``xm.reduce_gradients``) and
:func:`broadcast_parameters` (same). See ``tests/xla/test_xla.py`` for what runs for real on
torch-xla's CPU device and where the simulation boundary lies.

Why this module is longer than ~450 lines: it is the one place that may import torch-xla, so the
device's backend, its collective transport and the few functions both are written on stay
together; splitting it would put torch-xla imports in several files.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any, Callable, List, Optional, Sequence

import torch

import torch_xla  # noqa: F401  (this module is only imported on XLA)
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr

from .base import Backend
from .transport import Transport

__all__ = [
    "refine_environment",
    "device",
    "world_size",
    "rank",
    "mark_step",
    "all_gather",
    "all_gather_uneven",
    "gather_sizes",
    "all_reduce",
    "broadcast",
    "gather_object",
    "broadcast_object_list",
    "rendezvous",
    "reduce_gradients",
    "reduce_gradients_early",
    "move_model",
    "broadcast_parameters",
    "spawn",
    "XlaBackend",
    "XlaTransport",
]


# --------------------------------------------------------------------------------------------
# Topology and device
# --------------------------------------------------------------------------------------------


def device() -> torch.device:
    """This replica's XLA device (e.g. ``xla:0``). Local."""
    fn = getattr(torch_xla, "device", None)
    return fn() if fn is not None else xm.xla_device()


def world_size() -> int:
    """Number of XLA replicas in the job (1 outside ``xmp.spawn``/``torch_xla.launch``). Local."""
    return int(xr.world_size())


def rank() -> int:
    """This replica's global ordinal, ``0 .. world_size()-1``. Local."""
    return int(xr.global_ordinal())


def refine_environment(env: Any) -> Any:
    """Return ``env`` with the replica topology read from torch-xla's runtime.

    Called by every replica right after :func:`anyaccel.environment.resolve_environment` (which
    only records *that* the device is XLA). Local; initialises the XLA runtime (which is why
    this is not done during environment resolution).
    """
    dev = device()
    world = world_size()
    local_world = max(1, int(xr.local_device_count())) if world > 1 else 1
    global_rank = rank()
    local_rank = int(xr.local_ordinal()) if world > 1 else 0
    num_nodes = max(1, -(-world // local_world))
    node_rank = _host_index() if world > 1 else 0
    return dataclasses.replace(
        env,
        world_size=world,
        rank=global_rank,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=min(node_rank, num_nodes - 1),
        num_nodes=num_nodes,
        device_type="xla",
        device_index=dev.index,
        backend="xla",
        source="xla",
    )


def _host_index() -> int:
    try:
        return int(xr.host_index())
    except Exception:  # noqa: BLE001 - older runtimes / plugins without host_index
        return 0


def mark_step() -> None:
    """Cut the lazily recorded graph here and run it on this replica's device. Local (but the
    graph may contain collectives: every replica must reach the same mark steps)."""
    sync = getattr(torch_xla, "sync", None)
    if sync is not None:
        sync()
    else:  # pragma: no cover - torch-xla < 2.6
        xm.mark_step()


# --------------------------------------------------------------------------------------------
# Tensor collectives (every replica calls them with the same shapes)
# --------------------------------------------------------------------------------------------


def all_gather(t: torch.Tensor) -> torch.Tensor:
    """Concatenate every replica's ``t`` along dim 0, in ordinal order; 0-d tensors become 1-d.
    Collective; all replicas receive the result."""
    if t.dim() == 0:
        t = t.unsqueeze(0)
    return xm.all_gather(t, dim=0)


def gather_sizes(t: torch.Tensor, dim: int = 0) -> List[int]:
    """Every replica's ``t.shape[dim]``, in ordinal order. Collective; runs the pending graph."""
    size = torch.tensor([t.shape[dim] if t.dim() else 1], dtype=torch.int64, device=t.device)
    return [int(s) for s in xm.all_gather(size, dim=0).cpu().tolist()]


def all_gather_uneven(t: torch.Tensor) -> torch.Tensor:
    """Like :func:`all_gather` but replicas may hold different sizes along dim 0 (the last batch
    of an iterable dataset): sizes are exchanged, padded, gathered, and the padding removed.
    Collective."""
    if t.dim() == 0:
        t = t.unsqueeze(0)
    sizes = gather_sizes(t, 0)
    top = max(sizes)
    if all(s == top for s in sizes):
        return all_gather(t)
    if t.shape[0] < top:
        pad = t.new_zeros((top - t.shape[0],) + tuple(t.shape[1:]))
        t = torch.cat([t, pad], dim=0)
    full = all_gather(t)
    return torch.cat([full[r * top : r * top + n] for r, n in enumerate(sizes)], dim=0)


def all_reduce(t: torch.Tensor, reduction: str = "sum", scale: float = 1.0) -> torch.Tensor:
    """Sum (``"sum"``) or average (``"mean"``) ``t`` over replicas, times ``scale``; integer
    tensors are averaged as floats. Collective; all replicas receive the result; ``t`` is not
    modified.

    The scale is applied here, not by ``xm.all_reduce``: torch-xla ignores ``scale`` when there
    is a single replica, which would make ``reduce(x, "mean", scale=2)`` differ between one and
    several TPU cores.
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean' on XLA, got {reduction!r}")
    if reduction == "mean" and not (t.is_floating_point() or t.is_complex()):
        t = t.float()
    out = xm.all_reduce(xm.REDUCE_SUM, t)
    factor = scale / world_size() if reduction == "mean" else scale
    return out * factor if factor != 1.0 else out


def broadcast(t: torch.Tensor, from_process: int = 0) -> torch.Tensor:
    """Every replica receives replica ``from_process``'s ``t`` (same shape everywhere).
    Collective; ``t`` itself is not modified."""
    out = t.detach().clone()
    xm.collective_broadcast([out], root_ordinal=from_process)
    return out


# --------------------------------------------------------------------------------------------
# Python objects (pickled through XLA's rendezvous, which runs the pending graph)
# --------------------------------------------------------------------------------------------


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(_to_cpu(obj), buf)  # torch.save: tensors inside objects are supported
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def gather_object(obj: Any) -> List[Any]:
    """Every replica's ``obj`` (picklable; XLA tensors inside are moved to the CPU), as a list in
    ordinal order. Collective; all replicas receive the list."""
    return [_loads(p) for p in xm.rendezvous("anyaccel.gather_object", _dumps(obj))]


def broadcast_object_list(objects: Sequence[Any], from_process: int = 0) -> List[Any]:
    """Replica ``from_process``'s ``objects`` (a list of picklable objects), returned on every
    replica. Collective; the other replicas' lists are only used for their length."""
    payload = _dumps(list(objects)) if rank() == from_process else b""
    parts = xm.rendezvous("anyaccel.broadcast_object_list", payload)
    received = _loads(parts[from_process])
    if len(received) != len(objects):
        raise ValueError(f"broadcast_object_list: replica {from_process} sent {len(received)} objects, "
                         f"replica {rank()} expected {len(objects)}; pass lists of the same length everywhere")
    return received


def rendezvous(tag: str) -> None:
    """Barrier: returns on each replica once all replicas reached the rendezvous ``tag``.
    Collective (and runs the pending graph first)."""
    xm.rendezvous(tag)


# --------------------------------------------------------------------------------------------
# Gradients and parameters (the only functions that do nothing for a single replica)
# --------------------------------------------------------------------------------------------

_REDUCED = "_anyaccel_xla_gradients_reduced"


def reduce_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Average the gradients of ``optimizer``'s parameters over all replicas, just before its
    step (``xm.optimizer_step`` semantics; the optimizer wrapper calls it on sync steps only).
    Collective. A no-op for one replica, and a no-op when :func:`reduce_gradients_early`
    already reduced this step's gradients (e.g. before clipping). Raises ``RuntimeError`` when the
    optimizer holds parameters that are not on the XLA device (it would silently train nothing)."""
    if optimizer.__dict__.pop(_REDUCED, False):
        return
    _reduce(optimizer)


def reduce_gradients_early(optimizer: torch.optim.Optimizer) -> None:
    """Average the gradients now (before ``clip_grad_norm_``, so the norm is the global one) and
    remember it, so that the coming :func:`reduce_gradients` does not average twice.
    Collective; idempotent until the next optimizer step."""
    if optimizer.__dict__.get(_REDUCED, False):
        return
    _reduce(optimizer)
    optimizer.__dict__[_REDUCED] = True


_CHECKED = "_anyaccel_xla_params_checked"


def _check_parameters_on_xla(optimizer: torch.optim.Optimizer) -> None:
    """Once per parameter count: every parameter the optimizer updates lives on the XLA device."""
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    if optimizer.__dict__.get(_CHECKED) == count:
        return
    stray = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if p.device.type != "xla"]
    if stray:
        raise RuntimeError(
            f"the optimizer updates {len(stray)} parameter(s) that are not on the XLA device (shapes "
            f"{stray[:3]}): it holds another copy of the model's parameters, so the model would never change. "
            "Build the optimizer from the model you pass to accelerator.prepare() and prepare them together "
            "(with device placement on)."
        )
    optimizer.__dict__[_CHECKED] = count


def _reduce(optimizer: torch.optim.Optimizer) -> None:
    _check_parameters_on_xla(optimizer)
    if world_size() <= 1:
        return
    if not any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
        return  # nothing to reduce (torch-xla would crash on an empty list)
    xm.reduce_gradients(optimizer)


def move_model(model: torch.nn.Module, target: torch.device) -> torch.nn.Module:
    """Move ``model`` to the XLA device *keeping its Parameter objects* and make every replica
    start from replica 0's weights; returns the model.

    A plain ``model.to(xla)`` replaces each ``nn.Parameter`` by a new object (CPU and XLA tensors
    cannot share storage), so an optimizer built before ``prepare`` — the usual order — would keep
    updating the stale CPU copies while the model never learns. Here the parameters are swapped
    in place (``torch.utils.swap_tensors``), as ``.to("cuda")`` effectively does on GPUs.
    Collective (the weight broadcast) when there are several replicas.
    """
    future = torch.__future__
    previous = future.get_swap_module_params_on_conversion()
    future.set_swap_module_params_on_conversion(True)
    try:
        model = model.to(target)
    finally:
        future.set_swap_module_params_on_conversion(previous)
    broadcast_parameters(model)
    return model


def broadcast_parameters(model: torch.nn.Module) -> None:
    """Copy replica 0's parameters and buffers to every replica, so replicas start identical
    even when the user did not seed them alike (what DDP does on GPUs). Collective; a no-op for
    one replica."""
    if world_size() > 1:
        xm.broadcast_master_param(model)


# --------------------------------------------------------------------------------------------
# Saving and launching
# --------------------------------------------------------------------------------------------


def _to_cpu(obj: Any, convert: bool = True) -> Any:
    """``obj`` with every XLA tensor (nested in lists/dicts/...) copied to the CPU."""
    return xm._maybe_convert_to_cpu(obj, convert=convert)


class _CallWithoutIndex:
    """torch-xla passes the replica index first; ``notebook_launcher`` functions do not take it.
    A class (not a closure) so that it pickles under the ``spawn`` start method."""

    def __init__(self, function: Callable[..., Any]):
        self.function = function

    def __call__(self, index: int, *args: Any) -> Any:
        return self.function(*args)


def spawn(function: Callable[..., Any], args: Sequence[Any] = (), nprocs: Optional[int] = None,
          start_method: str = "fork") -> None:
    """Run ``function(*args)`` once per XLA device (``nprocs=None``: all of them; ``1``: only in
    this process). Called by ``notebook_launcher`` on TPU from the single parent process; each
    child is one replica. ``fork`` is the default because functions defined in a notebook cannot
    be pickled for ``spawn``; the parent must not have touched the XLA runtime yet.
    """
    if nprocs not in (None, 1):
        raise ValueError(
            f"num_processes={nprocs}: torch-xla starts exactly one process per XLA device (or 1). Pass "
            "num_processes=None to use every device, or limit the devices with TPU_NUM_DEVICES (TPU) / "
            "CPU_NUM_DEVICES (CPU) before launching."
        )
    import torch_xla.distributed.xla_multiprocessing as xmp

    xmp.spawn(_CallWithoutIndex(function), args=tuple(args), nprocs=nprocs, start_method=start_method)


# --------------------------------------------------------------------------------------------
# The Backend and the Transport
# --------------------------------------------------------------------------------------------


class XlaBackend(Backend):
    """An XLA device per replica; fp16 is refused (bf16 is XLA's half precision); torch-xla's
    own spawn starts the processes of ``notebook_launcher``."""

    device_type = "xla"
    autocast_device_type = "xla"
    spawns_processes = True
    default_strategy = "xla"

    @classmethod
    def refine_environment(cls, env: Any) -> Any:
        return refine_environment(env)

    @classmethod
    def get_rng_state(cls) -> Optional[Any]:
        return int(xm.get_rng_state())

    @classmethod
    def set_rng_state(cls, state: Any) -> None:
        xm.set_rng_state(int(state))

    @classmethod
    def manual_seed(cls, seed: int) -> None:
        xm.set_rng_state(int(seed))

    def setup(self) -> torch.device:
        self.device = device()
        return self.device

    def move_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return move_model(model, self.device)

    def feed(self, batches: Any) -> Any:
        """torch-xla's ``ParallelLoader`` moves the batches to the device in a background thread
        and marks a step before each one; after the last, the pending graph runs."""
        from torch_xla.distributed.parallel_loader import ParallelLoader

        parallel = ParallelLoader(_Iterable(batches), [self.device])
        try:
            yield from parallel.per_device_loader(self.device)
            mark_step()  # run the last step's graph now, as the plain device loader would
        finally:
            parallel.close()

    def synchronize(self) -> None:
        mark_step()
        xm.wait_device_ops()

    def check_precision(self, precision: str, warn: bool = True) -> str:
        if precision == "fp16":
            raise ValueError("mixed_precision='fp16' is not supported on XLA devices; use 'bf16'")
        return super().check_precision(precision, warn)

    def make_scaler(self, precision: str, **kwargs: Any) -> Optional[torch.amp.GradScaler]:
        return None

    def host_copy(self, obj: Any, is_main: bool) -> Any:
        """``obj`` with XLA tensors copied to the CPU on the main process (so ``torch.load`` works
        without torch-xla).

        The XLA rule: moving a tensor to the CPU runs the graph that produces it. If that graph
        still contains a collective (e.g. you save right after ``optimizer.step()`` in a
        multi-replica job, before the next batch marks a step), every replica must call ``save``
        — calling it under ``if accelerator.is_main_process`` alone would leave replica 0 waiting.
        Saving after the loop, or from every replica, is always safe."""
        return _to_cpu(obj, convert=is_main)

    def spawn(self, function: Callable[..., Any], args: tuple, nprocs: Optional[int]) -> Any:
        return spawn(function, args, nprocs)


class _Iterable:
    """A one-shot iterable over ``batches`` for ``ParallelLoader`` (which calls ``iter`` on it)."""

    def __init__(self, batches: Any):
        self._batches = batches

    def __iter__(self) -> Any:
        return iter(self._batches)


class XlaTransport(Transport):
    """Collectives between XLA replicas (torch-xla, not a torch.distributed group). Shapes are not
    checked with a header here: XLA compiles one program per replica, so a collective over
    mismatching shapes fails to compile instead of hanging."""

    checks_shapes = False
    objects_keep_device = False  # gather_object moves XLA tensors to the CPU (see gather_object)

    def is_active(self) -> bool:
        return world_size() > 1

    def world_size(self) -> int:
        return world_size()

    def rank(self) -> int:
        return rank()

    def gather_rows(self, row: torch.Tensor) -> List[List[int]]:
        return xm.all_gather(row.unsqueeze(0), dim=0).cpu().tolist()

    def gather(self, leaves: Sequence[torch.Tensor], sizes: Optional[List[List[int]]]) -> List[torch.Tensor]:
        return [all_gather_uneven(t) for t in leaves]

    def all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        kinds = {"sum": xm.REDUCE_SUM, "max": xm.REDUCE_MAX, "min": xm.REDUCE_MIN}
        return xm.all_reduce(kinds[op], t)

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        return broadcast(t, src)

    def gather_object(self, obj: Any) -> List[Any]:
        return gather_object(obj)

    def broadcast_object_list(self, objects: List[Any], src: int) -> List[Any]:
        objects[:] = broadcast_object_list(objects, src)
        return objects

    def barrier(self) -> None:
        rendezvous("anyaccel.barrier")
