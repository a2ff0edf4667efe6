"""docs/syllabus.md's table of measured times: how long each lesson takes to run and each lab to grade.

    python -m docs.site.syllabus measure [--lessons 0 1 ...] [--labs 1 2 ...]   # runs them, writes TIMES
    python -m docs.site.syllabus write                                         # TIMES -> the table in docs/syllabus.md

`measure` executes each lesson as tests/test_lessons.py does (a fresh kernel, cwd = repo root) and grades
each lab's reference solution (`python -m minizero_course grade --lab N --impl solutions`: a full-marks submission
runs every check to the end), one at a time, and records the seconds, the 1-minute load average before and
after, and the machine. `write` renders docs/syllabus_times.json into docs/syllabus.md between the two
marker lines; tests/test_syllabus.py checks the page's table is that rendering, so no figure is typed."""
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from docs.site.notebooks import ROOT, execute, machine

TIMES = ROOT / "docs" / "syllabus_times.json"
PAGE = ROOT / "docs" / "syllabus.md"
BEGIN, END = "<!-- measured times: begin (python -m docs.site.syllabus write) -->", "<!-- measured times: end -->"


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def measure(lessons: list[int] | None, labs: list[int] | None) -> dict:
    from minizero_course.grader import LABS
    data = json.loads(TIMES.read_text()) if TIMES.exists() else {"lessons": {}, "labs": {}}
    data["machine"] = machine()
    for path in sorted((ROOT / "lessons").glob("*.ipynb")):
        if lessons is not None and int(path.name[:2]) not in lessons:
            continue
        print(f"lesson {path.stem} ...", flush=True)
        before = _load()
        _, seconds = execute(path)
        data["lessons"][path.stem] = {"seconds": round(seconds, 1), "load_before": before, "load_after": _load()}
        print(f"  {seconds:.0f} s (load {before[0]} -> {_load()[0]})", flush=True)
        TIMES.write_text(json.dumps(data, indent=1) + "\n")
    for number, lab in LABS.items():
        if labs is not None and number not in labs:
            continue
        print(f"lab {number:02d} ...", flush=True)
        before, t0 = _load(), time.time()
        proc = subprocess.run([sys.executable, "-m", "minizero_course", "grade", "--lab", str(number),
                               "--impl", "solutions"], cwd=ROOT, capture_output=True, text=True, check=False)
        seconds = time.time() - t0
        score = re.findall(r"(\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)", proc.stdout)
        data["labs"][f"{number:02d}"] = {"seconds": round(seconds, 1), "load_before": before, "load_after": _load(),
                                         "exit": proc.returncode, "score": "/".join(score[-1]) if score else None,
                                         "title": lab.title}
        print(f"  {seconds:.0f} s, exit {proc.returncode} (load {before[0]} -> {_load()[0]})", flush=True)
        TIMES.write_text(json.dumps(data, indent=1) + "\n")
    return data


def lab_size(number: int) -> tuple[int, int]:
    """(tasks, lines of reference code) of lab `number`: its BEGIN/END SOLUTION regions in the package and the
    code lines inside them (comments and blank lines left out)."""
    from minizero_course.grader import LABS, REPO
    from minizero_course.grader.labgen import BEGIN, END
    lab = LABS[number]
    tasks = lines = 0
    for source in (lab.source if isinstance(lab.source, tuple) else (lab.source,)):
        inside = False
        for line in (Path(REPO) / source).read_text().splitlines():
            if BEGIN.match(line):
                inside, tasks = True, tasks + 1
            elif END.match(line):
                inside = False
            elif inside and line.strip() and not line.strip().startswith("#"):
                lines += 1
    return tasks, lines


def lab_hours(tasks: int, lines: int) -> float:
    """The estimate of a student's hours on a lab (docs/syllabus.md says why): 2 h to read the lab and its
    lesson's section and to run it, 0.5 h per task, 0.1 h per line of reference code; to the half hour."""
    return round((2 + 0.5 * tasks + 0.1 * lines) * 2) / 2


WEEKS = 14  # the term plan's weeks (docs/syllabus.md)
LESSON_HOURS = 1.5  # reading a lesson, running it and answering its questions (the estimate on the page)


def table(data: dict) -> str:
    """The page's tables: one row per lesson, then one per lab, each with the load it ran at."""
    m = data["machine"]
    loads = [t["load_before"][0] for t in [*data["lessons"].values(), *data["labs"].values()]]
    rows = [f"Measured on {m['cores']} CPU cores ({m['cpu']}), {'GPU: ' + m['gpu'] if m['gpu'] else 'no GPU'}, "
            f"torch {m['torch']}, Python {m['python']}, one at a time; each row gives the 1-minute load average "
            "before and after it (2 means both cores busy: the ranks of the row before, up to 8 on 2 cores, count "
            "in it, and so would other jobs; the median before a row was "
            f"{statistics.median(loads):.1f}). Rendered from "
            "`docs/syllabus_times.json` by `python -m docs.site.syllabus write`.", "",
            "| lesson | run top to bottom, s | load before → after | student hours (estimate) |", "|---|---|---|---|"]
    for stem, t in sorted(data["lessons"].items()):
        rows.append(f"| [{stem}](../lessons/{stem}.ipynb) | {t['seconds']:.0f} | "
                    f"{t['load_before'][0]:.1f} → {t['load_after'][0]:.1f} | {LESSON_HOURS:g} |")
    rows += ["", "| lab | grade a full-marks submission, s | load before → after | tasks | lines of reference code | "
             "student hours (estimate) |", "|---|---|---|---|---|---|"]
    lab_total = 0.0
    for number, t in sorted(data["labs"].items()):
        tasks, lines = lab_size(int(number))
        lab_total += lab_hours(tasks, lines)
        rows.append(f"| lab {number}: {t['title']} | {t['seconds']:.0f} | {t['load_before'][0]:.1f} → "
                    f"{t['load_after'][0]:.1f} | {tasks} | {lines} | {lab_hours(tasks, lines):g} |")
    lessons = sum(t["seconds"] for t in data["lessons"].values())
    labs = sum(t["seconds"] for t in data["labs"].values())
    lesson_total = LESSON_HOURS * len(data["lessons"])
    rows += ["", f"All lessons run in {lessons / 60:.1f} min; grading every lab once takes {labs / 60:.1f} min. "
             f"Student hours: {lesson_total:g} on the lessons and {lab_total:g} on the labs, "
             f"**{lesson_total + lab_total:g} h** in all, about {(lesson_total + lab_total) / WEEKS:.0f} h a week over "
             f"the {WEEKS}-week plan."]
    return "\n".join(rows)


def write() -> None:
    text = PAGE.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    PAGE.write_text(text[:start] + "\n" + table(json.loads(TIMES.read_text())) + "\n" + text[end:])


def main(argv=None) -> int:
    from minizero.cli import checks
    ap = checks.Parser(prog="python -m docs.site.syllabus", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="run the lessons and grade the labs, one at a time; write " + TIMES.name)
    m.add_argument("--lessons", type=int, nargs="+", help="lesson numbers (default: all, or none when --labs is given)")
    m.add_argument("--labs", type=int, nargs="+", help="lab numbers (default: all, or none when --lessons is given)")
    sub.add_parser("write", help="render the times into docs/syllabus.md")
    args = ap.parse_args(argv)
    if args.command == "measure":
        from minizero_course.grader import LABS
        lessons = sorted(int(p.name[:2]) for p in (ROOT / "lessons").glob("*.ipynb"))
        for flag, given, known in (("--lessons", args.lessons, lessons), ("--labs", args.labs, sorted(LABS))):
            if given and set(given) - set(known):
                ap.error(f"{flag} {min(set(given) - set(known))}: no such {flag[2:-1]}; they are "
                         f"{', '.join(map(str, known))}")
        if args.lessons or args.labs:  # what was named, only
            measure(args.lessons or [], args.labs or [])
        else:
            measure(None, None)
    else:
        write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
