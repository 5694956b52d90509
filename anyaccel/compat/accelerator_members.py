"""Members of Accelerate's ``Accelerator`` that exist for scripts written against it, and mean
little or nothing in anyaccel: :class:`AccelerateMembers`, a mixin of :class:`~anyaccel.Accelerator`.

Each answers as Accelerate's does for the same job, or does what Accelerate's does (``lomo_backward``,
``verify_device_map``), or, where anyaccel does not do the thing, says so: a context manager that
would enable a feature anyaccel refuses runs its block unchanged with a warning (as Accelerate's does
when the feature is off), a method refuses with the anyaccel way. They live here, in the
compatibility layer, so that the façade's own module lists anyaccel's verbs only.

The mixin reads the ``Accelerator``'s public attributes (``distributed_type``, ``use_distributed``,
``parallelism_config``, ``dataloader_config``, ``is_local_main_process``) and its prepared
optimizers (``_optimizers``).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, List, Optional, Set

import torch

from ..environment import DistributedType

__all__ = ["AccelerateMembers"]

#: Accelerate's multi-device distributed types (``Accelerator.multi_device``)
_MULTI_DEVICE = (DistributedType.MULTI_GPU, DistributedType.MULTI_MLU, DistributedType.MULTI_SDAA,
                 DistributedType.MULTI_MUSA, DistributedType.MULTI_NPU, DistributedType.MULTI_XPU,
                 DistributedType.MULTI_HPU, DistributedType.MULTI_NEURON)


class AccelerateMembers:
    """Accelerate-only members of ``Accelerator`` (module docstring). The attributes they read are
    the ``Accelerator``'s (not declared here: it defines them as read-only properties)."""

    @property
    def is_fsdp2(self) -> bool:
        """True when the model is sharded with FSDP (anyaccel's FSDP is always FSDP2). Local."""
        return self.distributed_type == DistributedType.FSDP

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        """Accelerate's name for :attr:`is_fsdp2`. Local."""
        return self.is_fsdp2

    @property
    def multi_device(self) -> bool:
        """True in a multi-process job on accelerators (GPUs and the like; not CPUs, XLA, FSDP or
        DeepSpeed, as Accelerate's ``DistributedType`` counts them). Local."""
        return bool(self.use_distributed) and self.distributed_type in _MULTI_DEVICE

    @property
    def should_save_model(self) -> bool:
        """Whether this process takes part in saving the model: every process with a
        ``parallelism_config`` (``save_model`` is collective), else the local main process
        (Accelerate's answer). Local."""
        return True if self.parallelism_config is not None else bool(self.is_local_main_process)

    @property
    def use_stateful_dataloader(self) -> bool:
        """``dataloader_config.use_stateful_dataloader`` (False when the configuration has no such
        field): whether :meth:`load_state` also restores each loader's position in its epoch
        (otherwise, as in Accelerate, the saved epoch runs again from its first batch and the
        script skips what it had done). Every prepared loader has ``state_dict`` /
        ``load_state_dict`` either way, without torchdata. Local."""
        return bool(getattr(self.dataloader_config, "use_stateful_dataloader", False))

    @property
    def fp8_backend(self) -> Any:
        """Which library trains in fp8, as Accelerate's ``FP8BackendType`` (a ``str`` enum, equal to
        its value): ``AO`` (torchao) or ``TE`` (Transformer Engine) under ``mixed_precision="fp8"``,
        else ``NO``; ``.value`` and ``.name`` work as in Accelerate. Local."""
        from .utils.dataclasses import FP8BackendType

        fp8 = getattr(self, "_fp8", None)
        return FP8BackendType(fp8.backend if fp8 is not None else "NO")

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers: Optional[List[torch.Tensor]] = None,
                               buffer_seq_dims: Optional[List[int]] = None,
                               no_restore_buffers: Optional[Set[torch.Tensor]] = None) -> Iterator[None]:
        """Accelerate's context manager for a context-parallel step (``cp_size`` > 1 shards
        ``buffers`` along ``buffer_seq_dims`` for ring attention). anyaccel refuses ``cp_size`` > 1
        when the ``Accelerator`` is made (torch's ``context_parallel`` has no CPU kernels and
        anyaccel does not wire it on CUDA yet; ``sp_size`` splits sequences on any device), so
        the block runs unchanged, with a warning, as Accelerate's does when context parallelism is
        off. ``buffers`` and ``buffer_seq_dims`` must have the same length. Local."""
        if (buffers is None) != (buffer_seq_dims is None) or len(buffers or ()) != len(buffer_seq_dims or ()):
            raise ValueError(f"maybe_context_parallel: {len(buffers or ())} buffers but {len(buffer_seq_dims or ())} "
                             "buffer_seq_dims; give one sequence dimension per buffer")
        if no_restore_buffers and not all(any(b is t for t in buffers or ()) for b in no_restore_buffers):
            raise ValueError("maybe_context_parallel: no_restore_buffers must be a subset of buffers")
        sp = getattr(self.parallelism_config, "sp_size", 1) or 1
        hint = (f"; sequences are split by sp_size={sp} already (the prepared loader slices them)" if sp > 1 else
                "; ParallelismConfig(sp_size=...) splits sequences on any device")
        warnings.warn("maybe_context_parallel: context parallelism is not enabled (cp_size=1), so this block runs "
                      f"unchanged and the buffers are not sharded{hint}", stacklevel=3)
        yield

    def verify_device_map(self, model: torch.nn.Module) -> bool:
        """True when ``model`` (or a module in it) was dispatched over several devices with a
        device map (an ``hf_device_map`` of more than one entry): such a model is used as it is,
        not prepared for training. Local."""
        return any(len(getattr(m, "hf_device_map", None) or ()) > 1 for m in model.modules())

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """The backward of LOMO/AdaLomo optimizers (the ``lomo-optim`` package), which update the
        weights inside the backward: ``fused_backward(loss, learning_rate)`` of each prepared
        optimizer that has one. Local. Raises ``ValueError`` without a learning rate or without
        such an optimizer."""
        if learning_rate is None:
            raise ValueError("lomo_backward needs the learning rate: the LOMO optimizer updates the weights during "
                             "the backward")
        fused = [opt for opt in (getattr(o, "optimizer", o) for o in self._optimizers) if hasattr(opt, "fused_backward")]
        if not fused:
            raise ValueError("lomo_backward: no prepared optimizer is a LOMO optimizer (lomo_optim.Lomo or AdaLomo); "
                             "pass one to accelerator.prepare(), or use accelerator.backward(loss)")
        for opt in fused:
            opt.fused_backward(loss, learning_rate)

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: Any = None) -> Any:
        """Accelerate's adapter of a loader for DeepSpeed's Ulysses sequence parallelism (ALST).
        Refused: anyaccel's sequence parallelism is its own (``ParallelismConfig(sp_size=...)``),
        and a loader passed to ``prepare`` is sliced for it there. Local."""
        raise NotImplementedError("deepspeed_ulysses_dl_adapter: anyaccel does not run DeepSpeed's Ulysses (ALST); use "
                                  "ParallelismConfig(sp_size=...), whose prepared loaders hand each sp rank its slice "
                                  "of the sequence (docs/guides/sequence.md)")
