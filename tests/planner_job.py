"""The one 2-rank launch that tests/test_planner_validation.py and tests/test_activation_checkpointing.py
share: minizero_course/experiments/planner.py's 22 configurations, run once per pytest session."""
from minizero import launch

N = 2
_job = []


def results():
    if not _job:
        _job.append(launch.run("minizero_course.experiments.planner:validate", nprocs=N, timeout=400))
    return _job[0]
