"""What Gradescope's run_autograder runs: grade /autograder/submission, write /autograder/results/results.json.

Gradescope's layout (its autograder docs): the bundle is unzipped into ROOT/source (here: a handout, see
minizero_course.kit.gradescope), the student's files are in ROOT/submission, and ROOT/results/results.json is the
grade. ROOT is /autograder, or MINIZERO_GRADESCOPE_ROOT / --root (the tests simulate it in a temporary folder).

A submission may be the lab's modules (minizero/comm/ring.py, at that path anywhere in the submission or
by its name alone: a handout student's files or repository) or a lab file labNN_*.py (the course repository's
labs/). A module it lacks is the bundle's own (its stub). The lab file is made as the handout's grader makes
it (labgen.render 'package') and graded in a child process with a time limit (--limit-s, below Gradescope's
own timeout): a submission that hangs or crashes gets failing entries, and results.json is always written.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from minizero import env as mz_env
from minizero_course.grader import HANDOUT, LABS, REPO, Lab, get_lab
from minizero_course.grader import labgen
from minizero.launch import pids_with_env


def find(submission: str, relpath: str) -> str | None:
    """The submission's file for `relpath`: at that path under any folder, else the only file of that name."""
    by_path, by_name = [], []
    for folder, _, names in os.walk(submission):
        for name in names:
            path = os.path.join(folder, name)
            if path.replace(os.sep, "/").endswith("/" + relpath):
                by_path.append(path)
            elif name == os.path.basename(relpath):
                by_name.append(path)
    if by_path:  # a repository holds labs/ and maybe solutions/: the student's is labs/
        return sorted(by_path, key=lambda p: ("/labs/" not in p.replace(os.sep, "/"), len(p), p))[0]
    return by_name[0] if len(by_name) == 1 else None


def lab_file(lab: Lab, submission: str, out: str) -> tuple[str, str]:
    """Write the lab file graded for `lab` into folder `out`; returns (where it came from, in words)."""
    own = find(submission, lab.filename)
    if own:
        shutil.copy(own, os.path.join(out, lab.filename))
        return f"{os.path.relpath(own, submission)}"
    tree = os.path.join(out, f"tree{lab.number}")
    found = []
    for path in labgen.sources(lab):
        mine = find(submission, path)
        os.makedirs(os.path.dirname(os.path.join(tree, path)), exist_ok=True)
        if mine:
            shutil.copy(mine, os.path.join(tree, path))
            found.append(os.path.relpath(mine, submission))
        else:  # the bundle's own module: its stubs (a bundle is a handout; elsewhere the regions are stubbed here)
            with open(os.path.join(REPO, path)) as f, open(os.path.join(tree, path), "w") as g:
                g.write(labgen.transform(f.read(), lab.number, stub=True))
    if not found:
        raise FileNotFoundError(f"the submission has neither {lab.filename} nor {' / '.join(labgen.sources(lab))}: "
                                f"upload the file(s) you wrote (or your repository)")
    with open(os.path.join(out, lab.filename), "w") as f:
        f.write(labgen.render(lab, "package", tree))
    return ", ".join(found)


def _failing(lab: Lab, output: str) -> list[dict]:
    return [{"name": f"lab {lab.number}: {c.name}", "score": 0.0, "max_score": 0.0 if c.extra else c.max_score,
             "status": "failed", "output": output} for c in lab.checks()]


def run(root: str, labs: list[int], limit_s: float) -> dict:
    submission, results = os.path.join(root, "submission"), os.path.join(root, "results", "results.json")
    os.makedirs(os.path.dirname(results), exist_ok=True)
    t0, tests, notes = time.time(), [], []
    work = tempfile.mkdtemp(prefix="minizero-gradescope-")
    try:
        graded = []
        for n in labs:
            lab = get_lab(n)
            try:
                notes.append(f"lab {n}: graded {lab_file(lab, submission, work)}")
                graded.append(n)
            except (OSError, ValueError, SyntaxError) as e:  # no such file, or the modules do not join
                notes.append(f"lab {n}: {e}")
                tests += _failing(lab, str(e))
        if graded:
            tests = _grade(graded, work, limit_s) + tests
    except Exception as e:  # noqa: BLE001 - the grader's own failure is still a results.json, never none
        notes.append(f"the autograder failed: {type(e).__name__}: {e}")
        done = {t["name"] for t in tests}
        tests += [t for n in labs for t in _failing(get_lab(n), notes[-1]) if t["name"] not in done]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # visible at once: the messages name the cause of each lost point, which is what a student needs
    result = {"score": sum(t["score"] for t in tests), "max_score": sum(t["max_score"] for t in tests),
              "execution_time": round(time.time() - t0, 1), "output": "\n".join(notes),
              "visibility": "visible", "stdout_visibility": "visible", "tests": tests}
    with open(results, "w") as f:
        json.dump(result, f, indent=2)
    return result


def _grade(labs: list[int], impl: str, limit_s: float) -> list[dict]:
    """`python -m minizero_course grade` in its own process group, stopped at `limit_s`: the checks it did not finish
    fail with the reason. grade rewrites its JSON after each check, so a stopped run keeps what it graded."""
    out = os.path.join(impl, "graded.json")
    cmd = [sys.executable, "-m", "minizero_course", "grade", "--impl", impl, "--json", out]
    for n in labs:
        cmd += ["--lab", str(n)]
    # the grader's jobs run in sessions of their own (launch.run): this mark, inherited, finds them to stop them
    mark = f"{os.getpid()}-{time.time_ns()}"
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True,  # its output is Gradescope's log
                            env={**os.environ, "MINIZERO_GRADESCOPE_RUN": mark})
    try:
        proc.wait(timeout=limit_s)
        stopped = None
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the grader ...
        for pid in pids_with_env("MINIZERO_GRADESCOPE_RUN", mark):  # ... and every job and rank it started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        stopped = (f"not graded: grading stopped at the time limit of {limit_s:g} s (a check that never ends: a "
                   "deadlock?)")
    tests = json.load(open(out))["tests"] if os.path.exists(out) else []
    if stopped is None and proc.returncode not in (0, 1):
        stopped = f"not graded: the grader ended with exit code {proc.returncode}"
    done = {t["name"] for t in tests}
    for n in labs:
        tests += [t for t in _failing(get_lab(n), stopped or "not graded") if t["name"] not in done]
    return tests


def main(argv=None) -> int:
    mz_env.check_or_exit("minizero_course.grader.gradescope")  # a bad MINIZERO_GRADESCOPE_* value: one line, exit 2
    from minizero.cli import checks
    ap = checks.Parser(prog="python -m minizero_course.grader.gradescope", description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=mz_env.get("MINIZERO_GRADESCOPE_ROOT"),
                    help="Gradescope's folder (default: $MINIZERO_GRADESCOPE_ROOT or /autograder)")
    ap.add_argument("--lab", type=int, action="append", help="lab to grade (repeatable); default: the bundle's labs")
    ap.add_argument("--limit-s", type=checks.number(0, open_low=True),
                    default=mz_env.get("MINIZERO_GRADESCOPE_LIMIT_S"),
                    help="stop grading after this many seconds (keep it below Gradescope's timeout; default 540 "
                         "or $MINIZERO_GRADESCOPE_LIMIT_S)")
    args = ap.parse_args(argv)
    labs = args.lab or (HANDOUT["labs"] if HANDOUT else sorted(LABS))
    checks.known_numbers(ap, "--lab", labs, LABS, "lab")
    if not os.path.isdir(os.path.join(args.root, "submission")):  # Gradescope always makes it, empty or not
        ap.error(f"--root {args.root}: no submission/ folder in it (Gradescope unzips the student's files into "
                 "ROOT/submission; the results go to ROOT/results/results.json)")
    result = run(args.root, labs, args.limit_s)
    print(f"{result['output']}\ntotal: {result['score']:g} / {result['max_score']:g}")
    return 0  # a low score is a result; Gradescope reads it from results.json


if __name__ == "__main__":
    sys.exit(main())
