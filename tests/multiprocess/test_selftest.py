"""``anyaccel test`` (real jobs through the launch path) and ``make gpu-check`` without a GPU."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT, anyaccel, clean_env

ALL_CHECKS = ["process group formed", "device placement", "gather", "gather_object", "reduce", "broadcast",
              "pad_across_processes", "barrier", "mixed precision", "training steps agree across ranks",
              "save_state / load_state round trip", "hang doctor: mismatched collectives"]


def _anyaccel(tmp_path, *args, timeout: float = 240) -> subprocess.CompletedProcess:
    # no config file from this machine's user; the job's results directory (in workers' command lines) under tmp_path
    env = clean_env(ANYACCEL_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path))
    return anyaccel("test", *args, timeout=timeout, env=env, cwd=tmp_path)


def _report(proc: subprocess.CompletedProcess) -> dict:
    try:
        return json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(f"not JSON (exit {proc.returncode})\nSTDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}")


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_cpu_processes_from_the_config_file_pass_every_check(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("device: cpu\nnum_processes: 2\nmixed_precision: bf16\n")
    proc = _anyaccel(tmp_path, "--config_file", str(config), "--json")
    report = _report(proc)
    assert proc.returncode == 0, proc.stderr
    assert report["verdict"] == "pass" and report["plan"]["num_processes"] == 2
    assert report["plan"]["config_file"] == str(config) and report["plan"]["mixed_precision"] == "bf16"
    assert [c["name"] for c in report["checks"]] == ALL_CHECKS
    assert all(c["status"] == "pass" and c["ranks"] == [0, 1] for c in report["checks"]), report["checks"]
    assert "backend gloo" in report["checks"][0]["detail"]
    assert "DistributedDataParallel" in report["checks"][9]["detail"]
    assert report["checks"][8]["detail"].startswith("bf16: layers compute in bfloat16")


@pytest.mark.slow
def test_one_process_lines_and_verdict(tmp_path):
    proc = _anyaccel(tmp_path, "--cpu", "--mixed_precision", "fp16")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "1 process on cpu" in lines[0] and "mixed precision fp16" in lines[0]
    marks = {line.strip()[2:].split("  ")[0].strip(): line.strip()[0] for line in lines[1:-1]}
    assert list(marks) == ALL_CHECKS
    assert marks["hang doctor: mismatched collectives"] == "–"  # needs 2 processes: skipped, said so
    assert all(m == "✓" for name, m in marks.items() if name != "hang doctor: mismatched collectives")
    assert "fp16: layers compute in float16, with a gradient scaler" in proc.stdout
    assert lines[-1].startswith("PASS: 11 checks passed, 1 skipped")


@pytest.mark.slow
def test_unreachable_main_machine_fails_fast_naming_the_address(tmp_path):
    port = _unused_port()
    t0 = time.monotonic()
    proc = _anyaccel(tmp_path, "--cpu", "--num_processes", "2", "--num_machines", "2", "--machine_rank", "1",
                     "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert elapsed < 75, f"took {elapsed:.0f} s"
    failed = [line for line in proc.stdout.splitlines() if line.strip().startswith("✗")]
    assert len(failed) == 1 and "process group formed" in failed[0], proc.stdout
    assert f"127.0.0.1:{port}" in failed[0] and "machine 0 is up" in failed[0]
    assert proc.stdout.splitlines()[-1].startswith("FAIL:")
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_timeout_stops_the_job_and_its_workers(tmp_path):
    import psutil

    t0 = time.monotonic()
    proc = _anyaccel(tmp_path, "--cpu", "--num_processes", "2", "--timeout", "2", timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert time.monotonic() - t0 < 60
    assert "did not finish within --timeout 2 s" in proc.stdout
    assert proc.stdout.splitlines()[-1].startswith("FAIL:")
    time.sleep(1)
    left = [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not left, left


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
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_gpu_check_on_the_cpu_runs_the_chosen_steps_and_writes_one_results_file(tmp_path):
    # the script's own plumbing (selection, logs, summary cells, results file), checked where no GPU is
    out = tmp_path / "out"
    proc = _gpu_check(tmp_path, PYTHON=sys.executable, GPU_CHECK_ON_CPU="1", OUT=str(out),
                      GPU_CHECK_STEPS="2 Processes,gpu_bench")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpu-check: 2 of 2 steps passed" in proc.stdout
    results = (out / "gpu-check-results.md").read_text()
    assert "GPU: **none: GPU_CHECK_ON_CPU=1**" in results
    assert 'steps: 2 of 9, chosen by GPU_CHECK_STEPS="2 Processes,gpu_bench"' in results
    assert f"torch unchanged ({__import__('torch').__version__})" in results
    rows = [line for line in results.splitlines() if line.startswith("| ") and "PASS" in line]
    assert len(rows) == 2, results
    assert rows[0].startswith("| anyaccel test (2 processes") and "PASS: 12 checks passed" in rows[0]
    assert rows[1].startswith("| gpu_bench.py | PASS") and "no CUDA device" in rows[1]
    assert "## gpu_bench.json" in results
    logs = sorted(p.name for p in (out / "gpu-check-logs").iterdir())
    assert "gpu_bench.json" in logs and "gpu_bench_py.log" in logs
    assert not any(name.startswith("check_cuda") for name in logs)


@pytest.mark.slow
def test_a_failing_check_fails_under_python_O(tmp_path):
    """`python -O` strips assert statements; the checks of `anyaccel test` must still fail when
    their expectation does not hold (here: 2 processes and bf16 expected, 1 process without)."""
    code = ("import sys\n"
            "from anyaccel import selftest_worker\n"
            "assert False, 'asserts run: this is not python -O'\n"
            f"sys.exit(selftest_worker.main(['--out', {str(tmp_path)!r}, '--expect_world', '2', "
            "'--expect_device', 'cpu', '--expect_precision', 'bf16', '--steps', '1']))\n")
    proc = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=240,
                          env=clean_env(ANYACCEL_HOME=str(tmp_path / "home")), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = {c["name"]: c for c in json.loads((tmp_path / "rank0.json").read_text())["checks"]}
    assert checks["process group formed"]["status"] == "fail"
    assert checks["process group formed"]["detail"] == "1 process(es) in the group, expected 2"
    assert checks["mixed precision"]["status"] == "fail"
    assert "Accelerator runs mixed precision 'no', expected 'bf16'" in checks["mixed precision"]["detail"]
    assert checks["gather"]["status"] == "pass"  # the others still run


def test_the_checks_use_no_assert_statement():
    """An `assert` in the self-test's modules would vanish under `python -O` and report ✓."""
    import ast

    import anyaccel

    package = pathlib.Path(anyaccel.__file__).parent  # the checkout's, or the installed wheel's
    for name in ("selftest.py", "selftest_worker.py"):
        tree = ast.parse((package / name).read_text())
        found = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
        assert not found, f"anyaccel/{name} uses assert at lines {found}; use selftest_worker.expect"
