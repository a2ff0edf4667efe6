"""What an instructor hands out, built from the repository and the grader.

    handout.py     `python -m minizero_course handout OUT`: the student's copy, chosen labs stubbed
    gradescope.py  `python -m minizero_course gradescope OUT.zip`: a Gradescope autograder bundle
"""
