"""python -m minizero {demo,train,plan,consolidate,torchrun} ... (the dispatch: minizero/cli/)."""
import sys

from minizero.cli import main

if __name__ == "__main__":
    sys.exit(main())
