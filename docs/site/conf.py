"""Sphinx configuration of the course website (`make site`; docs/site/build.py stages the sources).

Sphinx + myst-nb + furo: myst-nb renders executed notebooks with every output (no re-execution:
nb_execution_mode "off"), autodoc turns the package's docstrings into the API reference, Sphinx's own
search works from file://, and MathJax is served from the site itself (the copy of MathJax 3 that
the sphinx-mathjax-offline package ships, copied into _static/mathjax), so no page loads anything
from the network."""
import importlib.metadata
from pathlib import Path

# The package's folder is named "sphinx-mathjax-offline": found through its installed files. Only the
# files are used (its extension is not parallel-safe and would make Sphinx read serially).
MATHJAX = next(Path(f.locate()).parent for f in importlib.metadata.files("sphinx-mathjax-offline")
               if f.name == "tex-svg.js").parent
project = "minizero"
author = "minizero"
copyright = "minizero contributors, MIT license"

extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.mathjax"]
# tex-svg draws glyphs as SVG paths: no web fonts, which file:// pages may not load.
mathjax_path = "mathjax/tex-svg.js"
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3
highlight_language = "none"       # an unlabelled block is program output, not Python
nb_execution_mode = "off"          # the notebooks arrive executed (tests/test_lessons.py or build.py)
nb_merge_streams = True
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "none"         # the signatures stay readable; the docstrings say the types and units

html_theme = "furo"
html_title = "minizero: distributed training, measured"
html_copy_source = False
html_show_sourcelink = False
html_static_path = ["static", str(MATHJAX)]  # the second becomes _static/mathjax/
html_css_files = ["minizero.css"]
html_js_files = ["minizero.js"]  # click a figure for its full size
suppress_warnings = ["myst.header"]


def literal_docstring(app, what, name, obj, options, lines):
    """Docstrings here are fixed-width text (equations and byte formulas aligned by spaces), not
    reStructuredText: show them as written, in a literal block."""
    if lines:
        lines[:] = ["::", ""] + ["    " + line for line in lines] + [""]


def setup(app):
    app.connect("autodoc-process-docstring", literal_docstring)
