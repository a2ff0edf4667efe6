"""pytest's options of this repository, registered at its root so that `pytest -m lab1 --impl labs` works
from here as well as `pytest tests ...` (pytest reads an option's conftest.py before it collects tests/)."""


import os

ROOT = os.path.dirname(os.path.abspath(__file__))


def pytest_addoption(parser):
    # a student's handout (python -m minizero_course handout) grades its own package; the course's repo its solutions
    handout = os.path.exists(os.path.join(ROOT, "minizero_course", "grader", "handout.json"))
    default = "package" if handout else "solutions"
    parser.addoption("--impl", default=default,
                     help=f"which lab files the lab checks grade: 'solutions', 'labs', 'package' or a folder "
                          f"(default here: {default})")
