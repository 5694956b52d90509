"""`scontrol requeue` from inside the job it requeues: SLURM ends the job's processes (SIGTERM)
while scontrol waits for its answer; anyaccel's requeue must still report the requeue it asked for
(seen on a real two-node SLURM: "`scontrol requeue 3` failed: " with nothing after it)."""

from __future__ import annotations

import os
import types

from anyaccel.preemption import requeue_slurm_job


def _fake_scontrol(tmp_path, monkeypatch, requeue_body: str):
    log = tmp_path / "scontrol.log"
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n"
                    f"echo \"$@\" >> {log}\n"
                    "[ \"$1\" = show ] && { echo 'JobId=4242 Requeue=1'; exit 0; }\n"
                    f"{requeue_body}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    return log


def test_the_requeue_is_reported_when_slurm_sigterms_scontrol_while_it_waits(tmp_path, monkeypatch):
    log = _fake_scontrol(tmp_path, monkeypatch, "kill -TERM $$\nsleep 0.2\nexit 0")  # SLURM's kill, then the answer
    note = requeue_slurm_job(launch=types.SimpleNamespace(slurm_requeue_id="4242"))
    assert note == "SLURM job 4242 requeued; it resumes from this checkpoint when it starts again"
    assert log.read_text().splitlines() == ["show job 4242", "requeue 4242"]


def test_a_scontrol_killed_before_it_answers_is_said_so(tmp_path, monkeypatch):
    _fake_scontrol(tmp_path, monkeypatch, "kill -KILL $$")
    note = requeue_slurm_job(launch=types.SimpleNamespace(slurm_requeue_id="4242"))
    assert note.startswith("`scontrol requeue 4242` was ended by signal 9 before it answered")
    assert "squeue -j 4242" in note


def test_a_refused_requeue_says_what_scontrol_said(tmp_path, monkeypatch):
    _fake_scontrol(tmp_path, monkeypatch, "echo 'Access/permission denied' >&2; exit 1")
    note = requeue_slurm_job(launch=types.SimpleNamespace(slurm_requeue_id="4242"))
    assert note == "`scontrol requeue 4242` failed: Access/permission denied"
