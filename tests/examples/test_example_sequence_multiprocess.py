"""examples/sequence_llama.py: its migration docstring, and a run with 2 real CPU processes (sp 2 on
gloo) started as a user starts it (``anyaccel launch --num_processes 2 --cpu``), at tiny sizes:
the mesh is (dp_shard=1, sp=2), each process holds half of every sequence, and the loss goes down
(the counting task needs the tokens at the end of the first half, held by the other process)."""

import ast
import re

import pytest

from conftest import ROOT, anyaccel, clean_env

EXAMPLE = ROOT / "examples" / "sequence_llama.py"


def test_example_docstring_shows_the_migration():
    doc = ast.get_docstring(ast.parse(EXAMPLE.read_text()))
    assert "# before" in doc and "# after" in doc and "sp_backend=\"deepspeed\"" in doc


@pytest.mark.slow
def test_sequence_llama_trains_with_sp2_on_two_processes(tmp_path):
    pytest.importorskip("transformers")
    proc = anyaccel("launch", "--num_processes", 2, "--cpu", EXAMPLE, "--epochs", 2, "--sequences", 128,
                    "--seq-len", 32, timeout=400, env=clean_env(ANYACCEL_HOME=str(tmp_path)))
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-5000:]
    assert "mesh DeviceMesh((dp_shard=1, sp=2)" in out and "each holds 16 of 32 tokens per sequence" in out, out
    losses = [float(x) for x in re.findall(r"epoch \d: loss ([\d.]+)", out)]
    assert len(losses) == 2 and losses[1] < 0.7 * losses[0], out
