"""The command line: `python -m minizero COMMAND ...` (each command has --help).

    demo         cli/demo.py         4 ranks train a tiny GPT with DDP and ZeRO-1/2/3
    train        cli/train.py        train with a DeepSpeed JSON config under mpirun
    plan         cli/plan.py         the memory estimator (ZeRO paper Table 1, any model size)
    consolidate  cli/consolidate.py  a sharded checkpoint -> one fp32 state dict
    torchrun     cli/torchrun.py     torchrun that says what its rendezvous waits for and leaves no folder
    bench        bench/bench.py      step time, memory and bytes vs torch and DeepSpeed
    grade        autograde/          grade the labs, Gradescope results.json
    handout      cli/handout.py      the student's copy: no solutions, the chosen labs' code stubbed
    gradescope   cli/gradescope.py   a Gradescope autograder zip (setup.sh, run_autograder)
`python -m minizero.cli.labgen` (make labs) generates labs/ and solutions/.
"""
import importlib
import sys

COMMANDS = {
    "demo": ("minizero.cli.demo", "4 ranks train a tiny GPT with data parallelism; table + PNG"),
    "bench": ("minizero.bench.bench", "step time, memory and bytes vs torch DDP, FSDP2 and DeepSpeed (interleaved)"),
    "plan": ("minizero.cli.plan", "model-state memory per GPU for DDP and ZeRO-1/2/3 (estimator)"),
    "grade": ("minizero.autograde", "grade the labs; writes a Gradescope results.json"),
    "train": ("minizero.cli.train", "under mpirun: train with a DeepSpeed JSON config; log, plot, checkpoints"),
    "torchrun": ("minizero.cli.torchrun", "torchrun, saying what a multi-node rendezvous waits for; no folder left"),
    "consolidate": ("minizero.cli.consolidate", "a sharded checkpoint -> one fp32 state dict (zero_to_fp32)"),
    "handout": ("minizero.cli.handout",
                "the student's copy of the course: no solutions, the chosen labs' code stubbed"),
    "gradescope": ("minizero.cli.gradescope", "a Gradescope autograder zip (setup.sh, run_autograder) for a lab"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = "\n".join(f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items())
        msg = f"usage: python -m minizero COMMAND [--help]\n\ncommands:\n{lines}"
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown command {argv[0]!r}\n\n{msg}", file=sys.stderr)
            return 2
        print(msg)
        return 0
    from minizero import env
    env.check_or_exit(f"minizero {argv[0]}")  # a bad MINIZERO_* variable: one line, exit 2, before anything starts
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:]) or 0
