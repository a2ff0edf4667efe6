"""minizero.pipeline: pipeline parallelism (lesson 09, lab 09).

    schedules.py       Action, Schedule, the schedules (gpipe, 1f1b, interleaved_1f1b, zb_h1) as
                       per-rank action lists; simulate (ideal timeline, deadlocks), the bubble and
                       in-flight formulas (lab 09 writes one_f_one_b)
    trace.py           format_schedule / format_events: the schedule drawn, ideal or measured
    stage.py           PipelineModel (embed, blocks, head, loss_fn), partition, PipelineStage: this
                       rank's chunks, the p2p pipes over mesh.pp, the tied-weight all-reduce
    split_backward.py  SplitBackward: B (input gradient) and W (weight gradients) as two passes
    runtime.py         PipelineRuntime: executes one rank's action list; bubble(events)
"""
from minizero.pipeline.runtime import PipelineRuntime, bubble
from minizero.pipeline.schedules import (SCHEDULES, Action, Schedule, ScheduleError, bubble_formula,
                                         in_flight_formula, make_schedule, peak_in_flight, simulate)
from minizero.pipeline.split_backward import SplitBackward
from minizero.pipeline.stage import (
    PipelineError,
    PipelineModel,
    PipelineStage,
    StageChunk,
    partition,
)
from minizero.pipeline.trace import format_events, format_schedule

__all__ = ["Action", "PipelineError", "PipelineModel", "PipelineRuntime", "PipelineStage",
           "SCHEDULES", "Schedule", "ScheduleError", "SplitBackward", "StageChunk", "bubble",
           "bubble_formula", "format_events", "format_schedule",
           "in_flight_formula", "make_schedule", "partition", "peak_in_flight", "simulate"]
