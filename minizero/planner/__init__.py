"""The planner behind `python -m minizero plan`: per-rank memory by category and bytes per step by
link class for DP/ZeRO, offload, PP, TP(+SP) and activation checkpointing (plan.py), and the layouts
that fit a memory budget ranked by an alpha-beta + FLOP step-time estimate (fit.py). Formulas of
minizero's own layouts, checked against real runs by tests/test_planner_validation.py."""
from minizero.planner.fit import HARDWARE, Hardware, fit, step_time
from minizero.planner.plan import (
    ModelShape,
    Plan,
    PlanError,
    StagePlan,
    ParallelStrategy,
    check,
    plan,
)

__all__ = ["HARDWARE", "Hardware", "ModelShape", "Plan", "PlanError", "StagePlan",
           "ParallelStrategy", "check", "fit", "plan", "step_time"]
