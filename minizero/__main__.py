"""python -m minizero {demo,train,plan,consolidate,torchrun} ...  (the dispatch is minizero/cli/)."""
import sys

from minizero.cli import main

if __name__ == "__main__":
    sys.exit(main())
