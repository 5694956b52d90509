"""`anyaccel merge-weights` (streaming: memory bounded by the largest tensor) and `anyaccel
estimate-memory` (from a model built on meta or a checkpoint's headers), through the CLI."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from anyaccel.big_modeling.estimate import estimate_memory, model_shapes
from anyaccel.checkpoint import save_model
from conftest import anyaccel, clean_env


def test_merge_weights_turns_a_sharded_hf_checkpoint_into_one_file(tmp_path):
    state = {f"layer{i}.weight": torch.randn(16, 8) for i in range(5)}
    state["bias"] = torch.arange(4, dtype=torch.int64)
    save_model(state, tmp_path / "sharded", max_shard_size="1KB")
    proc = anyaccel("merge-weights", tmp_path / "sharded", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    merged = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(merged) == sorted(state) and all(torch.equal(merged[k], v) for k, v in state.items())
    bad = anyaccel("merge-weights", tmp_path / "nowhere", tmp_path / "x")
    assert bad.returncode == 2 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr


def test_merge_weights_memory_is_bounded_by_the_largest_tensor(tmp_path):
    """160 MiB of weights in 20 tensors of 8 MiB: the merging process's resident set grows by a
    few tensors, never by the model (a full load would add >= 160 MiB)."""
    script = textwrap.dedent(f"""
        import json, torch
        from anyaccel.checkpoint import save_model
        g = torch.Generator().manual_seed(0)
        save_model({{f"w{{i}}": torch.randn(1024, 2048, generator=g) for i in range(20)}}, {str(tmp_path / 'ck')!r},
                   max_shard_size="40MB")
    """)
    subprocess.run([sys.executable, "-c", script], check=True, env=clean_env())
    measure = textwrap.dedent(f"""
        import json, os, gc
        import torch
        from anyaccel.big_modeling.merge import merge_weights
        def rss(): return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        def hwm(): return [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
        gc.collect(); before = rss()
        merge_weights({str(tmp_path / 'ck')!r}, {str(tmp_path / 'merged.safetensors')!r})
        print(json.dumps({{"growth": hwm() - before}}))
    """)
    out = subprocess.run([sys.executable, "-c", measure], capture_output=True, text=True, check=True,
                         env=clean_env(MALLOC_MMAP_THRESHOLD_="131072"))
    growth = json.loads(out.stdout.strip().splitlines()[-1])["growth"]
    largest = 8 * 2**20
    assert growth < 4 * largest + 16 * 2**20, growth / 2**20  # observed: about 2 x 8 MiB
    merged = load_file(tmp_path / "merged.safetensors")
    assert len(merged) == 20


def test_estimate_memory_from_a_factory_and_from_a_checkpoint(tmp_path):
    (tmp_path / "mymodels.py").write_text(textwrap.dedent("""
        import torch
        def build():
            return torch.nn.Sequential(*[torch.nn.Linear(1000, 1000) for _ in range(4)])
    """))
    proc = anyaccel("estimate-memory", "mymodels:build", "--num-processes", "1", "4", "--json",
                    env=clean_env(PYTHONPATH=f"{tmp_path}:{clean_env()['PYTHONPATH']}"))
    assert proc.returncode == 0, proc.stderr
    rows = {(r["layout"], r["processes"]): r for r in json.loads(proc.stdout)}
    params = 4 * (1000 * 1000 + 1000)
    assert rows[("ddp", 4)]["params"] == params * 4 and rows[("ddp", 4)]["optimizer"] == params * 8
    assert rows[("fsdp", 4)]["params"] == params and rows[("fsdp", 4)]["optimizer"] == params * 2
    save_model({"a.0.weight": torch.zeros(64, 32), "a.1.weight": torch.zeros(64, 32)}, tmp_path / "ck")
    shapes = model_shapes(str(tmp_path / "ck"))
    est = estimate_memory(shapes, 8, "fsdp", True, replicate=2, tp=2, batch_size=4, seq_len=16)
    assert est["params"] == 2 * 64 * 32 * 4 // 4  # split 4 ways: 8 processes / 2 replicas
    assert est["activations"] == 34 * 16 * 4 * 32 * 2 // 2
    unknown = anyaccel("estimate-memory", "mymodels:build", "--layout", "zero3",
                       env=clean_env(PYTHONPATH=f"{tmp_path}:{clean_env()['PYTHONPATH']}"))
    assert unknown.returncode == 2 and "choose one of ddp, fsdp, nd or all" in unknown.stderr, unknown.stderr
    bad = anyaccel("estimate-memory", "no_such_module:build")
    assert bad.returncode == 2 and "cannot import" in bad.stderr


def test_estimate_memory_knows_sequence_parallelism(tmp_path, capsys):
    """--sp: activations per rank divided by the sp degree; the state still split N/replicas ways
    (FSDP2 shards over dp_shard x sp); only the nd layout has it. The CLI runs in this process."""
    from anyaccel.cli import main
    from anyaccel.errors import CLIError

    save_model({"a.0.weight": torch.zeros(64, 32), "a.1.weight": torch.zeros(64, 32)}, tmp_path / "ck")
    shapes = model_shapes(str(tmp_path / "ck"))
    est = estimate_memory(shapes, 8, "nd", True, tp=2, batch_size=4, seq_len=16, sp=2)
    assert est["layout"] == "nd (replicate 1, tp 2, sp 2)"
    assert est["params"] == 2 * 64 * 32 * 4 // 8
    assert est["activations"] == 34 * 16 * 4 * 32 * 2 // (2 * 2)
    with pytest.raises(CLIError, match="--seq-len 15 is not a multiple of --sp 2"):
        estimate_memory(shapes, 2, "nd", True, batch_size=1, seq_len=15, sp=2)
    assert main(["estimate-memory", str(tmp_path / "ck"), "--sp", "2", "--num-processes", "2", "3", "4",
                 "--batch-size", "1", "--seq-len", "16", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["layout"], r["processes"]) for r in rows] == [("nd (replicate 1, tp 1, sp 2)", 2),
                                                             ("nd (replicate 1, tp 1, sp 2)", 4)]
    assert main(["estimate-memory", str(tmp_path / "ck"), "--sp", "2", "--layout", "ddp"]) == 2
    assert "--sp 2 needs --layout nd" in capsys.readouterr().err


def test_estimate_memory_knows_expert_parallelism(tmp_path, capsys):
    """--ep: the parameters under an experts module split over ep x efsdp = N / (replicas x tp)
    processes (whole on every tp rank), the others as before; nd only; ep must divide the
    processes it borrows, and the model must have experts."""
    from anyaccel.cli import main
    from anyaccel.errors import CLIError

    experts, dense = 8 * 64 * 32, 64 * 32  # fused experts (E, out, in), one dense weight
    save_model({"layers.0.mlp.experts.gate_up_proj": torch.zeros(8, 64, 32), "layers.0.attn.weight": torch.zeros(64, 32)},
               tmp_path / "moe")
    shapes = model_shapes(str(tmp_path / "moe"))
    est = estimate_memory(shapes, 8, "nd", True, tp=2, ep=2)
    assert est["layout"] == "nd (replicate 1, tp 2, ep 2)"
    assert est["params"] == dense * 4 // 8 + experts * 4 // 4  # dense over all 8; experts over ep2 x efsdp2
    assert est["optimizer"] == 8 * dense // 8 + 8 * experts // 4
    assert estimate_memory(shapes, 8, "nd", True, tp=2)["params"] == (dense + experts) * 4 // 8  # without ep
    with pytest.raises(CLIError, match=r"--ep 3 does not divide the 4 processes it borrows"):
        estimate_memory(shapes, 8, "nd", True, tp=2, ep=3)
    save_model({"a.0.weight": torch.zeros(64, 32)}, tmp_path / "dense")
    with pytest.raises(CLIError, match=r"--ep 2: the model has no parameter under an 'experts' module"):
        estimate_memory(model_shapes(str(tmp_path / "dense")), 4, "nd", True, ep=2)
    assert main(["estimate-memory", str(tmp_path / "moe"), "--ep", "2", "--num-processes", "4", "--json"]) == 0
    assert [r["layout"] for r in json.loads(capsys.readouterr().out)] == ["nd (replicate 1, tp 1, ep 2)"]
    assert main(["estimate-memory", str(tmp_path / "moe"), "--ep", "2", "--layout", "fsdp"]) == 2
    assert "--ep 2 needs --layout nd" in capsys.readouterr().err
