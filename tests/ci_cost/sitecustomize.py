"""Test-cost measurement only (docs/contributing/testing.md, "CI's time"): imported at start-up by every Python process a
test starts while ``CI_COST_LOG`` is set (conftest puts this folder first on PYTHONPATH then); appends
one line per interpreter start and per fork to ``$CI_COST_LOG.procs``: the test's node id, the kind
(``start``/``fork``) and the command line. Nothing is imported and nothing is written otherwise."""

import os

_LOG = os.environ.get("CI_COST_LOG")


def _note(kind: str) -> None:
    try:
        with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
        line = f"{os.environ.get('CI_COST_TEST', '?')}\t{kind}\t{cmd}\n".encode()
        fd = os.open(f"{_LOG}.procs", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError:
        pass


if _LOG:
    _note("start")
    os.register_at_fork(after_in_child=lambda: _note("fork"))
