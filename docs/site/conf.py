"""Sphinx configuration of the course website (`make site`; docs/site/build.py stages the sources).

Sphinx + myst-nb + furo: myst-nb renders executed notebooks with every output (no re-execution:
nb_execution_mode "off"), autodoc turns the package's docstrings into the API reference, and MathJax
is served from the site itself (the copy of MathJax 3 that the sphinx-mathjax-offline package ships,
copied into _static/mathjax), so no page loads anything from the network.

Search from file://: Sphinx's index is a script (searchindex.js), but each result's excerpt is cut
from the page's HTML, which searchtools.js fetch()es, and a browser refuses fetch() on file:// URLs.
So the build also writes _static/minizero-pages.js (each page's main text, a global loaded by a
<script> tag on search.html only) and minizero.js answers those fetches from it."""
import importlib.metadata
import json
import re
from html.parser import HTMLParser
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


PAGES_JS = "minizero-pages.js"


def search_page_scripts(app, pagename, templatename, context, doctree):
    if pagename == "search":  # the pages' text is for the excerpts: no other page loads it
        app.add_js_file(PAGES_JS)


class MainText(HTMLParser):
    """The text of a page's [role=main] element, headerlinks, scripts and styles left out, as
    searchtools.js leaves them out. A stream parser, not a tree: BeautifulSoup gave the same text
    on all 80 pages in 19 s where this takes 4 (load 10, 2 cores)."""
    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
            "track", "wbr"}  # no end tag: they open no level

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.depth = 0  # open elements inside main, main itself 1; 0 outside it
        self.skip = 0  # the depth of the left-out element we are in; 0 when in none
        self.found, self.parts = False, []

    def handle_starttag(self, tag, attrs):
        if tag in self.VOID:
            return
        if self.depth:
            self.depth += 1
            classes = (dict(attrs).get("class") or "").split()
            if not self.skip and (tag in ("script", "style") or "headerlink" in classes):
                self.skip = self.depth
        elif not self.found and ("role", "main") in attrs:
            self.depth, self.found = 1, True

    def handle_endtag(self, tag):
        if not self.depth or tag in self.VOID:
            return
        if self.skip == self.depth:
            self.skip = 0
        self.depth -= 1

    def handle_data(self, data):
        if self.depth and not self.skip:
            self.parts.append(data)


def main_text(html: str) -> str | None:
    """A page's main text, runs of white space as one (a third of the bytes, and the excerpt reads
    the same); None for a page without a main block."""
    parser = MainText()
    parser.feed(html)
    parser.close()
    return re.sub(r"\s+", " ", "".join(parser.parts)).strip() if parser.found else None


def page_texts(app, exception):
    """_static/minizero-pages.js: window.MINIZERO_PAGES = {page: the text of its main block}, the
    text searchtools.js would cut an excerpt from."""
    if exception is not None or app.builder.format != "html":
        return
    out = Path(app.outdir)
    pages = {}
    for path in sorted(out.rglob("*.html")):
        text = main_text(path.read_text(encoding="utf-8"))
        if text is not None:
            pages[path.relative_to(out).as_posix()] = text
    (out / "_static" / PAGES_JS).write_text("window.MINIZERO_PAGES = " + json.dumps(pages) + ";\n")


def setup(app):
    app.connect("autodoc-process-docstring", literal_docstring)
    app.connect("html-page-context", search_page_scripts)
    app.connect("build-finished", page_texts)
