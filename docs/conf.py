"""Sphinx configuration for the anyaccel docs (how-built.md says why Sphinx and how to build)."""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))  # this checkout's anyaccel, for autodoc and the generated reference

import anyaccel  # noqa: E402

project = "anyaccel"
release = version = anyaccel.__version__
copyright = "the anyaccel developers (Apache-2.0)"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "anyaccel_reference",  # docs/_ext: the CLI, config, variable and API pages, generated at build time
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md", "**/_*.md"]

myst_enable_extensions = ["colon_fence", "deflist", "attrs_block"]  # attrs_block: {.api-summary} tables
myst_heading_anchors = 3  # [text](page.md#a-heading) links are checked
suppress_warnings = []    # nothing: `make docs` builds with -W (a warning fails the build)

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"exclude-members": "__init__, __weakref__, __dict__"}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"anyaccel {release}"
html_static_path = ["_static"]
html_css_files = ["anyaccel.css"]  # long lines wrap instead of running off the page (docs/check_site.py measures it)
html_show_sourcelink = False


def _drop_not_run_markers(app, doctree):
    """Hide the `# not run: <why>` and `# interrupted: ...` first lines of code blocks on the site:
    they are for docs/check_examples.py (which reads the Markdown sources), not for readers."""
    from docutils import nodes

    for block in doctree.findall(nodes.literal_block):
        text = block.astext()
        if text.startswith(("# not run:", "# interrupted:")):
            rest = text.split("\n", 1)[1] if "\n" in text else ""
            block.rawsource = rest
            block.children = [nodes.Text(rest)]


def setup(app):
    app.connect("doctree-read", _drop_not_run_markers)
