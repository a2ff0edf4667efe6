"""The command line: `python -m minizero COMMAND ...` (each command has --help).

    demo         cli/demo.py         4 ranks train a tiny GPT with DDP and ZeRO-1/2/3
    train        cli/train.py        train with a DeepSpeed JSON config under mpirun
    plan         cli/plan.py         the memory estimator (ZeRO paper Table 1, any model size)
    consolidate  cli/consolidate.py  a sharded checkpoint -> one fp32 state dict
    torchrun     cli/torchrun.py     torchrun, saying what its rendezvous waits for; no folder left
The course's commands (grade, labs, handout, gradescope, bench): `python -m minizero_course`.
"""
import importlib
import sys

COMMANDS = {
    "demo": ("minizero.cli.demo", "4 ranks train a tiny GPT with data parallelism; table + PNG"),
    "plan": ("minizero.cli.plan", "model-state memory per GPU for DDP and ZeRO-1/2/3 (estimator)"),
    "train": ("minizero.cli.train",
              "under mpirun: train with a DeepSpeed JSON config; log, plot, checkpoints"),
    "torchrun": ("minizero.cli.torchrun",
                 "torchrun, saying what a multi-node rendezvous waits for; no folder left"),
    "consolidate": ("minizero.cli.consolidate",
                    "a sharded checkpoint -> one fp32 state dict (zero_to_fp32)"),
}


def dispatch(prog: str, commands: dict, argv=None) -> int:
    """Run `commands[argv[0]]`'s module's main(argv[1:]); the course's command line shares it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        lines = "\n".join(f"  {name:<12} {help_}" for name, (_, help_) in commands.items())
        msg = f"usage: python -m {prog} COMMAND [--help]\n\ncommands:\n{lines}"
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown command {argv[0]!r}\n\n{msg}", file=sys.stderr)
            return 2
        print(msg)
        return 0
    from minizero import env
    # a bad MINIZERO_* variable: one line, exit 2, before anything starts
    env.check_or_exit(f"{prog} {argv[0]}")
    module = importlib.import_module(commands[argv[0]][0])
    return module.main(argv[1:]) or 0


# Once commands of this package: a user who still types them is told where they went
COURSE_COMMANDS = ("grade", "labs", "handout", "gradescope", "bench")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in COURSE_COMMANDS:
        print(f"minizero: {argv[0]} is a command of the course: python -m minizero_course "
              f"{' '.join(argv)}", file=sys.stderr)
        return 2
    return dispatch("minizero", COMMANDS, argv)
