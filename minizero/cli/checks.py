"""Command-line values checked at the edge: argparse types that name the allowed range, and output
paths checked before any work starts (a command that would compute for minutes and then fail to
write its result says so at once instead). Every failure is argparse's one line and exit code 2."""
from __future__ import annotations

import argparse
import math
import os
import tempfile


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block: every message names its flag
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def whole(lo: int, hi: int | None = None):
    """An argparse type: a whole number in [lo, hi] (no upper bound without hi)."""
    allowed = f"a whole number >= {lo}" if hi is None else f"a whole number in [{lo}, {hi}]"

    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}, allowed: {allowed}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"got {value}, allowed: {allowed}")
        return value
    return check


def number(lo: float, hi: float = math.inf, open_low: bool = False):
    """An argparse type: a finite number in [lo, hi] ((lo, hi] with open_low)."""
    allowed = f"a number {'>' if open_low else '>='} {lo:g}" + (
        f" and <= {hi:g}" if hi != math.inf else ""
    )

    def check(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}, allowed: {allowed}") from None
        if not math.isfinite(value) or value < lo or (open_low and value == lo) or value > hi:
            raise argparse.ArgumentTypeError(f"got {text}, allowed: {allowed}")
        return value
    return check


def output_file(parser: argparse.ArgumentParser, flag: str, path: str | None):
    """`path` (the value of `flag`) can be written: its folder exists and takes a file. Checked by
    creating and removing a temporary file there, so nothing is left behind (os.access says yes to
    root everywhere)."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        parser.error(f"{flag} {path}: is a folder; give a file name")
    if not os.path.isdir(folder):
        parser.error(f"{flag} {path}: its folder {folder} does not exist; create it first or "
                     "choose another path")
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        parser.error(f"{flag} {path}: cannot write in {folder} ({e.strerror})")


def output_folder(parser: argparse.ArgumentParser, flag: str, path: str | None):
    """`path` (the value of `flag`) is a folder that exists or can be made, and takes files. Call it
    last among the checks: it makes the folder (the command's first act anyway)."""
    if path is None:
        return
    existed = os.path.isdir(path)
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        if not existed and os.path.isdir(path):
            os.rmdir(path)  # made here, unusable: not left behind
        parser.error(f"{flag} {path}: cannot create it or write in it ({e.strerror})")


def known_numbers(parser: argparse.ArgumentParser, flag: str, given, known, noun: str):
    """Every number of `given` (the values of `flag`) is in `known` (the labs, the lessons)."""
    for n in given or []:
        if n not in known:
            parser.error(f"{flag} {n}: no such {noun}; the {noun}s are {min(known)}-{max(known)}")
