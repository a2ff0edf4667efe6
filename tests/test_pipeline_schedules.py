"""Pipeline schedules as data: every schedule is complete, deadlock-free, holds the activations
its paper says, and has the paper's bubble when stages are equal (simulated, no timing).
Pure Python: no ranks are launched here (tests/test_pipeline.py runs them)."""
import pytest
import torch

from minizero.pipeline import (SCHEDULES, Action, ScheduleError, bubble_formula, format_schedule, in_flight_formula,
                               make_schedule, peak_in_flight, simulate)
from minizero.pipeline.runtime import split_microbatches
from minizero.pipeline.schedules import Schedule, gpipe, one_f_one_b, unit_cost, validate
from minizero.pipeline.stage import PipelineError, partition

GRID = [(name, p, m, v) for name in SCHEDULES for p in range(1, 7) for m in range(1, 13)
        for v in ((2, 3) if name == "interleaved_1f1b" else (1,))
        if name != "interleaved_1f1b" or m % (m // max(1, m // p)) == 0]


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_is_complete_and_deadlock_free_and_holds_what_its_formula_says(name):
    cases = [c for c in GRID if c[0] == name]
    assert len(cases) >= 60
    for _, p, m, v in cases:
        schedule = make_schedule(name, p, m, v)  # validate(): complete, ordered, simulated without deadlock
        kinds = "FBW" if schedule.split_backward else "FB"
        for rank, actions in enumerate(schedule.actions):
            assert len(actions) == len(kinds) * m * v
            assert peak_in_flight(schedule, rank) == in_flight_formula(name, p, m, rank, v), (p, m, v, rank)


@pytest.mark.parametrize("name", SCHEDULES)
def test_ideal_bubble_equals_the_papers_formula(name):
    """Unit costs F = B = W = 1 per stage (1/v per chunk): the simulated idle fraction is the formula
    wherever the papers state it (m >= p for interleaving and ZB-H1; every m for GPipe and 1F1B)."""
    checked = 0
    for _, p, m, v in (c for c in GRID if c[0] == name):
        if name in ("interleaved_1f1b", "zb_h1") and m < p:
            continue
        assert simulate(make_schedule(name, p, m, v))["bubble"] == pytest.approx(bubble_formula(name, p, m, v),
                                                                                 abs=1e-12)
        checked += 1
    assert checked >= 40
    # unequal F, B, W: ZB-H1's bubble is (p-1)(F+B-W) per rank; at W = 0 it is 1F1B's again
    zb = make_schedule("zb_h1", 4, 8)
    for f, b, w in ((1.0, 2.0, 0.5), (1.0, 1.0, 0.0), (2.0, 1.0, 1.0)):
        assert simulate(zb,
                        unit_cost(zb, f, b, w))["bubble"] == pytest.approx(bubble_formula("zb_h1", 4, 8, 1, f, b, w))
    assert bubble_formula("zb_h1", 4, 8, 1, 1, 1, 0) == bubble_formula("1f1b", 4, 8)


def test_what_the_schedules_buy():
    """GPipe and 1F1B: the same bubble, but 1F1B's memory does not grow with m; interleaving
    divides the bubble by about v and costs v times the messages; ZB-H1 keeps 1F1B's peak."""
    p, m = 4, 16
    g, f, i, z = (make_schedule(n, p, m, 2 if n == "interleaved_1f1b" else 1) for n in SCHEDULES)
    assert simulate(g)["bubble"] == simulate(f)["bubble"]
    assert [peak_in_flight(g, r) for r in range(p)] == [m] * p
    assert [peak_in_flight(f, r) for r in range(p)] == [4, 3, 2, 1]
    assert simulate(i)["bubble"] < 0.6 * simulate(f)["bubble"]
    assert [peak_in_flight(z, r) for r in range(p)] == [p] * p
    assert simulate(z)["bubble"] < 0.4 * simulate(f)["bubble"]


def test_one_f_one_b_by_hand():
    assert [str(a) for a in one_f_one_b(4, 6, 0)] == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5".split()
    assert [str(a) for a in one_f_one_b(4, 6, 3)] == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5".split()
    assert [str(a) for a in one_f_one_b(4, 2, 0)] == "F0 F1 B0 B1".split()  # warm-up capped at m
    assert [str(a) for a in make_schedule("interleaved_1f1b", 2, 2, 2).actions[0]][:4] == ["F0", "F1", "F0.1", "F1.1"]


def test_picture():
    text = format_schedule(make_schedule("1f1b", 2, 3))
    assert text.splitlines()[1:] == ["rank 0: F0 F1 .. .. B0 -- F2 B1 -- .. B2 --",
                                     "rank 1: .. F0 B0 -- F1 B1 -- F2 B2 -- .. .."]
    assert "ideal bubble 0.250" in text


def test_measured_events_drawn():
    """format_events draws real (name, start, compute start, end) events on a time grid: a rank that
    waited shows dots until its compute began."""
    from minizero.pipeline import format_events
    events = [[("F0", 0.0, 0.0, 1.0), ("B0", 1.0, 3.0, 5.0)],
              [("F0", 0.0, 1.0, 2.0), ("B0", 2.0, 2.0, 4.0)]]
    assert format_events(events, columns=5).splitlines() == ["rank 0: F0 .. .. B0 --",
                                                             "rank 1: .. F0 B0 -- .."]


def test_a_deadlock_is_named():
    no_warmup = [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)]
    bad = [no_warmup, gpipe(2, 2, 1)]
    with pytest.raises(ScheduleError, match=r"mine deadlocks \(p=2, m=2\): rank 0 at B0 waits for rank 1's B0; "
                                            r"rank 1 at F1 waits for rank 0's F1"):
        validate(Schedule("mine", 2, 2, 1, False, tuple(map(tuple, bad))))


@pytest.mark.parametrize("actions,message", [
    ([Action("F", 0), Action("F", 0), Action("B", 0)], "runs F0 twice"),
    ([Action("B", 0), Action("F", 0)], r"B0 \(action 0\) comes before F0"),
    ([Action("F", 0)], "never runs B0"),
    ([Action("F", 1), Action("B", 1)], "outside the 1 micro-batches"),
    ([Action("F", 0), Action("B", 0), Action("W", 0)], r"kind 'W'; this schedule uses \('F', 'B'\)"),
    (["F0", "B0"], "not an Action"),
])
def test_an_invalid_action_list_is_refused_naming_the_action(actions, message):
    with pytest.raises(ScheduleError, match=message):
        validate(Schedule("mine", 1, 1, 1, False, (tuple(actions),)))


def test_bad_schedule_requests():
    with pytest.raises(ScheduleError, match="unknown pipeline schedule 'pipedream'; valid schedules: gpipe, 1f1b, "
                                            "interleaved_1f1b, zb_h1"):
        make_schedule("pipedream", 2, 4)
    with pytest.raises(ScheduleError, match="rounds of 2 .* m = 5 is not a multiple of it"):
        make_schedule("interleaved_1f1b", 2, 5, 2)
    with pytest.raises(ScheduleError, match="needs num_chunks >= 2"):
        make_schedule("interleaved_1f1b", 2, 4, 1)
    with pytest.raises(ScheduleError, match="one model chunk per rank"):
        make_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ScheduleError, match="num_microbatches must be a positive int"):
        make_schedule("1f1b", 2, 0)


def test_partition_and_its_bad_input():
    assert partition(5, 2) == [range(0, 3), range(3, 5)]
    assert partition(8, 2, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(PipelineError, match="5 pipeline stages .* only 4 blocks"):
        partition(4, 5)
    with pytest.raises(PipelineError, match="6 blocks do not divide by 4"):
        partition(6, 2, 2)


def test_micro_batches_must_divide_the_batch():
    x = torch.arange(12).view(6, 2)
    assert [c.tolist() for c in split_microbatches(x, 3)] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]
    with pytest.raises(PipelineError, match="a batch of 6 does not split into 4 micro-batches"):
        split_microbatches(x, 4)
