"""``anyaccel test`` (real jobs through the launch path) and ``make gpu-check`` without a GPU."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from conftest import clean_env
from test_selftest import _anyaccel, _gpu_check  # helpers shared with the unit tests

ALL_CHECKS = ["process group formed", "device placement", "gather", "gather_object", "reduce", "broadcast",
              "pad_across_processes", "barrier", "mixed precision", "training steps agree across ranks",
              "save_state / load_state round trip", "hang doctor: mismatched collectives"]


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
    assert 'steps: 2 of 11, chosen by GPU_CHECK_STEPS="2 Processes,gpu_bench"' in results  # 10, 1 extra
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
