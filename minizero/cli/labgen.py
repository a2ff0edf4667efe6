"""`python -m minizero.cli.labgen` (make labs): write labs/ and solutions/ from the package's marked regions;
`--check` fails if they are out of date. The generator is minizero/autograde/labgen.py (the grader uses it)."""
import sys

from minizero.autograde.labgen import main

if __name__ == "__main__":
    sys.exit(main())
