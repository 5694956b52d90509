"""The multi-process tests (real launches, marked slow); the single-process ones are in tests/strategies/test_compile.py.

torch.compile through the Accelerator really compiles: Dynamo compiles >= 1 frame (its counters,
not only equal losses) for torch.nn containers, user subclasses, a torchvision-style ResNet and
models the user compiled, in 1 process and under DDP and FSDP2 (2 real processes); the user's
object and parameter names are kept; a model Dynamo compiled nothing for warns once.

Whether frames compile is checked with the cheap "eager"/"aot_eager" backends; inductor (the real
thing, ~10-25 s per compile here) runs in one single-process slow test."""

import json

import pytest

from conftest import SCRIPTS, clean_env, warm_launch
from test_compile import _assert_compiled, _spec, checks  # helpers shared with the unit tests
_spec.loader.exec_module(checks)


@pytest.mark.slow
@pytest.mark.timeout(600)  # one inductor compile (forward and backward graphs): ~25 s on a quiet 2-core CPU
def test_inductor_compiles_a_torch_nn_container_in_one_process(tmp_path):
    import subprocess
    import sys

    script = str(SCRIPTS / "compile_checks.py")
    proc = subprocess.run([sys.executable, script, str(tmp_path), "default:sequential:inductor"], capture_output=True,
                          text=True, timeout=540, env=clean_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for res in json.loads((tmp_path / "rank0.json").read_text()).values():
        _assert_compiled(res)
        assert res["keys"] == res["expected_keys"]


@pytest.mark.slow
@pytest.mark.timeout(600)  # 7 models compiled (aot_eager) and trained twice, in 2 processes on 2 cores
def test_compile_under_ddp_and_fsdp2_in_two_processes(tmp_path):
    # fsdp_blocks: FSDP2 shards blocks of their own (TransformerEncoderLayer, torch's), whose hooks break
    # the root's graph; anyaccel compiles each block too (before, this model compiled nothing)
    runs = ("default:sequential:aot_eager,default:resnet:aot_eager,default:user_compiled:aot_eager,"
            "fsdp:sequential:aot_eager,fsdp:resnet:aot_eager,fsdp_blocks:transformer:aot_eager,"
            "fsdp:user_compiled:aot_eager")
    proc = warm_launch(2, SCRIPTS / "compile_checks.py", tmp_path, runs, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in range(2):
        for run, res in json.loads((tmp_path / f"rank{rank}.json").read_text()).items():
            ddp = run.startswith("default")
            if run == "fsdp:user_compiled:aot_eager":
                # torch.compile(model) traces FSDP2's dynamo-disabled hooks from its top frame and
                # compiles nothing (torch 2.13); anyaccel keeps the user's choice and says so, once
                assert res["graphs"] == 0 and len(res["warnings"]) == 1 and "Sequential" in res["warnings"][0]
                assert res["compiled"] == pytest.approx(res["eager"], rel=1e-5)
                continue
            assert res["strategy"] == ("DDPStrategy" if ddp else "FSDPStrategy"), run
            _assert_compiled(res, same_object=not ddp)  # DDP returns its wrapper; FSDP2 the user's object
            if rank == 0:  # under FSDP2 the full state dict is the main process's
                assert res["keys"] == res["expected_keys"]
