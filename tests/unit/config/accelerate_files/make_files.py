"""How the Accelerate config files next to this script were made: by Accelerate itself (1.15).

``default.yaml``: ``accelerate config default --config_file default.yaml`` (a CPU-only machine;
Accelerate writes JSON, which is YAML too). The others: the real ``accelerate config``
questionnaire, driven in a pseudo-terminal by :func:`drive` with the answers in :data:`FILES`
(every question not listed gets Enter, Accelerate's default). ``deepspeed.yaml`` needs
``pip install deepspeed==0.19.8`` while it is made (Accelerate refuses the DeepSpeed questions
without it); it was uninstalled again afterwards.

Not a test (pytest does not collect it); run ``python make_files.py OUT_DIR`` to make them again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time

#: file -> {text of a question: answer}; a menu's answer is the number key of its choice
FILES = {
    "cpu2.yaml": {"Which type of machine": 1, "How many different machines": "1", "How many processes": "2"},
    "gpu_bf16.yaml": {"Which type of machine": 4, "How many different machines": "1",
                      "How many GPU(s) should be used": "2", "What GPU(s) (by id)": "all", "mixed precision": 2},
    "fsdp2.yaml": {"Which type of machine": 4, "How many different machines": "1", "FullyShardedDataParallel?": "yes",
                   "What should be your FSDP version": "2",
                   "Specify the comma-separated list of transformer layer": "Block",
                   "How many GPU(s) should be used": "2", "mixed precision": 2, "parallelism config": "no"},
    "nd.yaml": {"Which type of machine": 4, "How many different machines": "1", "FullyShardedDataParallel?": "yes",
                "What should be your FSDP version": "2", "Specify the comma-separated list of transformer layer": "Block",
                "parallelism config": "yes", "replicate size": "1", "FSDP shard size": "2",
                "tensor parallelism size": "2", "context parallelism size": "1", "How many GPU(s) should be used": "4",
                "mixed precision": 0},
    "deepspeed.yaml": {"Which type of machine": 4, "How many different machines": "1", "DeepSpeed?": "yes",
                       "How many GPU(s) should be used": "2", "mixed precision": 2},
}


def _strip(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", text)


def drive(out: str, answers: dict) -> str:
    """Answer ``accelerate config --config_file OUT`` as ``answers`` say; returns the file."""
    import pexpect

    accelerate = shutil.which("accelerate") or os.path.join(os.path.dirname(sys.executable), "accelerate")
    env = {"PATH": os.environ["PATH"], "HOME": os.path.dirname(out), "TERM": "xterm", "CUDA_VISIBLE_DEVICES": "",
           "COLUMNS": "200"}
    child = pexpect.spawn(accelerate, ["config", "--config_file", out], encoding="utf-8", timeout=30, env=env)
    while True:
        i = child.expect([r"\]:\s*$", r"\? \[yes/NO\]:\s*$", r"selecting with enter", pexpect.EOF, r"\?\s*:?\s*$"],
                         timeout=60)
        if i == 3:
            break
        text = _strip(child.before + (child.after if isinstance(child.after, str) else ""))
        time.sleep(0.3)
        try:
            text += _strip(child.read_nonblocking(100000, timeout=0.5))
        except Exception:
            pass
        question = " | ".join([line for line in text.replace("\r", "\n").split("\n") if line.strip()][-12:])
        answer = next((a for k, a in answers.items() if k in question), None)
        if i == 2:  # a menu: the number key of the choice, then Enter
            if answer is not None:
                child.send(str(answer))
                time.sleep(0.2)
            child.send("\r")
        else:
            child.send(("" if answer is None else str(answer)) + "\r")
    with open(out, encoding="utf-8") as fh:
        return fh.read()


if __name__ == "__main__":
    folder = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".")
    for name, answers in FILES.items():
        print(f"--- {name}\n{drive(os.path.join(folder, name), answers)}")
    print(json.dumps(sorted(FILES)))
