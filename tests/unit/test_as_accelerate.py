"""``accelerate.__version__`` after the documented swap (anyaccel/as_accelerate.py,
anyaccel/compat/version_gate.py): the command printed in docs/guides/accelerate.md, run with the
real ``sed`` on the lines diffusers' ``train_*.py`` have, gives a script whose version gate takes
the branch it takes under Accelerate 1.15; replacing every word ``accelerate`` instead stops the
script at ``Accelerator()`` with the line and the fix, never silently on the old branch."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, clean_env

# The lines of diffusers' examples/unconditional_image_generation/train_unconditional.py (v0.40)
# that touch the name `accelerate` (and the other imports a swap must leave working).
SCRIPT = textwrap.dedent('''\
    import accelerate
    import accelerate as acc
    from accelerate import Accelerator, __version__ as accelerate_version
    from accelerate.logging import get_logger
    from accelerate.utils import ProjectConfiguration
    from packaging import version

    logger = get_logger(__name__)
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir="."))
    # `accelerate` 0.16.0 will have better support for customized saving
    if version.parse(accelerate.__version__) >= version.parse("0.16.0"):
        print("branch: hooks registered")
    else:
        print("branch: old accelerate")
    print("alias", acc.__version__, "from-import", accelerate_version)
    print("initialized", accelerate.state.is_initialized(), accelerate.utils.ProjectConfiguration.__module__)
    accelerator.end_training()
''')


def documented_command() -> str:
    """The first ``sed -i -E`` command of the Accelerate guide, as a user copies it."""
    text = (ROOT / "docs" / "guides" / "accelerate.md").read_text()
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        if "sed -i -E" in block:
            lines = [line for line in block.splitlines() if not line.lstrip().startswith("#")]
            return "\n".join(lines).strip()
    raise AssertionError("docs/guides/accelerate.md shows no sed command")


def _rewrite(tmp_path, command: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    subprocess.run(["bash", "-c", command], cwd=tmp_path, check=True, timeout=60)
    return path.read_text()


def _run(tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                          timeout=300)


def test_the_documented_swap_keeps_accelerates_version_gate_branch(tmp_path):
    text = _rewrite(tmp_path, documented_command())
    assert "import anyaccel.as_accelerate as accelerate\n" in text
    assert "import anyaccel.as_accelerate as acc\n" in text
    assert "from anyaccel.as_accelerate import Accelerator, __version__ as accelerate_version" in text
    assert "from anyaccel.logging import get_logger" in text and "from anyaccel.utils import ProjectConfiguration" in text
    assert "version.parse(accelerate.__version__)" in text and "accelerator = Accelerator(" in text  # code untouched
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["branch: hooks registered", "alias 1.15.0 from-import 1.15.0",
                                        "initialized True anyaccel.checkpoint.layout"]


def test_replacing_every_word_stops_at_accelerator_naming_the_gate(tmp_path):
    text = _rewrite(tmp_path, r"sed -i -E 's/\baccelerate\b/anyaccel/g' train.py")
    assert "version.parse(anyaccel.__version__) >= version.parse(\"0.16.0\")" in text
    proc = _run(tmp_path)
    assert proc.returncode != 0 and "branch:" not in proc.stdout
    assert ("train.py:11 compares anyaccel.__version__ (anyaccel's own version, 0.1.0) with '0.16.0': as written it "
            "takes the other branch than under Accelerate 1.15.0") in proc.stderr
    assert "import anyaccel.as_accelerate as accelerate" in proc.stderr


def test_only_gates_whose_branch_differs_are_refused():
    from anyaccel.compat.version_gate import check_source

    def check(line):
        return check_source(f"import anyaccel\n{line}\n", "s.py", "0.1.0")

    assert check('if version.parse(anyaccel.__version__) >= version.parse("0.16.0"): pass')  # Accelerate: True
    assert check('if version.parse(anyaccel.__version__) < version.parse("0.20.0"): old()')  # Accelerate: False
    assert check('if version.parse("0.17.0.dev0") <= version.parse(anyaccel.__version__): pass')  # mirrored
    assert check('if version.parse(anyaccel.__version__) >= version.parse("0.1.0"): pass') is None  # same either way
    assert check('if version.parse(anyaccel.__version__) >= version.parse("2.0"): pass') is None
    assert check('print(anyaccel.__version__)') is None


def test_accelerate_version_is_the_installed_accelerate_the_names_are_checked_against():
    from anyaccel import as_accelerate

    try:
        installed = importlib.metadata.version("accelerate")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("accelerate is not installed (the test extra pins it)")
    assert as_accelerate.__version__ == as_accelerate.ACCELERATE_VERSION == installed
    assert as_accelerate.Accelerator.__module__ == "anyaccel.accelerator"
    assert as_accelerate.utils.set_seed is importlib.import_module("anyaccel.utils").set_seed
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        _ = as_accelerate.no_such_thing
