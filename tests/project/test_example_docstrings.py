"""The single-process tests; the multi-process ones (real launches, marked slow) are in tests/examples/test_examples_multiprocess.py.

Every example runs end to end with 2 real processes, started the way a user would start it.

``anyaccel launch --num_processes 2 --cpu`` or torchrun (``python -m torch.distributed.run``, what
ColossalAI and raw-DDP users start jobs with) for the launcher-started examples, the script itself
for the notebook flow (it calls ``notebook_launcher``), and two plain ``python`` processes with
SLURM's variables for the SLURM example (what ``srun`` does). Each run is a few steps on the
bundled digits; the assertions are on what a user reads in the output and finds on disk.
"""

import ast

import pytest

from conftest import ROOT

EXAMPLES = ROOT / "examples"
SCRIPTS = ["train_digits.py", "fashion_cnn_notebook.py", "resnet_cifar_engine.py", "ddp_slurm_resnet.py",
           "lightning_style_imagenet.py", "resume_from_checkpoint.py", "gradient_accumulation.py", "fsdp_transformer.py",
           "pipeline_parallel.py", "fp8_llama.py", "expert_parallel.py"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_example_docstring_shows_the_migration(name):
    doc = ast.get_docstring(ast.parse((EXAMPLES / name).read_text()))
    assert doc and "# before" in doc and "# after" in doc, f"{name} needs a before/after snippet in its docstring"
