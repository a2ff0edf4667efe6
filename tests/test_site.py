"""The course website in a real browser: headless Chromium (the OS package) driven by playwright.

The site is built into site/ here (docs/site/build.py; the lessons tests/test_lessons.py executed are
reused, so in a full run this file's build executes no notebook), unless MINIZERO_SITE names one that
`make site` already built (`make site-test`). Every page is opened from file://, as a reader without a
network would: no console error and no failed request, every image decoded and not blank, every
internal link and anchor resolves, every lesson page shows the numbers its notebook printed and a
title in the lessons' one style, no code block is cut at its column's edge, and search (in a
browser that refuses fetch() on file://, as a reader's does) finds a lesson with an excerpt.
Screenshots go to build/site-test/: start.png, lesson-04_*-top.png (title and run stamp),
lesson-04_*.png (its first plot) and search.png, and report.json (pages, images per lesson page,
and for its own build the lessons it executed and its seconds).
Skipped, with the reason, where the site's packages (`pip install -e ".[site]"`) or Chromium are
missing: this test installs nothing."""
import json
import os
import re
import shutil
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from tests.test_bench import CANDIDATES as BENCH_CANDIDATES
from tests.test_lessons import title_problem

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "build" / "site-test"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
NUMBER = re.compile(r"(?<![\w.])-?\d+\.\d+")


def _browser():
    named = os.environ.get("CHROMIUM")
    return named if named and os.path.exists(named) else next(filter(None, map(shutil.which, BROWSERS)), None)


def _missing():
    for module in ("sphinx", "myst_nb", "furo", "playwright"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed: `make site` / `make site-test` install the site extra"
    if _browser() is None:
        return (f"no Chromium on this machine (looked for {', '.join(BROWSERS)} on PATH and $CHROMIUM): `apt-get "
                "install chromium`")
    return None


MISSING = _missing()
# a Sphinx build and a browser: not in `make check`
pytestmark = [pytest.mark.skipif(MISSING is not None, reason=MISSING or ""), pytest.mark.launches]


# The bench run for this test's own build (build/bench/test/, kept): tests/test_bench.py's tiny run
# (2 ranks, 3 timed steps, 3 candidates; ~12 s of CPU where --steps 10 over every candidate took
# ~60 s): the page, its plot and its report are what this test checks, not the figures (make site
# runs the short or full bench).
BUILD: dict = {}  # what this test's own build did (report.json)
BENCH_ARGS = ["--nprocs", "2", "--steps", "3", "--warmup", "1", "--candidates", *BENCH_CANDIDATES]


@pytest.fixture(scope="module")
def site():
    if os.environ.get("MINIZERO_SITE"):
        out = Path(os.environ["MINIZERO_SITE"]).resolve()
        assert (out / "index.html").exists(), f"MINIZERO_SITE={out} holds no built site: run `make site`"
        return out
    from docs.site.build import build
    from docs.site.notebooks import executed_copy
    # In a full run tests/test_lessons.py has just executed every lesson: the build re-executes none (report.json
    # says which it did, and how long the build took, so a fresh-clone CI run shows whether the reuse worked).
    BUILD["lessons_executed_by_the_build"] = [p.name for p in sorted((ROOT / "lessons").glob("*.ipynb"))
                                              if executed_copy(p) is None]
    out = ROOT / "site"
    summary = build(out, bench="test", bench_args=BENCH_ARGS)
    BUILD["build_s"], BUILD["warnings"] = summary["total_s"], summary["warnings"]
    return out


def test_the_build_says_no_warning(site):
    """Sphinx's warnings and errors of this test's own build: none (in a fresh clone it reads every page, so a
    docstring Sphinx cannot render, or an object documented twice, shows here)."""
    if "warnings" not in BUILD:
        pytest.skip("MINIZERO_SITE names a site built elsewhere: its build's warnings were printed there")
    assert BUILD["warnings"] == [], "\n".join(BUILD["warnings"])


def _output_text(output) -> str:
    """What a rendered output shows as text: stream text, or the markdown / plain text of a result
    that has no HTML or image (myst-nb renders those instead); math spans dropped (MathJax draws them)."""
    if output.get("output_type") == "stream":
        return "".join(output.get("text", ""))
    data = output.get("data", {})
    if any(mime.startswith("image/") or mime == "text/html" for mime in data):
        return ""
    text = data.get("text/markdown") or data.get("text/plain") or ""
    text = "".join(text) if isinstance(text, list) else text
    return re.sub(r"\$\$.*?\$\$|\$[^$]*\$", " ", text, flags=re.DOTALL) if "text/markdown" in data else text


def _lesson_outputs(stem: str):
    nb = json.loads((ROOT / "build" / "site-src" / "lessons" / f"{stem}.ipynb").read_text())
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    numbers = sorted({n for o in outputs for n in NUMBER.findall(_output_text(o))})
    plots = sum("image/png" in o.get("data", {}) for o in outputs)
    return numbers, plots


JS_PAGE = """async () => {
  const images = [];
  for (const img of Array.from(document.images)) {
    const r = {src: img.getAttribute('src'), complete: img.complete,
               width: img.naturalWidth, height: img.naturalHeight};
    if (img.complete && img.naturalWidth > 0) {
      try { await img.decode(); r.decoded = true; } catch (e) { r.decoded = false; }
      const w = Math.min(img.naturalWidth, 400), h = Math.max(1, Math.round(img.naturalHeight * w / img.naturalWidth));
      const canvas = document.createElement('canvas'); canvas.width = w; canvas.height = h;
      const ctx = canvas.getContext('2d'); ctx.drawImage(img, 0, 0, w, h);
      const px = ctx.getImageData(0, 0, w, h).data, seen = new Set();
      for (let i = 0; i < px.length && seen.size < 2; i += 4)
        seen.add((px[i] << 24) | (px[i+1] << 16) | (px[i+2] << 8) | px[i+3]);
      r.colors = seen.size;
    }
    images.push(r);
  }
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  // Code cut at the column's edge: a block (pre) or inline code whose content reaches past the
  // article's right edge, or past its own box, with neither it nor a box between it and the
  // article scrolling sideways.
  const column = document.querySelector('article') || document.body;
  const edge = column.getBoundingClientRect().right + 1;
  const scrolls = (el) => ['auto', 'scroll'].includes(getComputedStyle(el).overflowX);
  const cut = [];
  let blocks = 0, scrolling = 0;
  for (const el of column.querySelectorAll('pre, code')) {
    if (el.tagName === 'CODE' && el.closest('pre')) continue;
    const box = el.getBoundingClientRect();
    if (box.width === 0) continue;  // not shown (a collapsed cell)
    blocks += 1;
    const spills = el.tagName === 'PRE' && el.scrollWidth > el.clientWidth + 1;
    if (spills && scrolls(el)) { scrolling += 1; continue; }
    const clipped = spills && ['hidden', 'clip'].includes(getComputedStyle(el).overflowX);
    const reach = box.left + Math.max(el.scrollWidth, box.width);
    // a box inside the column that scrolls sideways: what reaches past the edge is in reach
    // (furo's table wrapper reaches 6 px past the article: a negative margin)
    let scroller = null;
    for (let a = el.parentElement; a && a !== column; a = a.parentElement)
      if (scrolls(a) && a.getBoundingClientRect().right <= edge + 8) { scroller = a; break; }
    if (!clipped && reach > edge && scroller) { scrolling += 1; continue; }
    if (clipped || reach > edge)
      cut.push({tag: el.tagName, reach: Math.round(reach), edge: Math.round(edge), clipped,
                text: el.textContent.trim().split('\\n').find(l => l.length > 0)?.slice(0, 100)});
  }
  const h1 = document.querySelector('article h1');
  let heading = null;
  if (h1) {
    const c = h1.cloneNode(true);
    c.querySelectorAll('.headerlink').forEach(e => e.remove());
    heading = c.textContent.trim();
  }
  return {images, links: Array.from(document.querySelectorAll('a[href]')).map(a => a.href),
          ids: Array.from(document.querySelectorAll('[id]')).map(e => e.id),
          text: document.body.innerText, title: document.title, heading,
          code: {blocks, scrolling, cut}};
}"""


@pytest.fixture(scope="module")
def visited(site):
    """Every page of the site, opened once in one headless Chromium: what each showed and logged."""
    from playwright.sync_api import sync_playwright
    SHOTS.mkdir(parents=True, exist_ok=True)
    pages = {}
    with sync_playwright() as pw:
        # --allow-file-access-from-files: the image check reads pixels back through a canvas.
        browser = pw.chromium.launch(executable_path=_browser(),
                                     args=["--no-sandbox", "--allow-file-access-from-files"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors = []
        page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
        page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url} ({r.failure})"))
        for path in sorted(site.rglob("*.html")):
            errors.clear()
            page.goto(path.as_uri(), wait_until="load")
            seen = page.evaluate(JS_PAGE)
            page.wait_for_timeout(50)  # let late console messages arrive
            pages[path.relative_to(site).as_posix()] = {**seen, "errors": list(errors)}
        page.goto((site / "index.html").as_uri())
        page.screenshot(path=str(SHOTS / "start.png"))
        lesson = sorted(site.glob("lessons/04_*.html")) or sorted(site.glob("lessons/[0-9]*.html"))
        page.goto(lesson[0].as_uri())
        page.screenshot(path=str(SHOTS / f"lesson-{lesson[0].stem}-top.png"))  # the title and the run stamp
        first_plot = page.locator("img").first
        if first_plot.count():
            first_plot.scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / f"lesson-{lesson[0].stem}.png"))
        browser.close()
    return {"site": site, "pages": pages}


SEARCH_TERM = "ZeRO-1"
# Every result with no description (a page or a section, not an API object) and what its excerpt
# says; read once Sphinx says "Search finished" (it shows results one by one, 5 ms apart; API pages
# come first, so a partial list may hold no lesson) and every such result has its excerpt or 10 s
# have passed.
JS_RESULTS = """() => Array.from(document.querySelectorAll('#search-results ul.search li'))
  .filter(li => !li.querySelector(':scope > span'))
  .map(li => ({href: li.querySelector('a').href,
               excerpt: li.querySelector('p.context')?.innerText ?? null}))"""


@pytest.fixture(scope="module")
def searched(site):
    """search.html?q=ZeRO-1 from file:// in a Chromium that, like a reader's browser, refuses
    fetch() of file:// URLs (no --allow-file-access-from-files): the results, their excerpts, the
    console's errors."""
    from playwright.sync_api import TimeoutError as Timeout
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=_browser(), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors = []
        page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}")
                if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
        page.goto((site / "search.html").as_uri() + f"?q={SEARCH_TERM}")
        page.wait_for_function("() => (document.querySelector('#search-results p.search-summary') || {})"
                               ".innerText?.startsWith('Search finished')", timeout=60_000)
        try:
            page.wait_for_function(f"() => ({JS_RESULTS})().every(r => r.excerpt !== null)",
                                   timeout=10_000)
        except Timeout:
            pass  # the test below says which results have none
        results = page.evaluate(JS_RESULTS)
        page.screenshot(path=str(SHOTS / "search.png"))
        browser.close()
    return {"results": results, "errors": errors}


def test_every_page_loads_without_console_errors(visited):
    bad = {name: p["errors"] for name, p in visited["pages"].items() if p["errors"]}
    assert not bad, f"{len(bad)} of {len(visited['pages'])} pages logged errors: {json.dumps(bad, indent=1)[:3000]}"


def test_every_image_is_decoded_and_not_blank(visited):
    images = [(name, img) for name, p in visited["pages"].items() for img in p["images"]]
    bad = [(name, img) for name, img in images
           if not (img["complete"] and img["width"] > 0 and img.get("decoded") and img.get("colors", 0) > 1)]
    assert images and not bad, f"{len(bad)} of {len(images)} images not decoded or of one colour: {bad[:10]}"


def test_every_internal_link_resolves(visited):
    site, pages = visited["site"], visited["pages"]
    broken, checked = [], 0
    for name, p in pages.items():
        for href in p["links"]:
            url = urlsplit(href)
            if url.scheme != "file":
                assert url.scheme in ("http", "https", "mailto"), f"{name}: link {href}"
                continue
            target = Path(unquote(url.path))
            checked += 1
            if not target.exists():
                broken.append(f"{name} -> {href} (no such file)")
                continue
            assert target.resolve().is_relative_to(site), f"{name} links outside the site: {href}"
            page = pages.get(target.resolve().relative_to(site).as_posix())
            if url.fragment and page is not None and unquote(url.fragment) not in page["ids"]:
                broken.append(f"{name} -> {href} (no element with that id)")
    assert checked and not broken, f"{len(broken)} of {checked} internal links broken: {broken[:20]}"


def test_every_lesson_has_a_page_with_its_plots_and_measured_numbers(visited):
    pages, report = visited["pages"], {}
    stems = sorted(p.stem for p in (ROOT / "lessons").glob("*.ipynb"))
    for stem in stems:
        page = pages.get(f"lessons/{stem}.html")
        assert page is not None, f"lesson {stem} has no page"
        numbers, plots = _lesson_outputs(stem)
        missing = [n for n in numbers if n not in page["text"]]
        assert numbers, f"{stem}: its outputs printed no measured number"
        assert not missing, (f"{stem}: {len(missing)} of {len(numbers)} numbers its run printed are not on its page: "
                             f"{missing[:20]}")
        assert plots and len(page["images"]) >= plots, (f"{stem}: {plots} plots in the notebook, {len(page['images'])} "
                                                        "images on the page")
        assert ("Ran " in page["text"] and "CPU cores" in page["text"]
                and "load average" in page["text"]), f"{stem}: no run stamp"
        report[stem] = {"images": len(page["images"]), "plots_in_notebook": plots, "numbers_checked": len(numbers)}
    (SHOTS / "report.json").write_text(json.dumps({"pages": len(pages), "lessons": report, "build": BUILD}, indent=1))


def test_lesson_04_page_shows_the_ratio_it_measured(visited):
    """The issue's example: lesson 04's measured memory ratio (DDP / ZeRO-1 total bytes at N = 4, printed
    in bold with a ×) is in the page's text; the number is read from the executed notebook's outputs."""
    stems = [p.stem for p in (ROOT / "lessons").glob("04_*.ipynb")]
    if not stems:
        pytest.skip("no lesson 04")
    nb = json.loads((ROOT / "build" / "site-src" / "lessons" / f"{stems[0]}.ipynb").read_text())
    texts = [_output_text(o) for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    ratios = [m for t in texts for m in re.findall(r"\*\*(\d+\.\d+)×\*\*", t)]
    assert ratios, "lesson 04 printed no bold measured ratio (**x.xx×**)"
    assert all(r in visited["pages"][f"lessons/{stems[0]}.html"]["text"] for r in ratios), ratios


def test_search_finds_the_lessons(searched):
    hrefs = [r["href"] for r in searched["results"]]
    assert any("/lessons/" in href for href in hrefs), hrefs[:10]


def test_search_from_disk_shows_excerpts_with_the_term(searched):
    """Opened from file:// with fetch() refused, every page result still has its excerpt, the
    searched word in it, and the search logs no error (a refused fetch logs one)."""
    results = searched["results"]
    bare = [r["href"] for r in results if not r["excerpt"]]
    without = [r for r in results if r["excerpt"] and "zero" not in r["excerpt"].lower()]
    assert results and not bare, \
        f"{len(bare)} of {len(results)} results have no excerpt: {bare[:5]}"
    assert not without, f"{len(without)} excerpts without the term: {without[:3]}"
    assert not searched["errors"], searched["errors"][:5]


def test_the_excerpts_text_is_the_main_block_without_headerlinks_scripts_and_styles():
    """What docs/site/conf.py writes for the excerpts: the main block's text only, as
    searchtools.js cuts it (the browser test above shows it is found; this, what it holds)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("site_conf", ROOT / "docs" / "site" / "conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    page = ('<html><head><script>var x = 1;</script></head><body><nav>Menu</nav>'
            '<article role="main"><h1>Ring <a class="headerlink" href="#ring">#</a></h1>'
            '<p>An all-reduce sends<br/> 2(N-1)/N\n\n  of the bytes</p>\n<img src="a.png">'
            '<style>p { color: red }</style><div><p>per rank<script>y()</script> &amp; '
            '<span>link</span></p></div></article><footer>Footer</footer></body></html>')
    assert conf.main_text(page) == "Ring An all-reduce sends 2(N-1)/N of the bytes per rank & link"
    assert conf.main_text("<html><body><p>no main block</p></body></html>") is None


def test_no_code_is_cut_at_its_column_edge(visited):
    """Every code block and inline code either fits its column or scrolls sideways (at 1280 px)."""
    pages = visited["pages"]
    cut = {name: p["code"]["cut"] for name, p in pages.items() if p["code"]["cut"]}
    blocks = sum(p["code"]["blocks"] for p in pages.values())
    assert blocks and not cut, (f"{sum(map(len, cut.values()))} of {blocks} code blocks cut on "
                                f"{len(cut)} pages: "
                                f"{json.dumps(dict(list(cut.items())[:8]), indent=1)[:3000]}")
    # the check has met wide code: some blocks are wider than their column and scroll
    assert sum(p["code"]["scrolling"] for p in pages.values()) > 0


def test_every_lesson_title_has_the_one_style(visited):
    """The heading of every lesson page, and its browser title, read "NN · Topic: what it does"."""
    problems = []
    for stem in sorted(p.stem for p in (ROOT / "lessons").glob("*.ipynb")):
        page = visited["pages"][f"lessons/{stem}.html"]
        shown = (page["heading"] or "", page["title"].split(" - ")[0].strip())
        problems += [problem for problem in (title_problem(stem, t) for t in shown) if problem]
    assert not problems, problems


def test_the_site_has_every_section_and_screenshots(visited):
    names = set(visited["pages"])
    from minizero_course.grader import LABS
    expected = {"index.html", "design.html", "bench.html", "api/index.html", "labs/index.html"}
    expected |= {f"labs/{lab.filename[:-3]}.html" for lab in LABS.values()}
    expected |= {f"{page.stem}.html" for page in (ROOT / "docs").glob("*.md")}  # the guide: every docs/ page
    assert expected <= names, sorted(expected - names)
    start = visited["pages"]["index.html"]["text"]
    assert "make demo" in start and "make test" in start and "Course map" in start
    assert (SHOTS / "start.png").stat().st_size > 10_000 and list(SHOTS.glob("lesson-*.png"))
