"""Traces: the schedule drawn, as picotron's VERBOSE prints it, ideal or measured.

    format_schedule(schedule)     the classic picture from schedules.simulate
                                  (unit costs by default)
    format_events(events)         the same picture from a real step: every rank's measured events
                                  (PipelineRuntime.last["events"], all-gathered), on a grid of time
                                  slots
`PipelineRuntime(..., verbose=True)` prints each action as it runs instead.
"""
from __future__ import annotations

from typing import Callable

from minizero.pipeline.schedules import Schedule, simulate


def format_schedule(
    schedule: Schedule, cost: Callable | None = None, slot: float | None = None
) -> str:
    """The classic picture, from `simulate`: one row per rank, one column per time slot, each
    action written where it starts, '.' where the rank idles (picotron's VERBOSE, drawn)."""
    sim = simulate(schedule, cost)
    slot = slot or min(end - start for ev in sim["events"] for _, start, end in ev)
    width = max(len(str(a)) for ev in sim["events"] for a, _, _ in ev) + 1
    lines = [f"{schedule.name}: p={schedule.num_stages} m={schedule.num_microbatches}"
             f"{f' v={schedule.num_chunks}' if schedule.num_chunks > 1 else ''}, ideal bubble "
             f"{sim['bubble']:.3f}"]
    for r, ev in enumerate(sim["events"]):
        cells = ["." * (width - 1)] * round(sim["makespan"] / slot)
        for a, start, end in ev:
            first = round(start / slot)
            for i in range(first, round(end / slot)):
                cells[i] = str(a) if i == first else "-" * (width - 1)
        lines.append(f"rank {r}: " + " ".join(c.ljust(width - 1) for c in cells))
    return "\n".join(lines)


def format_events(events_per_rank, columns: int = 48) -> str:
    """The measured timeline as text: one row per rank, the step cut into `columns` equal slots,
    each action's name where its compute started, '-' while it runs, '.' where the rank waited.
    events_per_rank[r] = [(name, start, compute_start, end), ...] of one step (one clock)."""
    t0 = min(ev[0][1] for ev in events_per_rank)
    slot_s = (max(ev[-1][3] for ev in events_per_rank) - t0) / columns
    width = max(len(e[0]) for ev in events_per_rank for e in ev) + 1
    lines = []
    for r, ev in enumerate(events_per_rank):
        cells = ["." * (width - 1)] * columns
        for name, _, start, end in ev:
            first = min(int((start - t0) / slot_s), columns - 1)
            for i in range(first, max(first + 1, min(columns, round((end - t0) / slot_s)))):
                cells[i] = name if i == first else "-" * (width - 1)
        lines.append(f"rank {r}: " + " ".join(c.ljust(width - 1) for c in cells))
    return "\n".join(lines)
