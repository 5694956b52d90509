"""How the Accelerate config files next to this script were made: by Accelerate 1.15's own code.

Every ``*.yaml`` here (but ``default.yaml``) is what ``accelerate config`` writes for one set of
answers: Accelerate's questionnaire (``accelerate.commands.config.cluster.get_cluster_input``) runs
with its two question functions (``_ask_field``, ``_ask_options``) answering from :data:`FILES`
— a question not listed gets Accelerate's default, as Enter does; a menu's answer is the number
of its choice — and the ``ClusterConfig`` it returns is written by its own ``to_yaml_file``.
``default.yaml`` is ``accelerate config default`` (``write_basic_config``) on a machine without
GPUs. Only the hardware probes that decide which questions are asked are fixed (no MPS/NPU/...;
DeepSpeed, transformers, torchao and Transformer Engine "installed"), so the files are the same on
every machine.

``tests/config/test_accelerate_files.py`` checks that each file is still what the installed
Accelerate writes (:func:`make`) and what it means to ``anyaccel launch``.

    python tests/config/accelerate_files/make_files.py [OUT_DIR]   # write them again

Not a test (pytest does not collect it).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from typing import Any, Dict

M = "Which type of machine"  # 0 no distribution, 1 multi-CPU, 4 multi-GPU, 10 TPU
N = "should be used for distributed training"  # the number of processes (or GPUs, TPU cores)
MACHINES = {"different machines": 2, "IP address": "10.0.0.1", "port you will use": 29500}
FSDP = {M: 4, "FullyShardedDataParallel?": "yes", N: 2}
DEEPSPEED = {M: 4, "DeepSpeed?": "yes", N: 2}

#: file -> {text in a question: answer}; the first matching text answers
FILES: Dict[str, Dict[str, Any]] = {
    # no distribution, on a GPU machine / CPU only
    "no_distribution.yaml": {M: 0},
    "no_distribution_cpu.yaml": {M: 0, "CPU only": "yes", "mixed precision": 2},
    # several CPU processes
    "cpu2.yaml": {M: 1, "different machines": 1, N: 2},
    "cpu2_bf16.yaml": {M: 1, N: 2, "mixed precision": 2},
    "cpu_dynamo.yaml": {M: 1, N: 2, "torch dynamo": "yes", "customize the defaults": "yes", "Which mode": 2},
    "cpu_mpirun.yaml": {M: 1, "launch mpirun": "yes", "hostfile": "/etc/mpi-hosts", N: 2},
    "cpu_machines.yaml": {M: 1, **MACHINES, "rank of this machine": 1, N: 8},
    # several GPUs, several machines
    "gpu_bf16.yaml": {M: 4, "different machines": 1, N: 2, "(by id)": "all", "mixed precision": 2},
    "gpu_ids_fp16_debug.yaml": {M: 4, "checked while running": "yes", N: 2, "(by id)": "0,1", "mixed precision": 1},
    "gpu_numa.yaml": {M: 4, N: 2, "numa efficiency": "yes"},
    "gpu_machines.yaml": {M: 4, **MACHINES, "rank of this machine": 1, "same local network": "no",
                          "rendezvous backend": "c10d", N: 16},
    # FSDP: version 2 (the default) and 1, with the questionnaire's defaults and with other answers
    "fsdp2.yaml": {**FSDP, "transformer layer": "Block", "mixed precision": 2, "parallelism config": "no"},
    "fsdp2_full_nowrap.yaml": {**FSDP, "resharding after forward": "no", "auto wrap policy": 2,
                               "state dict type": 1, "CPU RAM efficient": "no", "activation checkpointing": "yes"},
    "nd.yaml": {**FSDP, "transformer layer": "Block", "parallelism config": "yes", "FSDP shard size": 2,
                "tensor parallelism size": 2, N: 4},
    "fsdp1.yaml": {**FSDP, "FSDP version": 0, "transformer layer": "Block", "mixed precision": 2},
    "fsdp1_size_offload.yaml": {**FSDP, "FSDP version": 0, "sharding strategy": 1, "offload parameters": "yes",
                                "auto wrap policy": 1, "backward prefetch": 1, "state dict type": 2,
                                "forward prefetch": "yes", "use_orig_params": "no", "CPU RAM efficient": "no",
                                "broadcast module parameters": "no", "activation checkpointing": "yes"},
    "fsdp1_no_shard.yaml": {**FSDP, "FSDP version": 0, "sharding strategy": 2, "auto wrap policy": 2},
    "fsdp1_hybrid_machines.yaml": {**FSDP, **MACHINES, "rank of this machine": 0, "FSDP version": 0,
                                   "sharding strategy": 3, "auto wrap policy": 2, N: 16},
    "fsdp1_local_state.yaml": {**FSDP, "FSDP version": 0, "auto wrap policy": 2, "state dict type": 1},
    # DeepSpeed
    "deepspeed.yaml": {**DEEPSPEED, "different machines": 1, "mixed precision": 2},
    "deepspeed_zero3.yaml": {**DEEPSPEED, "ZeRO optimization stage": 3, "offload optimizer states": 1,
                             "offload parameters": 1, "accumulation steps you're passing": 4,
                             "use gradient clipping": "yes", "clipping value": 0.5, "save 16-bit": "yes",
                             "zero.Init": "yes", "mixed precision": 2},
    "deepspeed_machines.yaml": {**DEEPSPEED, **MACHINES, "rank of this machine": 1, "Type of launcher": 1, N: 16},
    "deepspeed_pdsh.yaml": {**DEEPSPEED, **MACHINES, "rank of this machine": 0, "Type of launcher": 0,
                            "location of hostfile": "/job/hosts", N: 16},
    # TPU (XLA)
    "xla.yaml": {M: 10, N: 8},
    "xla_pod.yaml": {M: 10, N: 8, "name of your TPU cluster": "pod", "zone of your TPU cluster": "us-c1",
                     "Are you using a TPU cluster": "yes", "should `sudo` be used": "no", "run on startup": "no",
                     "Compute VM instances": "", "environment variables": ""},
    # fp8: torchao (Accelerate's defaults: fp8 all-gather and padding on), torchao under FSDP2, Transformer Engine
    "cpu2_fp8.yaml": {M: 1, "different machines": 1, N: 2, "mixed precision": 3},
    "fsdp2_fp8.yaml": {**FSDP, "transformer layer": "Block", "CPU RAM efficient": "no", "parallelism config": "no",
                       "mixed precision": 3, "FSDP2 float8 all gather": "no"},
    "gpu_fp8_te.yaml": {M: 4, "different machines": 1, N: 2, "(by id)": "all", "mixed precision": 3,
                        "FP8 backend": 1, "weight format": 1, "margin": 2, "Which algorithm should be used for the amax": 1,
                        "`fprop` be executed": "yes", "`dgrad` be executed": "no", "`wgrad` be executed": "yes",
                        "GEMMS in higher precision": "yes"},
    # Megatron-LM: a feature anyaccel does not have
    "megatron.yaml": {M: 4, "Megatron-LM": "yes", N: 2},
}


def _answer(answers: Dict[str, Any], question: str) -> Any:
    return next((a for text, a in answers.items() if text in question), None)


@contextlib.contextmanager
def _questionnaire(answers: Dict[str, Any]):
    """Accelerate's question functions answering from ``answers``; its probes fixed."""
    from accelerate.commands.config import cluster

    def ask_field(question, convert_value=None, default=None, error_message=None):
        given = _answer(answers, question)
        if given is None:
            if default is None:
                raise KeyError(f"no answer for {question!r} (it has no default)")
            return default
        return convert_value(str(given)) if convert_value is not None else str(given)

    def ask_options(question, options=(), convert_value=None, default=0):
        given = _answer(answers, question)
        index = default if given is None else int(given)
        return convert_value(index) if convert_value is not None else index

    fixed = {"_ask_field": ask_field, "_ask_options": ask_options, "is_deepspeed_available": lambda: True,
             "is_transformers_available": lambda: True, "is_mps_available": lambda: False,
             # fp8: torchao and Transformer Engine "installed" (the fp8 files), MS-AMP not
             "is_fp8_available": lambda: True, "is_torchao_available": lambda: True,
             "is_transformer_engine_available": lambda: True, "is_msamp_available": lambda: False}
    fixed.update({name: (lambda: False) for name in dir(cluster) if name.startswith("is_") and name.endswith(
        "_available") and name not in fixed and any(d in name for d in ("npu", "mlu", "sdaa", "musa", "xpu", "hpu",
                                                                        "neuron"))})
    saved = {name: getattr(cluster, name) for name in fixed}
    for name, value in fixed.items():
        setattr(cluster, name, value)
    try:
        yield cluster
    finally:
        for name, value in saved.items():
            setattr(cluster, name, value)


def make(name: str) -> str:
    """The text Accelerate writes for ``name`` (a key of :data:`FILES`, or ``default.yaml``)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, name)
        if name == "default.yaml":
            from accelerate.commands.config.default import write_basic_config

            write_basic_config(save_location=path)
        else:
            with _questionnaire(FILES[name]) as cluster, contextlib.redirect_stdout(io.StringIO()):
                config = cluster.get_cluster_input()
            config.to_yaml_file(path)
        with open(path, encoding="utf-8") as fh:
            return fh.read()


if __name__ == "__main__":
    out = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
    for file in ["default.yaml", *FILES]:
        with open(os.path.join(out, file), "w", encoding="utf-8") as fh:
            fh.write(make(file))
        print(os.path.join(out, file))
