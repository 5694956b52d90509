"""The docs' reference pages match the code, and no page names a flag or variable that does not exist.

The reference pages are generated at every build by docs/_ext/anyaccel_reference.py (never committed),
so they cannot be stale in a built site; what can go wrong is the generator missing something (a new
sub-command, a flag added to a parser it does not walk, a variable outside envvars.ALL) or a
hand-written page or the README naming an `ANYACCEL_*` variable or an `anyaccel launch` flag that no
longer exists. Both fail here. Needs no Sphinx.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import shlex

import pytest
from conftest import ROOT

DOCS = ROOT / "docs"
GENERATOR = DOCS / "_ext" / "anyaccel_reference.py"

pytestmark = pytest.mark.skipif(not GENERATOR.exists(), reason="no docs/ next to the tests")


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("anyaccel_reference", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _all_parsers():
    """Every parser of the `anyaccel` command, found independently of the generator."""
    from anyaccel.cli import build_parser

    found, todo = [], [("anyaccel", build_parser())]
    while todo:
        name, parser = todo.pop()
        found.append((name, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend((f"{name} {sub}", p) for sub, p in action.choices.items())
    return found


def _section(page: str, command: str) -> str:
    """The part of the generated CLI page about ``command`` (up to the next command's heading)."""
    start = page.index(f"\n## `{command}`\n")
    end = page.find("\n## `", start + 1)
    return page[start:] if end < 0 else page[start:end]


def test_every_cli_option_of_every_command_is_on_the_cli_page(gen):
    page = gen.cli_markdown()
    for command, parser in _all_parsers():
        assert f"\n## `{command}`\n" in page, f"`{command}` is missing from the generated CLI page"
        section = _section(page, command)
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
                continue
            for flag in action.option_strings:
                assert f"`{flag}`" in section, f"`{command} {flag}` is missing from the generated CLI page"
            if not action.option_strings:
                name = action.metavar or action.dest
                assert f"`{name}`" in section, f"`{command}`'s argument {name} is missing from the CLI page"


def test_every_config_key_is_on_the_config_page(gen):
    from anyaccel.config.schema import Config, field_help

    page = gen.config_markdown()
    for field in dataclasses.fields(Config):
        assert f"| `{field.name}` |" in page, f"config key {field.name} is missing from the generated page"
        help_text = " ".join(field_help(field.name).split())  # a callable help (strategy: the registry's) is called
        assert help_text.replace("|", "\\|") in page, f"the help of config key {field.name} is not on the page"


def test_every_environment_variable_is_on_the_envvars_page(gen):
    from anyaccel import envvars

    page = gen.envvars_markdown()
    names = {v.name for v in envvars.ALL}
    # envvars.ALL is the registry: a Var defined in the module but left out of it would escape the page.
    defined = {v.name for v in vars(envvars).values() if isinstance(v, envvars.Var)}
    assert defined <= names
    for name in names:
        assert f"| `{name}` |" in page, f"{name} is missing from the generated environment-variable page"


@pytest.fixture(scope="module")
def api_pages(gen):
    return gen.api_pages()


def test_every_public_name_is_on_the_api_pages(gen, api_pages):
    import anyaccel

    text = "\n".join(api_pages.values())
    refused = api_pages["api/refused.md"]
    for name in anyaccel.__all__:
        if name == "__version__":
            continue
        if gen.refusal(getattr(anyaccel, name)):
            assert f"| `anyaccel.{name}` |" in refused, f"anyaccel.{name} only raises but is not on the refused page"
            continue
        found = [page for page, body in api_pages.items() if re.search(rf"\.\. auto\w+:: anyaccel\.{name}\n", body)]
        assert len(found) == 1, f"anyaccel.{name} is documented on {found or 'no page'} (once expected)"
    for module, names in gen.CONTRACTS:
        for name in names:
            assert f":: {module}.{name}\n" in text or f"`{module}.{name}` is `anyaccel." in text


def test_every_accelerator_member_is_on_its_group_page(gen, api_pages):
    """Properties and attributes included: accelerator.device, num_processes, is_main_process, ..."""
    members = gen.accelerator_members()
    for name in ("device", "num_processes", "process_index", "local_process_index", "is_main_process",
                 "mixed_precision", "gradient_accumulation_steps", "prepare", "backward", "gather", "save_state"):
        assert name in members, f"Accelerator.{name} is not found among its public members"
    for name, kind in members.items():
        group = gen.group_of_member(name)
        page = api_pages[f"api/{group}.md"] if group else ""
        directive = {"method": "automethod", "property": "autoproperty", "attribute": "autoattribute"}[kind]
        assert f".. {directive}:: anyaccel.Accelerator.{name}\n" in page, \
            f"Accelerator.{name} ({kind}) is not on the page of its group ({group})"
        row = re.search(rf"^\| {{py:\w+}}`~anyaccel\.Accelerator\.{name}` \| {kind} \| [^|]+ \| (.*) \| (.+) \|$", page,
                        re.M)
        assert row, f"Accelerator.{name} has no row in the summary table of {group}"
        if kind in ("property", "attribute"):
            assert row.group(1).strip(), f"the summary row of Accelerator.{name} shows no type"


def test_every_public_name_and_member_has_a_group(gen):
    """A newcomer's name (LocalSGD, a pipeline method, ...) joins a group by one line; this says which."""
    import anyaccel

    groups = {key for key, _, _ in gen.GROUPS}
    unplaced = []
    for name in gen.public_names():
        if gen.refusal(getattr(anyaccel, name)):
            continue
        group = gen.group_of_name(name)
        if group not in groups:
            unplaced.append(f"anyaccel.{name} (from {anyaccel._EXPORTS.get(name)}): add \"{name}\": \"<group>\" to "
                            f"NAME_GROUPS, or its module to MODULE_GROUPS")
    for name in gen.accelerator_members():
        if gen.group_of_member(name) not in groups:
            unplaced.append(f"Accelerator.{name}: add it to a group's names in ACCELERATOR_GROUPS")
    assert not unplaced, ("names without a group on the API reference (docs/_ext/anyaccel_reference.py; groups: "
                          + ", ".join(sorted(groups)) + "):\n" + "\n".join(unplaced))


def test_every_public_name_has_a_docstring(gen):
    missing = gen.missing_docstrings()
    assert not missing, "public names without a docstring (the API reference shows nothing for them):\n" + \
        "\n".join(missing)


def test_every_attribute_an_accelerator_sets_is_declared_with_a_comment(gen):
    """``accelerator.device``, ``.step``, ... are set in ``__init__``: the class body declares them
    (``#: what it holds`` above ``name: type``) so that the reference shows them with their type."""
    declared = gen.accelerator_attributes()
    undeclared = [n for n in gen.accelerator_instance_attributes() if n not in declared]
    assert not undeclared, ("Accelerator sets public attributes the reference cannot see: declare each in the class "
                            "body of Accelerator (anyaccel/accelerator.py) as `#: what it holds. Local.` followed by "
                            "`name: type`:\n" + "\n".join(undeclared))


def test_the_docstring_and_group_checks_can_fail(gen, monkeypatch):
    import dataclasses as dc

    @dc.dataclass
    class NoDoc:
        x: int = 0

    class Documented:
        """Has one."""

    assert gen._own_doc(NoDoc) == "" and gen._own_doc(Documented) == "Has one."
    assert gen._own_doc(property(lambda self: 1)) == ""
    assert gen._own_doc(property(lambda self: 1, doc="The value. Local.")) == "The value. Local."
    assert gen.group_of_member("no_such_member") is None
    import anyaccel

    monkeypatch.setitem(anyaccel._EXPORTS, "NewThing", "anyaccel.somewhere_new")
    assert gen.group_of_name("NewThing") is None
    monkeypatch.setitem(gen.MODULE_GROUPS, "anyaccel.somewhere_new", "utilities")
    assert gen.group_of_name("NewThing") == "utilities"


def test_names_that_only_raise_are_apart_with_their_reason(gen, api_pages):
    from anyaccel.utils._refuse import WHY

    refused = api_pages["api/refused.md"]
    for name in ("DeepSpeedPlugin", "cpu_offload_with_hook"):
        import anyaccel

        if not gen.refusal(getattr(anyaccel, name)):
            continue  # became a real name: then it is in its group like any other
        row = next(line for line in refused.splitlines() if line.startswith(f"| `anyaccel.{name}` |"))
        assert gen._cell(WHY[getattr(anyaccel, name).anyaccel_refused]) in row
        for key, _, _ in gen.GROUPS:
            assert f"anyaccel.{name}`" not in api_pages[f"api/{key}.md"], f"{name} only raises but sits in {key}"


def test_generated_pages_are_deterministic(gen, tmp_path):
    first = [p.read_text() for p in gen.generate(tmp_path / "a")]
    second = [p.read_text() for p in gen.generate(tmp_path / "b")]
    assert first == second and all(first)


def _prose_files():
    files = [ROOT / "README.md"] + sorted(p for p in DOCS.rglob("*.md")
                                          if "_build" not in p.parts and "generated" not in p.parts)
    return [p for p in files if p.exists()]


def test_no_page_names_a_variable_that_does_not_exist():
    from anyaccel import envvars

    names = {v.name for v in envvars.ALL}
    # the test harnesses' own variables (scripts/*.sh) exist too: e.g. ANYACCEL_CLUSTER_HOSTS in scripts/cluster.sh
    names |= {n for script in sorted((ROOT / "scripts").glob("*.sh"))
              for n in re.findall(r"\$\{(ANYACCEL_[A-Z0-9_]*[A-Z0-9])\b", script.read_text())}
    unknown = []
    for path in _prose_files():
        for name in set(re.findall(r"\bANYACCEL_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())):
            if name not in names:
                unknown.append(f"{path.relative_to(ROOT)}: {name}")
    assert not unknown, "pages name ANYACCEL_* variables that anyaccel/envvars.py does not define:\n" + "\n".join(unknown)


def _launch_lines(text: str):
    """Command lines `anyaccel launch|test ...` written in the docs (code spans and code blocks):
    (sub-command, the words after it up to the end of the line or code span)."""
    for match in re.finditer(r"anyaccel (launch|test)\b([^`|\n]*(?:\\\n[^`|\n]*)*)", text):
        yield match.group(1), match.group(2).replace("\\\n", " ")


def _unknown_flags(parser: argparse.ArgumentParser, words):
    """Flags before the script that ``parser`` does not know (the script's own flags are not checked)."""
    known = parser._option_string_actions
    expect_value = False
    for word in words:
        if word.startswith("#"):
            return
        if expect_value:
            expect_value = False
            continue
        if not word.startswith("-"):
            return  # the script (or -m's module, consumed as a value below): what follows is the script's
        flag = word.split("=")[0]
        if flag not in known:
            yield flag
            continue
        expect_value = known[flag].nargs != 0 and "=" not in word


def test_no_page_uses_a_launch_flag_that_does_not_exist():
    parsers = dict(_all_parsers())
    unknown = []
    for path in _prose_files():
        for command, rest in _launch_lines(path.read_text()):
            try:
                words = shlex.split(rest, comments=False, posix=True)
            except ValueError:
                words = rest.split()
            for flag in _unknown_flags(parsers[f"anyaccel {command}"], words):
                unknown.append(f"{path.relative_to(ROOT)}: anyaccel {command} {flag}")
    assert not unknown, "pages use flags that the parser does not have:\n" + "\n".join(sorted(set(unknown)))


def test_the_flag_check_can_fail():
    parser = dict(_all_parsers())["anyaccel launch"]
    words = shlex.split("--num_processes 2 --cpu --no_such_flag train.py --lr 3e-4")
    assert list(_unknown_flags(parser, words)) == ["--no_such_flag"]


def test_the_most_used_names_on_the_api_index_exist(gen, api_pages):
    members, names = gen.accelerator_members(), set(gen.public_names())
    for _, name in gen.MOST_USED:
        owner, _, member = name.partition(".")
        assert (member in members) if owner == "Accelerator" and member else (name in names), name
        assert f"`~anyaccel.{name}`" in api_pages["api.md"]


def test_every_function_method_and_property_says_collective_or_local(gen, api_pages):
    """The house rule the summary tables show in their "who calls it" column."""
    silent = []
    for page, body in api_pages.items():
        for line in body.splitlines():
            cells = line.split(" | ")
            if len(cells) >= 5 and cells[1] in ("method", "function", "property", "attribute") and cells[2] == "—":
                silent.append(f"{cells[0][2:]} ({page})")
    assert not silent, ("docstrings that say neither 'Collective' (every process calls it) nor 'Local' (any process "
                        "may): add the word, with who receives what:\n" + "\n".join(silent))
    assert gen._who("Gather them. Collective.") == "Collective" and gen._who("Local; no communication.") == "Local"
    assert gen._who("A value.") == "—"
