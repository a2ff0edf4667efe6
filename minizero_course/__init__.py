"""The course around the minizero library: what grades, generates and measures, never what a
user imports. It may import minizero; minizero never imports it (tests/test_layout.py).

    grader/       the autograder: the labs' checks, the lab generator (labs/, solutions/), the
                  Gradescope runner inside the autograder
    kit/          what an instructor hands out: the student's copy, the Gradescope bundle
    experiments/  the functions the lessons and the lab checks launch to measure something
    bench/        minizero against torch DDP, FSDP2 and DeepSpeed: time, memory, bytes

`python -m minizero_course COMMAND` (each has --help): grade, labs, handout, gradescope, bench.
"""
