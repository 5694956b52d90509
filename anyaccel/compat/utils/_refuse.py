"""Accelerate names for what anyaccel does not do: importable, so that a migrated script starts,
but raising ``NotImplementedError`` when used, with the reason and the anyaccel way.

The reasons are written once here (:data:`WHY`); each ``anyaccel.utils`` submodule makes its
refused names with :func:`refused_names`. Local.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable

__all__ = ["WHY", "refused", "refused_names"]

_FSDP = ("for sharded training use FSDP2: Accelerator(strategy=\"fsdp\") or "
         "fsdp_plugin=FullyShardedDataParallelPlugin(...)")

#: One reason per kind of refusal (the key names the kind).
WHY: Dict[str, str] = {
    "deepspeed": ("not part of anyaccel's DeepSpeed integration (Accelerator(deepspeed_plugin=DeepSpeedPlugin(...)) "
                  "trains ZeRO 0-3; docs/guides/deepspeed.md lists what maps to what)"),
    "deepspeed_internal": ("Accelerate's internal DeepSpeed wrapper: anyaccel's prepare() returns the engine and the "
                           "usual AcceleratedOptimizer/AcceleratedScheduler, which drive it"),
    "megatron": f"anyaccel has no Megatron-LM integration; {_FSDP}",
    "msamp": ("MS-AMP is deprecated upstream (Accelerate 1.13; Microsoft no longer maintains it): train in fp8 with "
              "Accelerator(mixed_precision=\"fp8\", kwargs_handlers=[AORecipeKwargs(...)]) (torchao) or "
              "TERecipeKwargs (Transformer Engine)"),
    "bnb": "anyaccel has no bitsandbytes quantization; quantize with bitsandbytes or torchao directly",
    "tp": ("Accelerate's tensor/context-parallel plugins and helpers; in anyaccel tensor parallelism is configured "
           "by Accelerator(parallelism_config=ParallelismConfig(tp_size=..., tp_plan=... or parallelize_fn=...)) "
           "(docs/guides/nd-parallel.md); context parallelism is not there yet"),
    "big_model": ("not offered by anyaccel's big-model support (anyaccel.big_modeling: init_empty_weights, "
                  "infer_auto_device_map, dispatch_model, cpu_offload, disk_offload, "
                  "load_checkpoint_and_dispatch); tied-parameter and offloaded-parameter helpers are not there yet"),
    "fsdp_internal": ("Accelerate's FSDP internals; in anyaccel Accelerator(strategy=\"fsdp\").prepare shards the "
                      "model and accelerator.save_state / load_state / get_state_dict save and load it"),
    "amp": ("anyaccel's Accelerator makes the gradient scaler and the autocast context itself: "
            "Accelerator(mixed_precision=\"fp16\"|\"bf16\", kwargs_handlers=[GradScalerKwargs(...)]) and "
            "accelerator.autocast()"),
    "compile_regions": ("anyaccel compiles the whole model: Accelerator(dynamo_backend=\"inductor\") or "
                        "dynamo_plugin=TorchDynamoPlugin(...)"),
    "sagemaker": "anyaccel does not launch on Amazon SageMaker; use anyaccel launch on the instances",
    "xla_install": "anyaccel does not install torch-xla; pip install torch-xla as its documentation says",
    "write_basic_config": ("anyaccel's configuration file is written by `anyaccel config` "
                           "(or `anyaccel config --default`)"),
}


def refused(name: str, why: str) -> Any:
    """A stand-in for Accelerate's ``name`` that raises ``NotImplementedError(f"{name}: {reason}")``
    when called (or, for a class name, instantiated); ``why`` is a key of :data:`WHY`."""
    reason = WHY[why]

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{name}: {reason}")

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"Not available: {reason}. Calling it raises NotImplementedError."
    if name[0].isupper():
        return type(name, (), {"__init__": lambda self, *a, **k: refuse(), "__doc__": refuse.__doc__,
                               "__module__": __name__, "anyaccel_refused": why})
    refuse.anyaccel_refused = why
    return refuse


def refused_names(why: str, names: Iterable[str]) -> Dict[str, Any]:
    """``{name: refused(name, why)}`` for ``names``, to ``globals().update`` in a submodule."""
    return {name: refused(name, why) for name in names}
