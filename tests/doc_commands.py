"""The commands the documentation tells people to type, and a way to check them without running them.

`commands()` extracts every command from README.md, docs/*.md and the header of every generated lab file
(labs/*.py, solutions/*.py): the lines of ```bash blocks (continuations joined, comments dropped) and the
inline code spans that start with a program (python, mpirun, torchrun, pytest, make, pip, conda).

`python tests/doc_commands.py '<json list of argv>'` (run by tests/test_doc_commands.py in one process, so
torch is imported once) runs each `python -m MODULE ARGS...` as far as its argument parsing: every
argparse parser raises a sentinel as soon as it has parsed, so nothing is trained, written or launched;
`python -m minizero plan ...` (pure arithmetic, cheap) runs to the end. It prints one JSON line per
command: {"argv", "status": "parsed" | "ran" | "exit", "code", "stderr"}."""
import argparse
import contextlib
import io
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ("python", ".venv/bin/python", "mpirun", ".venv/bin/mpirun", "torchrun", "pytest", "make", "pip",
            "conda", "apt-get")
RUN_FULLY = {("minizero", "plan")}  # cheap and side-effect free: run to the end, not only parsed


def sources() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "labs").glob("lab*.py")), *sorted((ROOT / "solutions").glob("lab*.py"))]


def _markdown_commands(text: str) -> list[str]:
    found = []
    for block in re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", text, flags=re.M | re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                found.append(line)
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())  # a span may wrap onto the next line
        words = span.split()
        if len(words) > 1 and (words[0] in PROGRAMS or re.match(r"^[A-Z_]+=\S+$", words[0])):
            found.append(span.strip())
    return found


def _header_commands(text: str) -> list[str]:
    """A lab file's header: `#   run:   CMD` and `#   check: CMD    (or: CMD)`."""
    found = []
    for line in text.splitlines()[:10]:
        m = re.match(r"^#\s+(?:run|check):\s+(.*)$", line)
        if m:
            first, _, alternative = m.group(1).partition("(or:")
            found += [first.strip()] + ([alternative.rstrip(") ").strip()] if alternative else [])
    return found


def commands() -> list[tuple[str, str]]:
    """(where, command) for every documented command, `&&` chains split."""
    out = []
    for path in sources():
        text = path.read_text()
        found = _header_commands(text) if path.suffix == ".py" else _markdown_commands(text)
        for command in found:
            for part in command.split("&&"):
                out.append((str(path.relative_to(ROOT)), part.strip()))
    return out


class _Parsed(Exception):
    pass


def check(argv: list[str]) -> dict:
    """Run `python ARGV` in this process as far as argparse (to the end for RUN_FULLY)."""
    module, args = (argv[2], argv[3:]) if argv[:1] == ["python"] else (argv[1], argv[2:])
    full = (module, args[0] if args else "") in RUN_FULLY
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, *a, **k):
        namespace = original(self, *a, **k)
        if not full:
            raise _Parsed()
        return namespace

    err = io.StringIO()
    argparse.ArgumentParser.parse_args = parse_and_stop
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            import importlib
            # a package's `python -m`: its __main__'s dispatch (minizero's lives in minizero.cli)
            where = {"minizero": "minizero.cli", "minizero_course": "minizero_course.__main__"}
            main = importlib.import_module(where.get(module, module)).main
            code = main(args)
        return {"argv": argv, "status": "ran" if full else "exit", "code": code or 0, "stderr": err.getvalue()[-600:]}
    except _Parsed:
        return {"argv": argv, "status": "parsed", "code": 0, "stderr": ""}
    except SystemExit as ex:
        return {"argv": argv, "status": "exit", "code": ex.code, "stderr": err.getvalue()[-600:]}
    finally:
        argparse.ArgumentParser.parse_args = original


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    for argv in json.loads(sys.argv[1]):
        print(json.dumps(check(argv)), flush=True)
