"""torch.compile through the Accelerator: compiled in place before DDP/FSDP2 wrap the module, same
numbers as eager, state dicts without ``_orig_mod.``; a model the user compiled works too.
Two compiling jobs only (a first compile takes ~25 s on this CPU)."""

import json
import subprocess
import sys

import pytest

from conftest import SCRIPTS, clean_env, launch_checks

pytestmark = pytest.mark.slow
KEYS = ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]


def _results(out, nproc):
    if nproc > 1:
        return launch_checks("compile_checks.py", out, nproc=nproc, timeout=400)
    proc = subprocess.run([sys.executable, str(SCRIPTS / "compile_checks.py"), str(out)], capture_output=True,
                          text=True, timeout=400, env=clean_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads((out / "rank0.json").read_text())]


def test_compile_in_one_process_and_a_user_compiled_model(tmp_path):
    (res,) = _results(tmp_path, 1)
    assert res["graphs_compiled"] >= 1  # dynamo really compiled the model
    assert res["compiled"] == pytest.approx(res["eager"], rel=1e-5)
    assert res["keys"] == KEYS and res["checkpoint_files"] == ["model.safetensors"]
    assert res["unwrapped_is_module"] == "Net"  # compiled in place: the user's own module
    assert res["user_compiled"] == pytest.approx(res["eager"], rel=1e-5)
    assert res["user_keys"] == KEYS  # no `_orig_mod.` in what is saved
    assert res["user_unwrap"] == ["OptimizedModule", "Net"]  # keep_torch_compile=True / False


def test_compile_under_ddp_and_fsdp_in_two_processes(tmp_path):
    for res in _results(tmp_path, 2):
        assert res["graphs_compiled"] >= 1 and res["fsdp_graphs"] >= 1
        assert res["compiled"] == pytest.approx(res["eager"], rel=1e-5)
        assert res["fsdp_compiled"] == pytest.approx(res["eager"], rel=1e-5)
        assert res["keys"] == KEYS
