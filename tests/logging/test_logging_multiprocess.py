"""The multi-process tests (real launches, marked slow); the single-process ones are in tests/logging/test_logging.py.

Rank-aware logger and progress bars: prefix, main-only by default, every rank on request."""

import textwrap

import pytest

from conftest import warm_launch


SCRIPT = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    from anyaccel import Accelerator, get_logger
    logger = get_logger("demo")            # created before the Accelerator: rank comes from the launcher
    logger.info("MAIN-ONLY-BEFORE")
    acc = Accelerator()
    logger.info("MAIN-ONLY")
    logger.info("EVERY-RANK", main_process_only=False)
    for r in range(2):
        logger.info("ORDERED %d", r, in_order=True)
    acc.print("PRINTED")
    for _ in acc.progress(range(3), desc="BAR-DESC"):
        pass
    acc.end_training()
""")


@pytest.mark.slow
def test_two_real_processes(tmp_path):
    script = tmp_path / "log_demo.py"
    script.write_text(SCRIPT)
    out = warm_launch(2, script)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines.count("[rank 0] MAIN-ONLY-BEFORE") == 1 and "[rank 1] MAIN-ONLY-BEFORE" not in lines
    assert lines.count("[rank 0] MAIN-ONLY") == 1 and "[rank 1] MAIN-ONLY" not in lines
    assert sorted(line for line in lines if "EVERY-RANK" in line) == ["[rank 0] EVERY-RANK", "[rank 1] EVERY-RANK"]
    ordered = [line for line in lines if "ORDERED" in line]
    assert ordered == ["[rank 0] ORDERED 0", "[rank 1] ORDERED 0", "[rank 0] ORDERED 1", "[rank 1] ORDERED 1"]
    assert lines.count("PRINTED") == 1
    bar_lines = [seg for seg in out.stderr.replace("\r", "\n").splitlines() if "BAR-DESC" in seg]
    assert sum("3/3" in seg for seg in bar_lines) == 1, out.stderr  # one bar (rank 0's), not two
