# Lab 09: Pipeline parallelism: the 1F1B schedule
# GENERATED from minizero/pipeline/schedules.py by `make labs`. Edit nothing: this is the reference solution.
#   run:   mpirun -n 4 python solutions/lab09_one_f_one_b.py
#   check: python -m minizero_course grade --lab 9 --impl solutions    (or: pytest -m lab9 --impl solutions)
"""Pipeline schedules: what each rank does, in which order, written out as a list of actions.

A pipeline cuts the model into p stages (one per rank) and the batch into m micro-batches. Stage s
runs micro-batch k after stage s-1 did, its backward after stage s+1's. A rank's actions are
    F(k, c)   forward of micro-batch k through this rank's model chunk c
    B(k, c)   its backward: the chunk input's gradient (and the weights', unless split off into W)
    W(k, c)   its weight gradients (zero-bubble schedules only)
and the runtime (runtime.py) executes the lists and nothing else: an F not on the first virtual
stage receives its input, a B not on the last receives its output's gradient. With v chunks per
rank, rank r holds virtual stages r, r+p, ..., r+(v-1)p (Megatron's interleaved placement).

The bubble (idle fraction of a step) for equal stages; F, B, W: one micro-batch's forward,
input-gradient and weight-gradient time through a whole stage:
  * GPipe (Huang et al. 2019): all forwards, then all backwards. (p-1)/(m+p-1); holds all m.
  * 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
    Using Megatron-LM", §2.2.1; PipeDream-Flush): p-r-1 warm-up forwards, then forward and backward
    in turn, then the rest. The same (p-1)/(m+p-1), but rank r holds at most min(p-r, m).
  * Interleaved 1F1B (same paper, §2.2.2): a micro-batch crosses each rank v times, 1/v of the work
    each. (p-1)/(v·m+p-1) for m >= p: the bubble ÷ v, for v x the p2p messages and more in flight,
    min((v-1)·g + 2(p-r-1) + 1, v·m) chunks on rank r (g micro-batches per round).
  * ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §3.1): 1F1B with B (on the critical
    path: the previous stage waits for it) split from W (only the optimizer needs it). Rank r
    postpones r W's into the cool-down, where 1F1B idles: (p-1)(F+B-W) / (m(F+B+W) + (p-1)(F+B-W))
    for m >= p, a third of 1F1B's when F = B = W, holding p micro-batches (1F1B's first stage).

`simulate` plays the lists against each other (sends never block, receives wait, as in the
runtime) and returns the ideal timeline, or names the waiting ranks of a deadlock.
"""
from __future__ import annotations

from typing import Callable, NamedTuple


class ScheduleError(ValueError):
    """A schedule that cannot run: unknown name, bad sizes, an incomplete list or a deadlock."""


class Action(NamedTuple):
    kind: str        # "F", "B" or "W"
    microbatch: int  # which of the m micro-batches
    chunk: int = 0   # which of this rank's v model chunks (virtual stage chunk * p + rank)

    def __str__(self):
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


# ----------------------------------------------------------------------------- the schedules
def gpipe(num_stages: int, num_microbatches: int, rank: int) -> list[Action]:
    """All forwards, then all backwards (GPipe). Every rank holds all m micro-batches at the
    turn."""
    forwards = [Action("F", k) for k in range(num_microbatches)]
    return forwards + [Action("B", k) for k in range(num_microbatches)]


def one_f_one_b(num_stages: int, num_microbatches: int, rank: int) -> list[Action]:
    """1F1B (PipeDream-Flush): warm up with forwards until the first backward can arrive, then
    alternate one forward and one backward, then drain the remaining backwards.

    Rank `rank` of `num_stages` runs F and B of micro-batches 0..num_microbatches-1, each once, in
    micro-batch order. The last stage (rank p-1) needs no warm-up: its first backward can start
    as soon as its first forward is done. Each rank before it needs one more forward in flight,
    so rank r warms up with p-r-1 forwards (but never more than there are micro-batches), and
    so never holds more than min(p-r, m) micro-batches' activations."""
    actions = []
    # the 1F1B action list of one rank.
    #   Invariant: rank r holds at most min(p - r, m) micro-batches' activations (an F stores one,
    #   its B frees it) and the bubble stays GPipe's (p-1)/(m+p-1). Rank r's first B can arrive only
    #   once its micro-batch has crossed the p - r - 1 later stages and come back, so that many
    #   forwards fit before it; from then on each B makes room for one more F. The list is run in
    #   its order; an entry is Action(kind, microbatch, chunk=0), kind "F" or "B".
    #   Each micro-batch's F and B run once, in micro-batch order, on chunk 0 (the default).
    warmup = min(num_stages - rank - 1, num_microbatches)
    actions += [Action("F", k) for k in range(warmup)]
    for k in range(num_microbatches - warmup):
        actions += [Action("F", warmup + k), Action("B", k)]
    actions += [Action("B", k) for k in range(num_microbatches - warmup, num_microbatches)]
    return actions


def rounds_of(num_stages: int, num_microbatches: int) -> int:
    """Micro-batches per round of the interleaved schedule: p, or m itself when m < p (then
    m must be a multiple of it, as in torch.distributed.pipelining's ScheduleInterleaved1F1B)."""
    rounds = max(1, num_microbatches // num_stages)
    group = num_microbatches // rounds
    if num_microbatches % group:
        raise ScheduleError(f"interleaved 1F1B runs micro-batches in rounds of {group} (m // (m // "
                            f"p)): m = {num_microbatches} is not a multiple of it; use m < p or a "
                            f"multiple of p = {num_stages}")
    return group


def interleaved_1f1b(
    num_stages: int, num_microbatches: int, rank: int, num_chunks: int = 2
) -> list[Action]:
    """Interleaved 1F1B (Megatron-LM): each rank runs its v chunks round by round, a group of g
    micro-batches through chunk 0, then through chunk 1, ...; backwards in reverse chunk order.
    Warm-up: (v-1)·g forwards for the last rank, two more per rank before it."""
    p, m, v = num_stages, num_microbatches, num_chunks
    group = rounds_of(p, m)

    def nth(kind, k):  # the k-th forward (or backward) of this rank
        j = k % (group * v)
        chunk = j // group if kind == "F" else v - 1 - j // group
        return Action(kind, (k // (group * v)) * group + j % group, chunk)

    total = m * v
    warmup = min((v - 1) * group + 2 * (p - rank - 1), total)
    actions = [nth("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [nth("F", warmup + k), nth("B", k)]
    return actions + [nth("B", k) for k in range(total - warmup, total)]


def zero_bubble_h1(num_stages: int, num_microbatches: int, rank: int) -> list[Action]:
    """ZB-H1: 1F1B with B (input gradient) and W (weight gradient) split. Rank r keeps r W's
    pending: they run in the cool-down, where 1F1B would idle, so at most p micro-batches are held
    on any rank (the peak of 1F1B's first stage)."""
    # the ZB-H1 action list of one rank (stretch task, extra points).
    #   B (the input gradient) is on the critical path: stage r-1 waits for it. W (the weight
    #   gradient) is not: only the optimizer needs it. So run F and B exactly as 1F1B would,
    #   and postpone W's: rank r keeps r of them pending and runs them in the cool-down, where
    #   1F1B idles. An activation is freed by its W, so every rank holds min(p, m), and the
    #   bubble is (p-1)(F+B-W) / (m(F+B+W) + (p-1)(F+B-W)), a third of 1F1B's when F=B=W.
    #   Every micro-batch's F, B and W once each, in micro-batch order.
    warmup = min(num_stages - rank - 1, num_microbatches)
    actions = [Action("F", k) for k in range(warmup)]
    backwards = weights = 0

    def backward():  # one B, then the oldest pending W once more than `rank` are pending
        nonlocal backwards, weights
        actions.append(Action("B", backwards))
        backwards += 1
        if backwards - weights > rank:
            actions.append(Action("W", weights))
            weights += 1

    for k in range(num_microbatches - warmup):
        actions.append(Action("F", warmup + k))
        backward()
    while backwards < num_microbatches:
        backward()
    return actions + [Action("W", k) for k in range(weights, num_microbatches)]


# name -> (per-rank generator, whether B and W are separate actions)
SCHEDULES: dict[str, tuple[Callable, bool]] = {
    "gpipe": (gpipe, False),
    "1f1b": (one_f_one_b, False),
    "interleaved_1f1b": (interleaved_1f1b, False),
    "zb_h1": (zero_bubble_h1, True),
}


class Schedule(NamedTuple):
    """Every rank's action list, and the sizes it was made for."""
    name: str
    num_stages: int                  # p
    num_microbatches: int            # m
    num_chunks: int                  # v, model chunks per rank
    split_backward: bool             # B computes only input gradients; W the weight gradients
    actions: tuple[tuple[Action, ...], ...]  # actions[rank]

    @property
    def num_virtual_stages(self) -> int:
        return self.num_stages * self.num_chunks


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScheduleError(f"{name} must be a positive int, got {value!r}")
    return value


def make_schedule(name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1,
                  rank_actions: Callable | None = None) -> Schedule:
    """The named schedule for all p ranks, validated (complete, ordered, deadlock-free).
    `rank_actions(p, m, rank)` replaces the generator (a lab's own 1F1B, for instance)."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; valid schedules: "
                            f"{', '.join(SCHEDULES)}")
    p, m, v = (_positive(n, x) for n,
               x in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                                            ("num_chunks", num_chunks)))
    generator, split = SCHEDULES[name]
    if name == "interleaved_1f1b":
        if v < 2:
            raise ScheduleError("interleaved_1f1b needs num_chunks >= 2 model chunks per rank, "
                                f"got {v}")
        per_rank = [interleaved_1f1b(p, m, r, v) for r in range(p)]
    else:
        if v != 1:
            raise ScheduleError(f"{name} runs one model chunk per rank, got num_chunks={v}: use "
                                "interleaved_1f1b")
        per_rank = [(rank_actions or generator)(p, m, r) for r in range(p)]
    # any (kind, microbatch[, chunk]) tuple is an action (a lab file defines its own Action class)
    as_action = lambda a: (  # noqa: E731
        Action(*a) if isinstance(a, tuple) and 2 <= len(a) <= 3 else a
    )
    schedule = Schedule(name, p, m, v, split, tuple(tuple(map(as_action, a)) for a in per_rank))
    validate(schedule)
    return schedule


# ----------------------------------------------------------------------------- checking
def validate(schedule: Schedule):
    """Raise ScheduleError unless every rank runs each F, B (and W) of each micro-batch and chunk
    exactly once, in a valid order, and the ranks together do not deadlock."""
    p, m, v = schedule.num_stages, schedule.num_microbatches, schedule.num_chunks
    kinds = ("F", "B", "W") if schedule.split_backward else ("F", "B")
    if len(schedule.actions) != p:
        raise ScheduleError(f"{schedule.name}: {len(schedule.actions)} action lists for {p} stages")
    for rank, actions in enumerate(schedule.actions):
        seen = {}
        for i, a in enumerate(actions):
            if not isinstance(a, Action):
                raise ScheduleError(f"rank {rank}: action {i} is {a!r}, not an Action(kind, "
                                    "microbatch, chunk)")
            if a.kind not in kinds:
                raise ScheduleError(f"rank {rank}: action {i} {a} has kind {a.kind!r}; this "
                                    f"schedule uses {kinds}")
            if not 0 <= a.microbatch < m or not 0 <= a.chunk < v:
                raise ScheduleError(f"rank {rank}: action {i} {a} is outside the {m} micro-batches "
                                    f"x {v} chunks")
            if a in seen:
                raise ScheduleError(f"rank {rank} runs {a} twice (actions {seen[a]} and {i})")
            before = {"B": "F", "W": "B"}.get(a.kind)
            if before and Action(before, a.microbatch, a.chunk) not in seen:
                raise ScheduleError(f"rank {rank}: {a} (action {i}) comes before "
                                    f"{before}{str(a)[1:]}, which it needs")
            seen[a] = i
        missing = [Action(k, mb, c) for mb in range(m) for c in range(v) for k in kinds
                   if Action(k, mb, c) not in seen]
        if missing:
            raise ScheduleError(f"rank {rank} never runs {', '.join(map(str, missing[:4]))}"
                                f"{' ...' if len(missing) > 4 else ''} ({len(missing)} missing "
                                "actions)")
    simulate(schedule)  # raises on a deadlock


def dependency(schedule: Schedule, rank: int, action: Action):
    """(rank, Action) whose result `action` waits for, or None: the previous virtual stage's F for
    an F, the next one's B for a B (the own F on the last stage), the own B for a W."""
    p, last = schedule.num_stages, schedule.num_virtual_stages - 1
    stage = action.chunk * p + rank
    if action.kind == "F":
        other = stage - 1
    elif action.kind == "B":
        other = stage + 1 if stage < last else stage
        if other == stage:
            return rank, Action("F", action.microbatch, action.chunk)
    else:
        return rank, Action("B", action.microbatch, action.chunk)
    if other < 0:
        return None
    return other % p, Action(action.kind, action.microbatch, other // p)


def unit_cost(schedule: Schedule, forward=1.0, backward=1.0, weight=1.0):
    """Cost of one action: a whole stage's F, B, W split over v chunks; an unsplit B also does W."""
    v = schedule.num_chunks
    table = {"F": forward / v,
             "B": (backward if schedule.split_backward else backward + weight) / v, "W": weight / v}
    return lambda rank, action: table[action.kind]


def simulate(schedule: Schedule, cost: Callable | None = None) -> dict:
    """Play the action lists: each rank runs its list in order, an action starts when the rank is
    free and its dependency has finished (sends never block, as in the runtime). `cost(rank,
    action)` -> duration, default `unit_cost`. Returns {"events": per rank [(action, start, end)],
    "makespan", "busy": per rank, "bubble": 1 - mean busy / makespan}. Raises ScheduleError naming
    the waiting ranks if the lists deadlock."""
    cost = cost or unit_cost(schedule)
    p = schedule.num_stages
    finish, clock, nxt = {}, [0.0] * p, [0] * p
    events = [[] for _ in range(p)]
    while any(nxt[r] < len(schedule.actions[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while nxt[r] < len(schedule.actions[r]):
                action = schedule.actions[r][nxt[r]]
                dep = dependency(schedule, r, action)
                if dep is not None and dep not in finish:
                    break
                start = max(clock[r], finish[dep] if dep is not None else 0.0)
                clock[r] = start + cost(r, action)
                finish[(r, action)] = clock[r]
                events[r].append((action, start, clock[r]))
                nxt[r] += 1
                progressed = True
        if not progressed:
            waits = [
                (r, schedule.actions[r][nxt[r]])
                for r in range(p)
                if nxt[r] < len(schedule.actions[r])
            ]
            stuck = [f"rank {r} at {a} waits for rank {dependency(schedule, r, a)[0]}'s "
                     f"{dependency(schedule, r, a)[1]}"
                     for r, a in waits]
            raise ScheduleError(f"{schedule.name} deadlocks (p={p}, "
                                f"m={schedule.num_microbatches}): "
                                + "; ".join(stuck))
    makespan = max(clock)
    busy = [sum(end - start for _, start, end in ev) for ev in events]
    return {"events": events, "makespan": makespan, "busy": busy,
            "bubble": 1.0 - sum(busy) / (p * makespan) if makespan else 0.0}


def peak_in_flight(schedule: Schedule, rank: int) -> int:
    """Most chunk-activations rank `rank` holds at once: an F stores one, the action that ends its
    backward (B, or W when split) frees it."""
    frees = "W" if schedule.split_backward else "B"
    held = peak = 0
    for a in schedule.actions[rank]:
        held += (a.kind == "F") - (a.kind == frees)
        peak = max(peak, held)
    return peak


# ----------------------------------------------------------------------------- formulas
def bubble_formula(
    name: str, p: int, m: int, v: int = 1, forward=1.0, backward=1.0, weight=1.0
) -> float:
    """The papers' idle fraction of a step for equal stages (see the module docstring). For
    interleaved_1f1b and zb_h1 it holds for m >= p; below that `simulate` gives the ideal one."""
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if name == "zb_h1":
        idle = (p - 1) * (forward + backward - weight)
        return idle / (m * (forward + backward + weight) + idle)
    raise ScheduleError(f"unknown pipeline schedule {name!r}; valid schedules: "
                        f"{', '.join(SCHEDULES)}")


def in_flight_formula(name: str, p: int, m: int, rank: int, v: int = 1) -> int:
    """Micro-batch activations (chunk-activations when interleaved) rank `rank` holds at most."""
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(p - rank, m)
    if name == "zb_h1":
        return min(p, m)  # rank r: p-r-1 warm-up forwards + 1, plus r pending W's
    if name == "interleaved_1f1b":
        return min((v - 1) * rounds_of(p, m) + 2 * (p - rank - 1) + 1, v * m)
    raise ScheduleError(f"unknown pipeline schedule {name!r}; valid schedules: "
                        f"{', '.join(SCHEDULES)}")


if __name__ == "__main__":
    from minizero_course.grader import lab_main
    lab_main(9, globals())
