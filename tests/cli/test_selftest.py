"""The single-process tests; the multi-process ones (real launches, marked slow) are in tests/cli/test_selftest_multiprocess.py.

``anyaccel test`` (real jobs through the launch path) and ``make gpu-check`` without a GPU."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, anyaccel, clean_env


def _anyaccel(tmp_path, *args, timeout: float = 240) -> subprocess.CompletedProcess:
    # no config file from this machine's user; the job's results directory (in workers' command lines) under tmp_path
    env = clean_env(ANYACCEL_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path))
    return anyaccel("test", *args, timeout=timeout, env=env, cwd=tmp_path)


def test_a_script_is_refused(tmp_path):
    proc = _anyaccel(tmp_path, "--cpu", "train.py", timeout=60)
    assert proc.returncode == 2
    assert "takes no script" in proc.stderr and "anyaccel launch" in proc.stderr


def test_help_offers_the_launch_options(capsys):
    from anyaccel.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["test", "--help"])
    text = capsys.readouterr().out
    for flag in ("--num_processes", "--num_machines", "--main_process_ip", "--mixed_precision", "--config_file",
                 "--dynamo_backend", "--json", "--timeout"):
        assert flag in text
    assert "a module name" not in text  # launch's -m is not offered: there is no script


def test_merge_names_the_failing_rank_and_ranks_that_stopped(tmp_path):
    from anyaccel.selftest import merge_results

    def write(rank, checks):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "done": True, "checks": [
            {"name": n, "status": s, "detail": d, "seconds": 0.1} for n, s, d in checks]}))

    write(0, [("gather", "pass", "ok0"), ("reduce", "pass", "ok0"), ("barrier", "skip", "n/a")])
    write(1, [("gather", "pass", "ok1"), ("reduce", "fail", "sum 2, expected 3")])
    merged = {c["name"]: c for c in merge_results(str(tmp_path))}
    assert merged["gather"]["status"] == "pass" and merged["gather"]["detail"] == "ok0"
    assert merged["reduce"]["status"] == "fail" and merged["reduce"]["detail"] == "rank 1: sum 2, expected 3"
    assert merged["barrier"]["status"] == "fail" and "rank(s) 1" in merged["barrier"]["detail"]
    assert [c["name"] for c in merge_results(str(tmp_path))] == ["gather", "reduce", "barrier"]


def _gpu_check(tmp_path, path_prefix=None, **env_extra) -> subprocess.CompletedProcess:
    env = clean_env(**env_extra)
    if path_prefix:
        env["PATH"] = f"{path_prefix}{os.pathsep}{env['PATH']}"
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)


def test_gpu_check_without_a_gpu_runs_nothing(tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi: gpu-check would run")
    results = tmp_path / "results.md"
    proc = _gpu_check(tmp_path, GPU_CHECK_RESULTS=str(results), PYTHON=sys.executable)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no CUDA GPU" in proc.stdout and "nothing was run" in proc.stdout
    assert not results.exists()
    assert os.listdir(tmp_path) == []


def test_gpu_check_fails_when_nvidia_smi_lists_a_gpu_that_this_torch_cannot_use(tmp_path):
    # the lent-machine mistake: the Python found first has a CPU torch; "no GPU, exit 0" would hide it
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3'\n")
    fake.chmod(0o755)
    proc = _gpu_check(tmp_path, path_prefix=str(bin_dir), PYTHON=sys.executable, OUT=str(tmp_path / "out"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"nvidia-smi lists 1 GPU(s), but {sys.executable} has torch" in proc.stderr
    assert "without CUDA" in proc.stderr and "PYTHON=/path/to/python make gpu-check" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_gpu_check_lists_its_steps_when_gpu_check_steps_names_none(tmp_path):
    proc = _gpu_check(tmp_path, PYTHON=sys.executable, GPU_CHECK_ON_CPU="1", GPU_CHECK_STEPS="bench, nope",
                      OUT=str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "GPU_CHECK_STEPS entry 'nope' names no step" in proc.stderr
    assert "  gpu_bench.py" in proc.stderr and "  check_cuda.py" in proc.stderr
    assert "  extra: fault tolerance (tests/gpu/check_fault_tolerance.py" in proc.stderr  # GPU_CHECK_STEPS=fault
    assert not (tmp_path / "out").exists()


def test_the_checks_use_no_assert_statement():
    """An `assert` in the self-test's modules would vanish under `python -O` and report ✓."""
    import ast

    import anyaccel

    package = pathlib.Path(anyaccel.__file__).parent  # the checkout's, or the installed wheel's
    for name in ("cli/selftest.py", "cli/selftest_worker.py"):
        tree = ast.parse((package / name).read_text())
        found = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
        assert not found, f"anyaccel/{name} uses assert at lines {found}; use selftest_worker.expect"
