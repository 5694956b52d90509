"""``accelerate.__version__`` after the documented swap (anyaccel/as_accelerate.py,
anyaccel/compat/version_gate.py): the command printed in docs/guides/accelerate.md, run with the
real ``sed`` on the lines diffusers' ``train_*.py`` have, gives a script whose version gate takes
the branch it takes under Accelerate 1.15; replacing every word ``accelerate`` instead gets a
warning at ``Accelerator()`` naming the line and the fix, never silently the old branch."""

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


def test_replacing_every_word_warns_at_accelerator_naming_the_gate_and_the_swap(tmp_path):
    text = _rewrite(tmp_path, r"sed -i -E 's/\baccelerate\b/anyaccel/g' train.py")
    assert "version.parse(anyaccel.__version__) >= version.parse(\"0.16.0\")" in text
    proc = _run(tmp_path)
    # a warning, never an error: the script runs on (into the old branch, as the user wrote it, and on to
    # line 16, where `anyaccel.state` does not exist: only anyaccel.as_accelerate has Accelerate's modules)
    assert proc.stdout.startswith("branch: old anyaccel\n"), proc.stdout + proc.stderr
    assert "AttributeError: module 'anyaccel' has no attribute 'state'" in proc.stderr
    assert ("train.py:11: VersionGateWarning: train.py:11 compares anyaccel.__version__ (anyaccel's own version, "
            "0.1.0) with '0.16.0': it takes the other branch than the same comparison of accelerate.__version__ "
            "under Accelerate 1.15.0") in proc.stderr
    assert "import anyaccel.as_accelerate as accelerate" in proc.stderr
    assert proc.stderr.count("VersionGateWarning: ") == 1  # once per process


def test_only_gates_whose_branch_differs_are_reported():
    from anyaccel.compat.version_gate import check_source

    def check(*lines):
        return check_source("import anyaccel\n" + "\n".join(lines) + "\n", "s.py", "0.1.0")

    assert check('if version.parse(anyaccel.__version__) >= version.parse("0.16.0"): pass')  # Accelerate: True
    assert check('if version.parse(anyaccel.__version__) < version.parse("0.20.0"): old()')  # Accelerate: False
    assert check('if version.parse("0.17.0.dev0") <= version.parse(anyaccel.__version__): pass')  # mirrored
    assert check('if anyaccel.__version__ >= "0.16.0": pass')  # no version.parse
    assert check('if version.parse(anyaccel.__version__) >= version.parse("0.1.0"): pass') is None  # same either way
    assert check('if version.parse(anyaccel.__version__) >= version.parse("2.0"): pass') is None
    assert check('print(anyaccel.__version__)') is None
    # names bound by the imports a rewrite leaves: an alias of the module, __version__ imported
    assert check("import anyaccel as acc", 'ok = Version(acc.__version__) >= Version("0.16")')
    assert check("from anyaccel import __version__ as v", 'ok = version.parse(v) >= version.parse("0.16")')
    assert check("from anyaccel.as_accelerate import __version__ as v", 'ok = parse(v) >= parse("0.16")') is None
    # only code: a comment, a string or a docstring that shows a gate is not one
    assert check('# if version.parse(anyaccel.__version__) >= version.parse("0.16.0"):') is None
    assert check('doc = "version.parse(anyaccel.__version__) >= version.parse(\'0.16.0\')"') is None
    assert check('def f():', '    """if anyaccel.__version__ >= "0.16.0": ..."""') is None
    assert check("this is not python (") is None  # a file that does not parse: nothing to say
    message = check('a = anyaccel.__version__ > "0.2"', "b = 1", 'c = anyaccel.__version__ >= "0.3"')
    assert message.startswith("s.py:2 compares") and "(also line 4)" in message


def test_a_script_without_a_gate_costs_a_substring_test():
    """Accelerator() reads its script: unless a line names anyaccel's `__version__`, nothing is
    parsed (ast is not imported for it) and the check is a substring scan of the text."""
    from anyaccel.compat import version_gate

    script = "import torch\n" + "x = torch.ones(3)  # anyaccel\n" * 3000
    calls = []
    real = version_gate._gates
    version_gate._gates = lambda *a: calls.append(a) or real(*a)
    try:
        assert version_gate.check_source(script, "s.py", "0.1.0") is None and calls == []
        swapped = ("import anyaccel.as_accelerate as accelerate\n" + script
                   + 'if version.parse(accelerate.__version__) >= version.parse("0.16.0"): pass\n')
        assert version_gate.check_source(swapped, "s.py", "0.1.0") is None and calls == []  # the documented swap
        gated = script + 'if version.parse(anyaccel.__version__) >= version.parse("0.16.0"): pass\n'
        assert version_gate.check_source(gated, "s.py", "0.1.0").startswith("s.py:3002 compares") and len(calls) == 1
    finally:
        version_gate._gates = real


def test_importing_the_facade_does_not_import_ast_for_the_gate_check():
    code = ("import sys; sys.modules['ast'] = None\n"  # any import of ast fails
            "from anyaccel.compat import version_gate\n"
            "assert version_gate.check_source('x = 1\\n' * 10, 's.py', '0.1.0') is None\n")
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


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
