"""pytest's options of this repository, registered at its root so that `pytest -m lab1 --impl labs` works
from here as well as `pytest tests ...` (pytest reads an option's conftest.py before it collects tests/)."""


def pytest_addoption(parser):
    parser.addoption("--impl", default="solutions",
                     help="which lab files the lab checks grade: 'solutions' (default), 'labs', or a folder")
