"""`make site`: the course website, built with Sphinx (myst-nb renders the notebooks, autodoc the API).

    python -m docs.site.build [--out site]

Stages build/site-src/ and runs sphinx-build on it with docs/site/conf.py:
  * index.md: the README (one source; its links into docs/ made site-relative), then docs/site/index.md;
  * one page per docs/*.md (engine, offload, ..., syllabus; docs/design.md is included as design.md) and
    the images they show, at the site's root, so the pages link to each other as they do in docs/;
  * lessons/*.ipynb: every lessons/*.ipynb as it ran on this machine: the copy tests/test_lessons.py
    left in build/lessons/ when it is current, else executed here (docs/site/notebooks.py); a line
    at the top says when, on how many cores, with or without a GPU, at what load;
  * labs/*.md: one page per lab from its registry entry (minizero_course.grader), its TODOs and their
    hints (labs/labNN_*.py), its checks, and its stretch tasks (docs/site/stretch.md);
  * api/*.md: automodule of every minizero module, grouped by subpackage;
  * design.md (docs/design.md), gpu.md (docs/gpu.md: `make test-gpu`'s report) and bench.md:
    `python -m minizero_course bench`'s plot and table, run once into build/bench/<run>/ (kept
    there; delete the folder to measure again): `--bench short` (the default) the same candidates,
    ranks and model as the full bench over fewer rounds, `--bench full` its own 30 + 3 rounds.
Every link is relative, MathJax is served from the site itself, and search's excerpts come from a
script (_static/minizero-pages.js, conf.py): the site works from file://.

Where the time of a first build goes, and what it was measured at: docs/website.md."""
import ast
import datetime
import json
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from docs.site.notebooks import ROOT, executed_copy, machine

HERE = Path(__file__).resolve().parent
STAGE = ROOT / "build" / "site-src"
BENCH = ROOT / "build" / "bench"
# The guide's pages in the site's navigation, in reading order (a docs/*.md not named here comes after them).
GUIDE_ORDER = ["engine", "offload", "zeropp", "onebit", "pipeline", "tensor", "context-experts", "sparse", "planner",
               "benchmark", "scale", "dropin", "accelerate", "nodes", "api", "instructors", "grading", "website",
               "syllabus"]


def run_stamp(run: dict) -> str:
    """The line printed at the top of a page of measured numbers: whose numbers these are."""
    m, before, after = run["machine"], run["load_before"], run["load_after"]
    gpu = f"GPU: {m['gpu']}" if m["gpu"] else "no GPU"
    return (f"**Ran {run['started_utc']}** in {run['seconds']:.0f} s on {m['cores']} CPU cores ({m['cpu']}), {gpu}; "
            f"load average {before[0]:.2f} / {before[1]:.2f} / {before[2]:.2f} (1 / 5 / 15 min) at the start, "
            f"{after[0]:.2f} / {after[1]:.2f} / {after[2]:.2f} at the end; torch {m['torch']}, Python {m['python']}, "
            f"{m['system']}. Every number and plot on this page is that run's: yours will differ.")


def _execute_apart(path: Path) -> float:
    """Execute one lesson in a Python of its own (nbclient's event loop is not one to share between
    threads), into build/lessons/; its seconds."""
    t0 = time.time()
    subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from "
                    "docs.site.notebooks import execute; execute(Path(sys.argv[1]))", str(path)],
                   cwd=ROOT, check=True)
    return time.time() - t0


def execute_missing(paths: list[Path], jobs: int) -> None:
    """Execute the lessons that have no current copy, `jobs` at a time. A lesson's cells wait on its
    kernel, its ranks' start-up and its plotting as well as on the CPU: two at a time on 2 cores
    overlap one's waits with the other's work (docs/website.md has the times)."""
    missing = [p for p in paths if executed_copy(p) is None]
    if not missing:
        return
    print(f"  executing {len(missing)} lessons ({jobs} at a time) into build/lessons/", flush=True)
    from minizero import launch
    launch.share_zygote()  # the kernels fork their ranks from one zygote: torch imported once
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for path, seconds in zip(missing, pool.map(_execute_apart, missing)):
            print(f"  {path.name}: executed in {seconds:.0f} s", flush=True)


def stage_lessons(dest: Path, jobs: int = 2, execute_lessons: bool = True) -> list[str]:
    """One page per lesson from its executed copy (made now where missing, `jobs` at a time). With
    execute_lessons False a lesson without a current copy is shown unexecuted, its stamp saying so:
    a quick look at the site's layout, not a site to publish."""
    import nbformat
    dest.mkdir(parents=True)
    paths = sorted((ROOT / "lessons").glob("*.ipynb"))
    if execute_lessons:
        execute_missing(paths, jobs)
    names = []
    for path in paths:
        nb = executed_copy(path)
        if nb is not None:
            stamp = run_stamp(nb.metadata["minizero_run"])
        elif execute_lessons:  # executed just now, yet not current: the notebook changed meanwhile
            raise SystemExit(f"{path.name} changed while it was executed: build again")
        else:
            nb = nbformat.read(path, as_version=4)
            stamp = "**Not executed** (`--no-execute`): no outputs."
        ran = "executed" if nb.metadata.get("minizero_run") else "NOT executed"
        print(f"  {path.name}: {ran}", flush=True)
        stamp = nbformat.v4.new_markdown_cell(
            stamp + f" The notebook: `lessons/{path.name}` (committed without outputs).")
        first = nb.cells[0]
        if first.cell_type == "markdown" and first.source.startswith("# "):
            title, _, rest = first.source.partition("\n")  # the stamp goes right under the title
            first.source = title
            nb.cells[1:1] = [stamp] + ([nbformat.v4.new_markdown_cell(rest.strip())] if rest.strip() else [])
        else:
            nb.cells.insert(0, stamp)
        nbformat.write(nb, dest / path.name)
        names.append(path.stem)
    (dest / "index.md").write_text("# Lessons\n\nEach lesson is a notebook that measures instead of asserting; these "
                                   "pages show it as it ran on the machine that built this "
                                   "site.\n\n```{toctree}\n:glob:\n\n*\n```\n")
    return names


def lab_tasks(path: Path, number: int) -> list[tuple[str, str, list[str]]]:
    """(where, title, hint lines) of every `# TODO(lab N): title` in the lab file, in order."""
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines))
    scopes = []  # (first line, last line, qualified name) of every def
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                owner = f"{node.name}." if isinstance(node, ast.ClassDef) else ""
                scopes.append((child.lineno, child.end_lineno, owner + child.name))
    todo = re.compile(rf"^\s*# TODO\(lab {number}\): (.*)$")
    tasks = []
    for no, line in enumerate(lines, 1):
        m = todo.match(line)
        if not m:
            continue
        hints = []
        for following in lines[no:]:
            if not re.match(r"^\s*#  ", following):
                break
            hints.append(following.strip()[1:].rstrip())
        inner = [s for s in scopes if s[0] <= no <= s[1]]
        where = min(inner, key=lambda s: s[1] - s[0])[2] if inner else "module level"
        tasks.append((where, m.group(1), textwrap.dedent("\n".join(hints)).splitlines()))
    return tasks


def stretch_tasks() -> dict[int, str]:
    """docs/site/stretch.md: `## Lab N` sections of stretch tasks."""
    sections = re.split(r"^## Lab (\d+)\s*$", (HERE / "stretch.md").read_text(), flags=re.MULTILINE)
    return {int(n): body.strip() for n, body in zip(sections[1::2], sections[2::2])}


def stage_labs(dest: Path, lessons: list[str]) -> int:
    from minizero_course.grader import LABS
    dest.mkdir(parents=True)
    stretch = stretch_tasks()
    rows = []
    for lab in LABS.values():
        path = ROOT / "labs" / lab.filename
        if not path.exists():
            print(f"  lab {lab.number}: no page, {path.relative_to(ROOT)} is not generated (`make labs`)", flush=True)
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        goal = doc.split("\n\n")[0].replace("\n", " ")
        lesson = next((name for name in lessons if name.startswith(f"{lab.number:02d}_")), None)
        page = [f"# Lab {lab.number:02d}: {lab.title}", "",
                f"**Goal.** {goal}", "",
                f"You edit `labs/{lab.filename}`, generated from the reference module `{lab.source}` (`make labs`):"
                " everything outside the TODOs is that module's code."
                + (f" The lesson that measures it: [lesson {lab.number:02d}](../lessons/{lesson}.ipynb)." if lesson
                   else ""),
                "", "## Tasks", "", "One task per TODO, in the order the file has them; the hints are the lab's own.",
                ""]
        for i, (where, title, hints) in enumerate(lab_tasks(path, lab.number), 1):
            page += [f"{i}. **{title}** (in `{where}`)", ""]
            if hints:
                page += ["   ```text"] + [f"   {h}" for h in hints] + ["   ```", ""]
        page += ["## Run it", "", "```bash",
                 f"mpirun -n {lab.nprocs} .venv/bin/python labs/{lab.filename}", "```", "",
                 (f"{lab.nprocs} ranks run the lab's demo on your code: until a TODO is written it stops at that "
                  "TODO's "
                 "`NotImplementedError`."), "",
                 "## Grade it", "", "```bash",
                 f"python -m minizero_course grade --lab {lab.number} --impl labs      # the score table",
                 f"pytest -m lab{lab.number} --impl labs                        # the same checks as tests",
                 "```", "", "| check | points |", "|---|---|"]
        page += [f"| {check.name} | {check.max_score:g}{' extra credit' if getattr(check, 'extra', False) else ''} |"
                 for check in lab.checks()]
        graded = [check.name for check in lab.checks() if getattr(check, "extra", False)]
        page += ["", ("Every failing check says what it measured and what was expected; `make grade` grades every lab "
                 "and writes Gradescope's `results.json`."), "",
                 "## Stretch tasks", "",
                 *[f"- Graded, for extra credit: **{name}** (a TODO above)." for name in graded],
                 stretch.get(lab.number, "" if graded else "None yet."), "",
                 "## Background: the module's docstring", "", "```text", doc, "```", ""]
        (dest / f"{path.stem}.md").write_text("\n".join(page))
        rows.append(f"| [{lab.number:02d}]({path.stem}.md) | {lab.title} | `{lab.source}` | {len(lab.checks())} |")
    (dest / "index.md").write_text("\n".join(
        ["# Labs", "", ("Each lab is a file in `labs/` with TODOs where the reference code was; an autograder measures "
         "your code on several ranks."), "", "| lab | what you write | generated from | checks |", "|---|---|---|---|",
         *rows, "", "```{toctree}", ":hidden:", ":glob:", "", "*", "```", ""]))
    return len(rows)


def stage_api(dest: Path) -> int:
    import minizero
    dest.mkdir(parents=True)
    modules = sorted(m.name for m in pkgutil.walk_packages(minizero.__path__, "minizero.")
                     if not m.name.endswith("__main__"))
    groups: dict[str, list[str]] = {"minizero": ["minizero"]}
    for name in modules:
        parts = name.split(".")
        groups.setdefault("minizero" if len(parts) == 2 and not _is_package(name) else ".".join(parts[:2]),
                          []).append(name)
    for group, names in groups.items():
        body = [f"# {group}", ""]
        for name in names:  # a package's docstring only: its members are documented in their own modules (conf.py
            # turns members on by default, which documented a package's re-exports twice: `minizero.comm.launcher`
            # the function over `minizero.comm.launcher` the module)
            members = ["   :no-members:"] if _is_package(name) else ["   :members:", "   :show-inheritance:"]
            body += [f"## {name}", "", "```{eval-rst}", f".. automodule:: {name}", *members, "```", ""]
        (dest / f"{group}.md").write_text("\n".join(body))
    (dest / "index.md").write_text("# API reference\n\nGenerated from the package's docstrings (shown as written: "
                                   "they give the paper, the equation and the byte formula).\n\n```{toctree}\n"
                                   + "".join(f"{group}\n" for group in groups) + "```\n")
    return len(modules) + 1


def _is_package(name: str) -> bool:
    import importlib.util
    spec = importlib.util.find_spec(name)
    return bool(spec and spec.submodule_search_locations)


# The site's bench runs: `short` (the default) measures what the full one does (every default
# candidate, 4 ranks, the same model, memory and bytes of step 2, paired step-time ratios) over
# fewer interleaved rounds, so its confidence intervals are wider; `full` is the bench's own
# default (30 timed rounds after 3).
BENCH_RUNS = {"short": ["--steps", "6", "--warmup", "1"], "full": []}
FULL_TIMED = 30  # the bench's default --steps: its timed rounds


def stage_bench(dest: Path, run_name: str = "short", bench_args=()) -> None:
    """bench.md from build/bench/<run_name>/: `python -m minizero_course bench` with that run's
    arguments (and bench_args), run here once and kept; run again when the arguments differ."""
    folder = BENCH / run_name
    args = [*BENCH_RUNS.get(run_name, []), *bench_args]
    command = " ".join(["python -m minizero_course bench", *args])
    report = folder / "report.txt"
    kept = json.loads((folder / "run.json").read_text()) if (folder / "run.json").exists() else {}
    if not report.exists() or kept.get("command") != command:
        print(f"  running `{command}` into {folder.relative_to(ROOT)}/ (kept for later builds)",
              flush=True)
        folder.mkdir(parents=True, exist_ok=True)
        started, before, t0 = datetime.datetime.now(datetime.timezone.utc), os.getloadavg(), time.time()
        # its progress (stderr) shows as it runs, and says when the timed rounds begin; its report
        # (stdout, into a file: a pipe read only at the end could fill up) goes to the page
        with open(folder / "stdout.txt", "w+") as out:
            proc = subprocess.Popen([sys.executable, "-m", "minizero_course", "bench", *args,
                                     "--json", str(folder / "bench.json"),
                                     "--plot", str(folder / "bench.png")],
                                    cwd=ROOT, stdout=out, stderr=subprocess.PIPE, text=True)
            rounds_from = None  # seconds into the run when round 1 of the timing began
            for line in proc.stderr:
                print(line, end="", file=sys.stderr, flush=True)
                if rounds_from is None and "time, interleaved: round 1/" in line:
                    rounds_from = time.time() - t0
            proc.wait()
            out.seek(0)
            stdout = out.read()
        if proc.returncode:
            raise SystemExit(f"python -m minizero_course bench failed:\n{stdout[-3000:]}")
        seconds = time.time() - t0
        (folder / "run.json").write_text(json.dumps(
            {"started_utc": started.strftime("%Y-%m-%d %H:%M UTC"), "seconds": round(seconds, 1),
             # the part before the rounds (start-up, memory and bytes one candidate at a time) and
             # the rounds: a run of other length takes that part plus (rounds_s / rounds) per round
             "before_rounds_s": round(rounds_from, 1) if rounds_from else None,
             "rounds_s": round(seconds - rounds_from, 1) if rounds_from else None,
             "load_before": [round(x, 2) for x in before], "load_after": [round(x, 2) for x in os.getloadavg()],
             "machine": machine(), "command": command, "run": run_name}))
        report.write_text(stdout)
    shutil.copy(folder / "bench.png", dest / "bench.png")
    run = json.loads((folder / "run.json").read_text())
    summary = json.loads((folder / "bench.json").read_text()) if (folder / "bench.json").exists() \
        else {}
    timed = _timed_rounds(summary)
    which = (f"The full bench: {timed} timed rounds." if run_name == "full" and not bench_args else
             f"**A short run: {timed} timed rounds, where the full bench times {FULL_TIMED}.** "
             "It measures what the full one does, so every figure below is a measurement, but "
             "over fewer rounds: the medians move more and the ratios' confidence intervals are "
             "wider. `make site BENCH=full` builds the site with the full bench (docs/website.md: "
             "how long it takes).")
    (dest / "bench.md").write_text("\n".join([
        "# Benchmark run: minizero vs torch DDP, FSDP2 and DeepSpeed", "", run_stamp(run), "",
        which, "",
        (f"`{run['command']} --json bench.json --plot bench.png`: how it measures is in the [Benchmark](benchmark.md) "
        "page and `minizero_course/bench/bench.py`'s docstring. DeepSpeed takes part only where it is installed "
        "(`pip install -e \".[peers]\"`)."), "",
        "![step time per candidate and paired ratio to torch DDP](bench.png)", "", "The bench's own report:", "",
        "```text", report.read_text().rstrip(), "```", ""]))


def _timed_rounds(summary: dict) -> int:
    """Timed interleaved rounds of a bench run (warm-up left out): one step time per round."""
    return max((len(row["step_s"]) for row in summary.get("candidates", {}).values()), default=0)


def stage_docs(dest: Path) -> list[str]:
    """The README as the start page, then every docs/*.md topic page beside it; returns the topic pages."""
    readme = (ROOT / "README.md").read_text()
    readme = re.sub(r"\]\(docs/([^)]+)\)", r"](\1)", readme)  # docs/engine.md -> engine.md: the pages sit at the root
    # configs/README.md (the example configs) is a page of its own at the root too
    (dest / "configs.md").write_text((ROOT / "configs" / "README.md").read_text())
    readme = readme.replace("](configs/README.md)", "](configs.md)")
    pages = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        if path.name == "design.md":  # included, so that its links stay docs/'s
            (dest / "design.md").write_text("```{include} ../../docs/design.md\n```\n")
        else:  # docs/X.md links ../lessons/..., which at the site's root is lessons/...
            (dest / path.name).write_text(path.read_text().replace("](../lessons/", "](lessons/")
                                          .replace("](../configs/README.md)", "](configs.md)"))
            pages.append(path.stem)
    for image in (ROOT / "docs").glob("*.png"):
        shutil.copy(image, dest / image.name)
    pages.sort(key=lambda name: (GUIDE_ORDER.index(name) if name in GUIDE_ORDER else len(GUIDE_ORDER), name))
    toctree = ["```{toctree}", ":hidden:", "", "lessons/index", "labs/index", "syllabus", "```", "",
               "```{toctree}", ":hidden:", ":caption: Guide", "", *[p for p in pages if p != "syllabus"], "```", "",
               "```{toctree}", ":hidden:", ":caption: Reference", "", "api/index", "configs", "design", "bench", "```",
               ""]
    (dest / "index.md").write_text(readme.rstrip() + "\n\n" + (HERE / "index.md").read_text().rstrip() + "\n\n"
                                   + "\n".join(toctree))
    return pages


# What a build reads: a site newer than all of it is up to date (`make site-test` reuses it).
SOURCES = ["lessons", "build/lessons", "build/bench", "labs", "minizero", "minizero_course", "docs", "README.md",
           "configs"]


BUILT = ".minizero-build.json"  # in the built site: which bench run it shows


def stale(out: Path, bench: str = "short") -> str | None:
    """Why `out` must be built again (the first source newer than it, or another bench run than the
    one asked for), or None when it is up to date."""
    index = out / "index.html"
    if not index.exists():
        return f"{index} does not exist"
    shows = json.loads((out / BUILT).read_text()).get("bench") if (out / BUILT).exists() else None
    if shows != bench:
        return f"it shows the {shows or 'unknown'} bench run, not the {bench} one"
    built = index.stat().st_mtime
    for name in SOURCES:
        for path in [ROOT / name] if (ROOT / name).is_file() else sorted((ROOT / name).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.stat().st_mtime > built:
                return f"{path.relative_to(ROOT)} changed after the last build"
    return None


def sphinx(cmd: list) -> list:
    """sphinx-build, its progress condensed to a line per phase and quarter (it takes half a minute and more on 2
    cores; its own output is a line per page). Its warnings and errors pass through as it writes them, and are
    returned."""
    shown, warnings = set(), []
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        m = re.match(r"(\w[\w ]*?)\.\.\. \[\s*(\d+)%\]", line)
        if m:
            if (m.group(1), int(m.group(2)) // 25) not in shown:
                shown.add((m.group(1), int(m.group(2)) // 25))
                print(f"  sphinx: {m.group(1)} {m.group(2)}%", flush=True)
        elif "WARNING" in line or "ERROR" in line:
            warnings.append(line.rstrip())
            print(line, end="", file=sys.stderr, flush=True)
    if proc.wait():
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return warnings


def build(out: Path, bench_args=(), bench: str = "short", jobs: int = 2,
          execute_lessons: bool = True) -> dict:
    """Stage and build the site; the seconds of each part (lessons, bench, Sphinx) are in the
    summary returned, with the load average at the start and the end."""
    t0, load_before = time.time(), os.getloadavg()
    shutil.rmtree(STAGE, ignore_errors=True)
    STAGE.mkdir(parents=True)
    guide = stage_docs(STAGE)
    print("lessons:", flush=True)
    lessons = stage_lessons(STAGE / "lessons", jobs=jobs, execute_lessons=execute_lessons)
    t_lessons = time.time()
    labs = stage_labs(STAGE / "labs", lessons)
    modules = stage_api(STAGE / "api")
    print("bench:", flush=True)
    t_bench = time.time()
    stage_bench(STAGE, bench, bench_args)
    staged = time.time()
    shutil.rmtree(out, ignore_errors=True)
    warnings = sphinx([sys.executable, "-m", "sphinx", "-b", "html", "-j", "auto", "-c", str(HERE),
            "-d", str(ROOT / "build" / "site-doctrees"), str(STAGE), str(out)])
    (out / BUILT).write_text(json.dumps({"bench": bench, "bench_args": list(bench_args)}))
    pages = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.html"))
    parts = {"lessons_s": round(t_lessons - t0, 1), "bench_s": round(staged - t_bench, 1),
             "sphinx_s": round(time.time() - staged, 1)}
    summary = {"lessons": len(lessons), "labs": labs, "guide_pages": len(guide), "api_modules": modules,
               "html_pages": len(pages), "warnings": warnings, **parts,
               "stage_s": round(staged - t0, 1), "total_s": round(time.time() - t0, 1),
               "load_before": [round(x, 2) for x in load_before],
               "load_after": [round(x, 2) for x in os.getloadavg()]}
    print(f"site: {out}/index.html, {len(pages)} pages ({len(lessons)} lessons, {labs} labs, "
          f"{modules} API modules) in {summary['total_s']:.0f} s: "
          f"lessons {parts['lessons_s']:.0f} s, bench ({bench}) {parts['bench_s']:.0f} s, "
          f"Sphinx {parts['sphinx_s']:.0f} s; load average {load_before[0]:.2f} at the start, "
          f"{summary['load_after'][0]:.2f} at the end")
    return summary


def main(argv=None) -> int:
    from minizero.cli import checks
    ap = checks.Parser(prog="python -m docs.site.build", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "site"), help="where the HTML goes (default: site/)")
    ap.add_argument("--bench", choices=sorted(BENCH_RUNS), default="short",
                    help="the bench run shown: short (default; fewer rounds) or full (the bench's "
                         "30 + 3 rounds)")
    ap.add_argument("--bench-args", default="",
                    help="extra arguments of `python -m minizero_course bench` when it runs")
    ap.add_argument("--jobs", type=checks.whole(1), default=2,
                    help="lessons executed at a time where build/lessons/ has no current copy "
                         "(default 2)")
    ap.add_argument("--no-execute", action="store_true",
                    help="execute no lesson: one without a current copy is shown without outputs "
                         "(a quick look at the layout; tests/test_site.py fails on such a site)")
    ap.add_argument("--if-stale", action="store_true", help="build only when a source changed after the last build")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    checks.output_folder(ap, "--out", str(out))  # before the staging and the half minute of Sphinx
    if args.if_stale:
        why = stale(out, args.bench)
        if why is None:
            print(f"site: {out}/index.html is up to date (no source changed since it was built)")
            return 0
        print(f"site: building, {why}", flush=True)
    build(out, args.bench_args.split(), bench=args.bench, jobs=args.jobs,
          execute_lessons=not args.no_execute)
    return 0


if __name__ == "__main__":
    sys.exit(main())
