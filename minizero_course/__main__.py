"""python -m minizero_course {grade,labs,handout,gradescope,bench} ...: the course's commands."""
import sys

from minizero.cli import dispatch

COMMANDS = {
    "grade": ("minizero_course.grader", "grade the labs; writes a Gradescope results.json"),
    "labs": ("minizero_course.grader.labgen",
             "write labs/ and solutions/ from the package (--check: are they up to date?)"),
    "handout": ("minizero_course.kit.handout",
                "the student's copy of the course: no solutions, the chosen labs' code stubbed"),
    "gradescope": ("minizero_course.kit.gradescope",
                   "a Gradescope autograder zip (setup.sh, run_autograder) for a lab"),
    "bench": ("minizero_course.bench.bench",
              "step time, memory and bytes vs torch DDP, FSDP2 and DeepSpeed (interleaved)"),
}


def main(argv=None) -> int:
    return dispatch("minizero_course", COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
