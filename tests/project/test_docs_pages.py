"""What a reader of the README and the docs relies on, beyond the generated reference (issue 33):

* the README's links work on a code host without a build (they point at files in the repository,
  never at generated or ignored ones);
* every "ran" / "not run" claim lives in one table, docs/status/support.md, which the other pages
  link instead of repeating it; that table gives one date per row;
* the README and the install page describe `make test` the same way, naming every step the
  Makefile runs;
* no page points at a file that is not in the repository (the team's ANCHORS notes).
"""

from __future__ import annotations

import re
import subprocess

import pytest
from conftest import ROOT

DOCS = ROOT / "docs"
SUPPORT = "docs/status/support.md"
HISTORY = "docs/status/history.md"  # earlier figures and claims, kept as they were written

pytestmark = pytest.mark.skipif(not (DOCS / "index.md").exists(), reason="no docs/ next to the tests")

# "it ran", "has not run", "never run", "run on an H100": claims about where anyaccel has run
CLAIM = re.compile(r"has not run|have not run|not run yet|never run|\*\*ran\b|\bran\*\*|\bran (?:on|in) 20\d\d"
                   r"|\bran 20\d\d|\brun on an? [A-Z]\w*\d|\bnot yet run\b", re.I)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _pages():
    return [ROOT / "README.md", ROOT / "benchmarks" / "README.md"] + sorted(
        p for p in DOCS.rglob("*.md") if "_build" not in p.parts and "generated" not in p.parts)


def _prose(text: str) -> str:
    """Markdown without its fenced code blocks (a `# not run:` marker is not a claim)."""
    return re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)


def _ignored(paths):
    """The paths git ignores (none when this is not the project's own checkout: `make test-wheel`
    runs from a copy inside build/, which git ignores as a whole)."""
    if not (ROOT / ".git").exists():
        return set()
    try:
        proc = subprocess.run(["git", "check-ignore", *map(str, paths)], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return set()
    return {line.strip() for line in proc.stdout.splitlines() if line.strip()}


@pytest.mark.parametrize("readme", ["README.md", "benchmarks/README.md"])
def test_readme_links_work_without_a_build(readme):
    page = ROOT / readme
    targets = {}
    for target in LINK.findall(page.read_text()):
        if re.match(r"^(https?:|mailto:|#)", target):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        targets[target] = path
    assert targets, f"{readme} has no relative links: the test reads nothing"
    missing = [t for t, p in targets.items() if not p.exists()]
    assert not missing, f"{readme} links to files that do not exist: {missing}"
    ignored = _ignored(targets.values())
    generated = [t for t, p in targets.items() if str(p) in ignored or "generated" in p.parts or "_build" in p.parts]
    assert not generated, (f"{readme} links to generated or git-ignored files, dead on a code host until someone "
                           f"builds the docs; link the docs sources instead: {generated}")


def test_the_link_check_can_fail(tmp_path):
    ignored = _ignored([ROOT / "docs" / "reference" / "generated" / "cli.md"])
    if (ROOT / ".git").exists():  # the project's own checkout (not make test-wheel's copy)
        assert str(ROOT / "docs" / "reference" / "generated" / "cli.md") in ignored


def test_ran_and_not_run_claims_live_only_in_the_support_table():
    found = []
    for path in _pages():
        rel = path.relative_to(ROOT).as_posix()
        if rel in (SUPPORT, HISTORY):
            continue
        for number, line in enumerate(_prose(path.read_text()).splitlines(), 1):
            m = CLAIM.search(line)
            if m:
                found.append(f"{rel}: {m.group(0)!r} in {line.strip()[:140]!r}")
    assert not found, ("claims about where anyaccel has run outside docs/status/support.md; put them in its table "
                       "and link it ([support](docs/status/support.md)):\n" + "\n".join(found))
    assert CLAIM.search("SLURM over several nodes has not run yet") and CLAIM.search("**ran 2026-11-24**")


def test_the_support_table_has_one_date_per_row_and_no_date_above_it():
    text = (ROOT / SUPPORT).read_text()
    first_table = text.index("\n|")
    assert not re.search(r"20\d\d-\d\d-\d\d", text[:first_table]), \
        "support.md dates something above its table: the rows carry the dates"
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| device |")]
    assert len(rows) > 10
    for row in rows:
        dates = re.findall(r"20\d\d-\d\d-\d\d", row)
        assert len(set(dates)) <= 1, f"a row of support.md with {len(set(dates))} dates: {row[:120]}"


def test_make_test_is_described_alike_and_completely():
    rows = []
    for page in ("README.md", "docs/get-started/install.md"):
        rows.append(next(line for line in (ROOT / page).read_text().splitlines() if line.startswith("| `make test` |")))
    assert rows[0] == rows[1], "README.md and docs/get-started/install.md describe `make test` differently"
    recipe = re.search(r"^test: .*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    for tool in ("lint-imports", "ruff", "mypy", "pytest", "test-xla"):
        if tool in recipe:
            assert tool in rows[0], f"`make test` runs {tool}, which the README's description does not name"


def test_no_page_points_at_the_teams_private_notes():
    for path in _pages():
        assert "ANCHORS" not in path.read_text(), \
            f"{path.relative_to(ROOT)} cites ANCHORS, a file that is not in this repository"
