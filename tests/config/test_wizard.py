"""Drive the real ``anyaccel config`` questions in a pseudo-terminal (pexpect)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys

import pytest

pexpect = pytest.importorskip("pexpect")

from anyaccel.config.file import load_config, save_config  # noqa: E402
from anyaccel.config.schema import Config  # noqa: E402

from conftest import CONSOLE_SCRIPT, ROOT  # noqa: E402

REPO = ROOT
ENTER, DOWN, CLEAR_LINE, CTRL_C = "\r", "\x1b[B", "\x15", "\x03"



def spawn(tmp_path: pathlib.Path, target: pathlib.Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANYACCEL_", "XDG_", "HF_"))}
    env.update(
        HOME=str(tmp_path),
        PYTHONPATH=str(REPO),
        TERM="xterm",
        PROMPT_TOOLKIT_NO_CPR="1",  # pexpect does not answer cursor-position requests
        CUDA_VISIBLE_DEVICES="",  # a CPU-only machine, whatever the test host has
    )
    child = pexpect.spawn(
        sys.executable,
        ["-c", CONSOLE_SCRIPT, "config", "--config_file", str(target)],
        env=env,
        cwd=str(tmp_path),
        dimensions=(40, 120),
        timeout=120,  # a wait, not a measurement: `import torch` alone can take 20 s on a loaded machine
        encoding="utf-8",
    )
    return child


def on_screen(text: str) -> "re.Pattern[str]":
    """A pattern for ``text`` as prompt_toolkit draws it: escape sequences (colours, cursor moves)
    may sit between any two characters, and a cell that did not change may be skipped (cursor right)."""
    escapes = r"(?:\x1b\[[0-9;?]*[A-Za-z])*"
    return re.compile(escapes.join(f"(?:{re.escape(c)}|\x1b\\[1?C)" for c in text))


def answer(child, prompt: str, *keys: str) -> None:
    """Wait for the question containing ``prompt``, then type ``keys`` (each sent separately)."""
    child.expect(on_screen(prompt))
    for key in keys:
        child.send(key)


def finish(child) -> int:
    child.expect(pexpect.EOF)
    child.close()
    return child.exitstatus


def test_enter_everywhere_gives_a_working_cpu_config(tmp_path):
    target = tmp_path / "cfg" / "default_config.yaml"
    child = spawn(tmp_path, target)
    for prompt in ("Where will the training run", "Which device", "How many processes", "Mixed precision",
                   "Compile the model", "Save it"):  # one process: no question about sharding
        answer(child, prompt, ENTER)
    child.expect_exact("Configuration saved to")
    assert finish(child) == 0
    cfg = load_config(target).validate()
    assert cfg == Config(device="cpu", num_processes=1)


def test_several_machines_with_typed_values(tmp_path):
    target = tmp_path / "cfg.yaml"
    child = spawn(tmp_path, target)
    answer(child, "Where will the training run", DOWN, ENTER)
    answer(child, "Which device", ENTER)  # CPU, the detected one
    answer(child, "How many machines", CLEAR_LINE, "1", ENTER)
    child.expect(on_screen("Please type a number >= 2"))  # checked inline, the question stays
    child.send(CLEAR_LINE + "3" + ENTER)
    answer(child, "Rank of this machine", CLEAR_LINE, "1", ENTER)
    answer(child, "IP address or host name", CLEAR_LINE, "10.0.0.5", ENTER)
    answer(child, "Port on the main machine", CLEAR_LINE, "70000", ENTER)
    child.expect(on_screen("from 1 to 65535"))
    child.send(CLEAR_LINE + "29555" + ENTER)
    answer(child, "How many processes on each machine", CLEAR_LINE, "2", ENTER)
    answer(child, "Mixed precision", DOWN, ENTER)  # no, bf16, fp16 on a CPU
    answer(child, "How should each process hold the model", ENTER)  # a full copy (DDP)
    answer(child, "Compile the model", ENTER)
    child.expect_exact("num_processes: 6")
    answer(child, "Save it", ENTER)
    assert finish(child) == 0
    expected = Config(
        compute_environment="several_machines", device="cpu", num_machines=3, machine_rank=1,
        main_process_ip="10.0.0.5", main_process_port=29555, num_processes=6, mixed_precision="bf16",
    )  # fmt: skip
    assert load_config(target) == expected


def test_existing_file_supplies_the_defaults(tmp_path):
    target = tmp_path / "cfg.yaml"
    existing = Config(
        compute_environment="several_machines", device="cpu", num_machines=2, machine_rank=1,
        main_process_ip="node0", main_process_port=1234, num_processes=4, mixed_precision="bf16",
        gradient_accumulation_steps=8,
    )  # fmt: skip
    save_config(existing, target)
    child = spawn(tmp_path, target)
    for prompt in ("Where will", "Which device", "How many machines", "Rank of", "IP address", "Port on",
                   "How many processes", "Mixed precision", "How should each process hold", "Compile the model",
                   "Save it"):  # fmt: skip
        answer(child, prompt, ENTER)
    assert finish(child) == 0
    assert load_config(target) == existing


def test_ctrl_c_writes_nothing(tmp_path):
    target = tmp_path / "cfg.yaml"
    child = spawn(tmp_path, target)
    answer(child, "Where will the training run", ENTER)
    answer(child, "Which device", CTRL_C)
    child.expect_exact("nothing was written")
    assert finish(child) != 0
    assert list(tmp_path.iterdir()) == []


def test_gpu_machine_questions(tmp_path):
    """The GPU branch, with detection faked (no GPU needed): pick GPU ids, processes follow them."""
    driver = (
        "import json; from anyaccel.config.wizard import run_wizard; "
        "cfg = run_wizard(detected={'cpu': 1, 'gpu': 4, 'tpu': 0, 'mps': 0}); "
        "print('RESULT=' + json.dumps(cfg and cfg.to_dict()))"
    )
    env = dict(os.environ, TERM="xterm", PROMPT_TOOLKIT_NO_CPR="1", PYTHONPATH=str(REPO))
    child = pexpect.spawn(sys.executable, ["-c", driver], env=env, dimensions=(40, 120), timeout=120, encoding="utf-8")
    answer(child, "Where will", ENTER)
    answer(child, "GPU(s), CUDA (4 detected)", ENTER)  # GPU is the default when one is detected
    answer(child, "Which GPUs on this machine", CLEAR_LINE, "0,9", ENTER)
    child.expect(on_screen("This machine has GPU ids 0 to 3"))
    child.send(CLEAR_LINE + "1,3" + ENTER)
    answer(child, "How many processes in total (one per GPU)", ENTER)  # default 2: one per chosen GPU
    answer(child, "Mixed precision", DOWN, DOWN, ENTER)  # no, fp16, bf16
    answer(child, "How should each process hold the model", ENTER)
    answer(child, "Compile the model", ENTER)
    answer(child, "Save it", ENTER)
    child.expect(r"RESULT=(.*)\r\n")
    result = json.loads(child.match.group(1))
    assert finish(child) == 0
    cfg = Config.from_dict(result)
    assert cfg == Config(device="gpu", gpu_ids="1,3", num_processes=2, mixed_precision="bf16")


def test_fsdp_questions_only_with_several_processes(tmp_path):
    target = tmp_path / "cfg.yaml"
    child = spawn(tmp_path, target)
    answer(child, "Where will the training run", ENTER)
    answer(child, "Which device", ENTER)
    answer(child, "How many processes", CLEAR_LINE, "2", ENTER)
    answer(child, "Mixed precision", ENTER)
    answer(child, "How should each process hold the model", DOWN, ENTER)  # sharded (FSDP2)
    answer(child, "Module classes to shard one by one", "TransformerEncoderLayer", ENTER)
    answer(child, "Recompute activations", DOWN, ENTER)  # yes
    answer(child, "Compile the model", ENTER)
    answer(child, "Save it", ENTER)
    assert finish(child) == 0  # (a CPU job: no question about CPU offload)
    cfg = load_config(target)
    assert cfg.strategy == "fsdp" and cfg.fsdp_config == {
        "auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": "TransformerEncoderLayer",
        "activation_checkpointing": True}


def test_deepspeed_asks_the_zero_stage(tmp_path):
    """The DeepSpeed choice asks the stage (the option table's question); on the CPU there is no
    host memory apart, so no offload question. The file launches as `--use_deepspeed --zero_stage 3`."""
    target = tmp_path / "cfg.yaml"
    child = spawn(tmp_path, target)
    answer(child, "Where will the training run", ENTER)
    answer(child, "Which device", ENTER)
    answer(child, "How many processes", CLEAR_LINE, "2", ENTER)
    answer(child, "Mixed precision", ENTER)
    answer(child, "How should each process hold the model", DOWN, DOWN, DOWN, ENTER)  # ddp, fsdp, nd, deepspeed
    answer(child, "Which ZeRO stage", DOWN, ENTER)  # from the default 2 to 3
    answer(child, "Compile the model", ENTER)
    answer(child, "Save it", ENTER)
    assert finish(child) == 0
    cfg = load_config(target)
    assert (cfg.strategy, cfg.deepspeed_config) == ("deepspeed", {"zero_stage": 3})
