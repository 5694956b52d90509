"""Rank-aware logger and progress bars: prefix, main-only by default, every rank on request."""

import logging

import pytest

from anyaccel.logging import get_logger, process_position, progress

TORCHRUN_VARS = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}


@pytest.fixture
def no_launcher(monkeypatch):
    for k in list(TORCHRUN_VARS) + ["GROUP_RANK", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_PROCID",
                                    "OMPI_COMM_WORLD_RANK", "PMI_RANK"]:
        monkeypatch.delenv(k, raising=False)


def test_single_process_messages_carry_rank_prefix(no_launcher, caplog):
    logger = get_logger("anyaccel.test.single", log_level="INFO")
    with caplog.at_level(logging.INFO, logger="anyaccel.test.single"):
        logger.info("hello %s", "world")
        logger.debug("hidden")
    assert [r.getMessage() for r in caplog.records] == ["[rank 0] hello world"]
    assert caplog.records[0].filename == "test_logging.py"  # the caller's line, not the adapter's


def test_rank_read_from_launcher_variables_without_an_accelerator(no_launcher, monkeypatch, caplog):
    for k, v in TORCHRUN_VARS.items():
        monkeypatch.setenv(k, v)
    assert process_position() == (1, 1, 2)
    logger = get_logger("anyaccel.test.rank1", log_level=logging.INFO)
    with caplog.at_level(logging.INFO, logger="anyaccel.test.rank1"):
        logger.info("main only")                              # default: rank 0 only → dropped here
        logger.warning("everyone", main_process_only=False)
    assert [r.getMessage() for r in caplog.records] == ["[rank 1] everyone"]


def test_slurm_rank_is_recognised(no_launcher, monkeypatch):
    for k, v in {"SLURM_JOB_ID": "77", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
                 "SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_NODELIST": "n[1-2]"}.items():
        monkeypatch.setenv(k, v)
    assert process_position() == (3, 1, 4)


def test_log_level_from_environment(no_launcher, monkeypatch):
    monkeypatch.setenv("ANYACCEL_LOG_LEVEL", "ERROR")
    assert get_logger("anyaccel.test.envlevel").logger.level == logging.ERROR


def test_progress_bar_only_where_main(capsys):
    items = list(progress(range(5), main=False, desc="HIDDEN"))
    bar = progress(total=3, main=False)
    bar.update(1)
    bar.set_postfix(loss=1.0)
    bar.close()
    assert items == [0, 1, 2, 3, 4]
    assert "HIDDEN" not in capsys.readouterr().err
    assert list(progress(range(5), main=True, desc="SHOWN")) == [0, 1, 2, 3, 4]
    assert "SHOWN" in capsys.readouterr().err
