"""Files written by `accelerate config` itself (tests/config/accelerate_files/) run under
`anyaccel launch --config_file` with the same meaning (issues 29 and 37): a real 2-process launch.

One launch (CI time): the file `accelerate config` writes for a CPU machine (MULTI_CPU, 2
processes, bf16), as it is, without a flag; the script reports, from every rank, what the
Accelerator really runs with, and the launcher says nothing but that it read an Accelerate file.
Every other file's meaning is checked on the resolved plan, without processes
(tests/config/test_accelerate_files.py).
"""

from __future__ import annotations

import json
import textwrap

import pytest

from conftest import ROOT, anyaccel, clean_env

FILES = ROOT / "tests" / "config" / "accelerate_files"

_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from anyaccel import Accelerator


    class Block(torch.nn.Module):  # the class the FSDP file names in fsdp_transformer_layer_cls_to_wrap
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.fc(x))


    def main():
        acc = Accelerator()
        model = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = acc.prepare(model, opt)
        for _ in range(2):
            acc.backward(model(torch.randn(4, 8, device=acc.device)).float().pow(2).mean())
            opt.step()
            opt.zero_grad()
        options = acc.strategy.options
        report = {"world": acc.num_processes, "strategy": acc.strategy.name, "precision": acc.mixed_precision,
                  "device": acc.device.type,
                  "wrap": getattr(options, "auto_wrap_policy", None),
                  "names": list(getattr(options, "transformer_cls_names_to_wrap", ()) or ())}
        with open(f"{sys.argv[1]}/rank{acc.process_index}.json", "w") as fh:
            json.dump(report, fh)
        acc.end_training()


    if __name__ == "__main__":
        main()
""")


@pytest.mark.slow
@pytest.mark.parametrize("name, flags, expect", [
    ("cpu2_bf16.yaml", (), {"world": 2, "strategy": "ddp", "precision": "bf16", "device": "cpu"}),
])
def test_an_accelerate_config_file_runs_with_the_same_meaning(tmp_path, name, flags, expect):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    proc = anyaccel("launch", "--config_file", FILES / name, *flags, script, tmp_path, cwd=tmp_path,
                    env=clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "is an Accelerate config file, read with the same meaning" in proc.stderr
    assert "warning" not in proc.stderr.lower() and "cannot honour" not in proc.stderr, proc.stderr
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert {k: report[k] for k in expect} == expect, report
