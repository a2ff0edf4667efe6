"""Generate labs/ and solutions/ from the marked regions of minizero's own modules.

One source of truth: a region that students write is marked in the reference module

    # BEGIN SOLUTION: <the task, one short line>
    #   <hint lines: a few short lines, indented under the #>
    ...reference code...
    # END SOLUTION

One task per marker, as minitorch's "TODO: Implement for Task 0.1".
`labs/labNN_name.py` gets the module with each region replaced by a
`raise NotImplementedError("lab N: <hint>")` stub; `solutions/labNN_name.py` gets it with the
markers dropped. Both get a header and a `__main__` block that runs the lab under mpirun.
A lab may come from several modules (Lab.source a tuple, e.g. lab 08: quantize.py, then
zeropp.py for its stretch task): they are joined in that order into one file (`joined`).
`python -m minizero_course labs` (make labs) writes them; `--check` fails if the committed files
differ from what would be generated (a test runs it).
"""
import ast
import os
import re
import sys

from minizero_course.grader import LABS, REPO

BEGIN = re.compile(r"^(?P<indent>\s*)# BEGIN SOLUTION(?::\s*(?P<hint>.*))?$")
END = re.compile(r"^\s*# END SOLUTION\s*$")
HINT = re.compile(r"^\s*#  ")  # a hint line under BEGIN: "#   ..."


def transform(source: str, lab: int, stub: bool) -> str:
    """Stub (labs/) or solution (solutions/) text of `source` for lab `lab`.

    A region starts with `# BEGIN SOLUTION: <one-line title>`, optionally followed by hint lines
    `#   ...` (a comment indented by at least two spaces after the #), and ends with `# END SOLUTION`.
    The stub keeps the title and the hints as a TODO and raises NotImplementedError naming the
    lab and the title's first sentence; the solution keeps the title and hints as comments."""
    out, in_region, in_hint = [], False, False
    for no, line in enumerate(source.splitlines(), 1):
        m = BEGIN.match(line)
        if m:
            if in_region:
                raise ValueError(f"line {no}: BEGIN SOLUTION inside a region")
            in_region, in_hint = True, True
            ind = m.group("indent")
            title = (m.group("hint") or "fill this in").strip()
            if stub:
                out.append(f"{ind}# TODO(lab {lab}): {title}")
                short = title.split(". ")[0].split(": ")[0].rstrip(".")  # the full hint is in the TODO above
                stub_line = f"{ind}raise NotImplementedError({f'lab {lab}: not implemented yet: {short}'!r})"
            else:
                out.append(f"{ind}# {title}")
            continue
        if in_hint:
            if HINT.match(line):
                out.append(line)
                continue
            in_hint = False
            if stub:
                out.append(stub_line)
        if END.match(line):
            if not in_region:
                raise ValueError(f"line {no}: END SOLUTION without BEGIN")
            in_region = False
            continue
        if not (stub and in_region):
            out.append(line)
    if in_region:
        raise ValueError("unterminated BEGIN SOLUTION region")
    return "\n".join(out) + "\n"


def regions(source: str) -> list[tuple[str, list[str]]]:
    """(title, code lines) of each SOLUTION region of `source`: what a student writes, without the title
    and hint comments (those are in the stub too)."""
    found, body, title, in_hint = [], None, "", False
    for line in source.splitlines():
        m = BEGIN.match(line)
        if m:
            body, title, in_hint = [], (m.group("hint") or "").strip(), True
        elif END.match(line) and body is not None:
            found.append((title, body))
            body = None
        elif body is not None:
            in_hint = in_hint and bool(HINT.match(line))
            if not in_hint:
                body.append(line)
    return found


def solution_lines(min_chars: int = 24) -> dict[int, set[str]]:
    """{lab: the code lines of its solution regions, stripped, of at least `min_chars` characters, that the
    package has nowhere outside a region}: text that shows a solution wherever it appears (a lesson's output,
    a handout). Shorter lines (`return out`, `else:`) are too common to say so; a line the package also has
    outside the regions (ZeRO-2 walks its buckets as DDP does; a grader's message quotes a line as its hint)
    is no secret."""
    public, out = [], {}
    marked = {os.path.join(REPO, path) for lab in LABS.values() for path in sources(lab)}
    # the library and the course: a grader's message may quote a line as its hint
    for folder, _, names in (*os.walk(os.path.join(REPO, "minizero")),
                             *os.walk(os.path.join(REPO, "minizero_course"))):
        for path in (os.path.join(folder, name) for name in names if name.endswith(".py")):
            with open(path) as f:
                text = f.read()
            public.append(transform(text, 0, stub=True) if path in marked else text)
    public = "\n".join(public)
    for lab in LABS.values():
        lines = set()
        for path in sources(lab):
            with open(os.path.join(REPO, path)) as f:
                for _, body in regions(f.read()):
                    lines |= {s for s in (line.strip() for line in body)
                              if len(s) >= min_chars and not s.startswith("#") and s not in public}
        out[lab.number] = lines
    return out


def stub_source(fn, lab: int) -> str:
    """`fn`'s source as its lab hands it out: each SOLUTION region its TODO and stub (for a lesson that shows
    the function a lab asks for; where the regions are already stubs or filled in, the source as it is)."""
    import inspect
    import textwrap
    return transform(textwrap.dedent(inspect.getsource(fn)), lab, stub=True)


def sources(lab) -> tuple:
    """The module(s) a lab is generated from, in file order."""
    return (lab.source,) if isinstance(lab.source, str) else tuple(lab.source)


def joined(paths, root: str = REPO, marked: bool = True) -> str:
    """One module's text from several: the first as it is; each next one under a rule naming it, without
    its `from __future__` import (allowed only at the top of a file; the first module must have the same)
    and its imports from an earlier one (those names are this file's own: the student's code, not the
    package's). `root`: the repository the paths are in; `marked`: each must have a SOLUTION region (a
    handout's package has its stubs or the student's code instead)."""
    texts, earlier = [], []
    for path in paths:
        with open(os.path.join(root, path)) as f:
            text = f.read()
        if marked and "# BEGIN SOLUTION" not in text:
            raise ValueError(f"{path} has no '# BEGIN SOLUTION' region")
        if texts:
            lines = text.splitlines()
            for node in reversed(ast.parse(text).body):
                if isinstance(node, ast.ImportFrom) and node.module in ("__future__", *earlier):
                    if node.module == "__future__" and not all(f"from __future__ import {a.name}" in texts[0]
                                                               for a in node.names):
                        raise ValueError(f"{path}: its __future__ import must be in {paths[0]} too")
                    del lines[node.lineno - 1:node.end_lineno]
            text = f"\n\n# {'-' * 77} from {path}\n" + "\n".join(lines) + "\n"
        texts.append(text)
        earlier.append(path.removesuffix(".py").replace("/", "."))
    return "".join(texts)


def render(lab, kind: str, root: str = REPO) -> str:
    """The lab file: `labs` (the regions stubbed), `solutions` (the markers dropped), or `package`: the
    lab's modules as they are in `root` (a handout's, holding the student's code), for the grader."""
    paths = sources(lab)
    source = joined(paths, root, marked=(kind != "package"))
    if kind == "package":
        header = (f"# Lab {lab.number:02d}: {lab.title}\n"
                  f"# GENERATED from {' + '.join(paths)} (your code) by the grader, which grades this copy. "
                  f"Edit those files, not this one.\n")
    else:
        what = ("the TODO regions (everything else is the reference code)" if kind == "labs"
                else "nothing: this is the reference solution")
        header = (f"# Lab {lab.number:02d}: {lab.title}\n"
                  f"# GENERATED from {' + '.join(paths)} by `make labs`. Edit {what}.\n"
                  f"#   run:   mpirun -n {lab.nprocs} python {kind}/{lab.filename}\n"
                  f"#   check: python -m minizero_course grade --lab {lab.number} --impl {kind}"
                  f"    (or: pytest -m lab{lab.number} --impl {kind})\n")
    footer = ("\n\nif __name__ == \"__main__\":\n"
              "    from minizero_course.grader import lab_main\n"
              f"    lab_main({lab.number}, globals())\n")
    return header + transform(source, lab.number, stub=(kind == "labs")) + footer


def main(argv=None) -> int:
    from minizero.cli import checks
    ap = checks.Parser(prog="python -m minizero_course labs", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if labs/ or solutions/ are out of date")
    ap.add_argument("--lab", type=int, action="append", help="only this lab (repeatable); default: all")
    args = ap.parse_args(argv)
    checks.known_numbers(ap, "--lab", args.lab, LABS, "lab")
    stale = []
    for lab in LABS.values():
        if args.lab and lab.number not in args.lab:
            continue
        for kind in ("labs", "solutions"):
            path = os.path.join(REPO, kind, lab.filename)
            text = render(lab, kind)
            current = open(path).read() if os.path.exists(path) else None
            if current != text:
                stale.append(os.path.relpath(path, REPO))
                if not args.check:
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    with open(path, "w") as f:
                        f.write(text)
    if args.check and stale:
        print("out of date (run `make labs`): " + ", ".join(stale), file=sys.stderr)
        return 1
    print(("wrote " + ", ".join(stale)) if stale else "labs/ and solutions/ are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
