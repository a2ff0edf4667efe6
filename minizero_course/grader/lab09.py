"""Lab 09 checks: your `one_f_one_b(p, m, rank)` (the 1F1B action list of one rank) is a valid,
deadlock-free schedule with 1F1B's bubble and memory, and the pipeline runtime trains with it
exactly like one process, holding at most min(p - rank, m) micro-batches' activations per stage.

Two launches per submission, shared by the checks (cached per file): one rank plays the action
lists against each other for p = 1..4 and m = 1..9 (schedules.simulate: no real ranks needed to
find a deadlock), four ranks train TinyGPT with them (experiments.pipeline.train).

Stretch task (extra points, not needed for full marks): `zero_bubble_h1(p, m, rank)`, ZB-H1's
action list with B and W split, played in the same one-rank launch against ZB-H1's bubble
formula (F = B = W) and its memory, min(p, m) micro-batches held (each freed by its W)."""
from minizero_course.grader import Check, CheckFailed, Lab

LAB = Lab(9, "one_f_one_b", "Pipeline parallelism: the 1F1B schedule", "minizero/pipeline/schedules.py")

SIZES = [(p, m) for p in (1, 2, 3, 4) for m in range(1, 10)]
RUNS = [(4, 8, "pp4"), (4, 2, "pp4"), (2, 4, "dp2 x pp2")]  # (p, m, mesh): m = 2 < p caps the warm-up
TOL = 2e-7  # atol at rtol 1e-6 against one process, as every strategy (DESIGN.md §7)


# ----------------------------------------------------------------------------- the workers
def shape_worker(comm, impl):
    """On one rank: for each (p, m), the first problem with the action lists, or their simulated
    bubble and the activations each rank holds at most."""
    from minizero.launch import load_target
    fn = load_target(impl + ":one_f_one_b")
    out = [_played("1f1b", fn, p, m) for p, m in SIZES]
    try:  # the stretch task: its stub must not cost the 1F1B checks anything
        zb = load_target(impl + ":zero_bubble_h1")
        zb_h1 = [_played("zb_h1", zb, p, m) for p, m in SIZES]
    except NotImplementedError as e:
        zb_h1 = {"stub": str(e)}
    except Exception as e:  # noqa: BLE001  (a crash in the stretch task fails only its check)
        zb_h1 = {"stub": f"zero_bubble_h1 raised {type(e).__name__}: {e}"}
    return {"1f1b": out, "zb_h1": zb_h1}


def _played(name, fn, p, m):
    """The first problem with fn's action lists for (p, m), or their simulated bubble and peaks."""
    from minizero.pipeline import ScheduleError, make_schedule, peak_in_flight, simulate
    try:
        schedule = make_schedule(name, p, m, rank_actions=fn)
    except ScheduleError as e:
        return {"p": p, "m": m, "error": str(e)}
    return {"p": p, "m": m, "bubble": simulate(schedule)["bubble"],
            "in_flight": [peak_in_flight(schedule, r) for r in range(p)],
            "pending": [_peak_pending(actions) for actions in schedule.actions],
            "warmup": [_warmup(actions) for actions in schedule.actions]}


def _warmup(actions):
    """Forwards a rank runs before its first backward (1F1B and ZB-H1: the p - rank - 1 of the warm-up, then
    the first steady-state one: min(p - rank, m))."""
    return next((i for i, a in enumerate(actions) if a.kind != "F"), len(actions))


def _peak_pending(actions):
    """Most W's a rank has pending when it starts a B (their B done, their W not yet): ZB-H1's
    rank r keeps up to r, so that its W's wait for the cool-down instead of delaying a B."""
    pending = peak = 0
    for a in actions:
        if a.kind == "B":
            peak = max(peak, pending)
        pending += (a.kind == "B") - (a.kind == "W")
    return peak


def train_worker(comm, impl):
    """On four ranks: TinyGPT trained with your schedule, measured (see experiments.pipeline.train)."""
    from minizero_course.experiments.pipeline import train
    from minizero.launch import load_target
    fn = load_target(impl + ":one_f_one_b")
    keep = ("config", "pp_rank", "dp_rank", "reference", "peak_in_flight", "transient_peak", "activation_bytes")
    return [{k: v for k, v in train(comm, "1f1b", p, m, steps=3, rank_actions=fn).items() if k in keep}
            for p, m, _ in RUNS]


_cache = {}
NPROCS = {"shape": 1, "train": 4}


def _launched(kind, impl):
    """One launch per (kind, file), shared by the checks; a failure fails every check alike."""
    from minizero import launch
    key = (kind, impl)
    if kind == "train" and isinstance(_cache.get(("shape", impl)), Exception):
        raise _cache[("shape", impl)]  # the file failed on one rank (a stub, an import error): no 4-rank launch
    if key not in _cache:
        try:
            _cache[key] = launch.run(f"minizero_course.grader.lab09:{kind}_worker", nprocs=NPROCS[kind],
                                     args={"impl": impl}, timeout=180)
        except launch.LaunchError as e:
            _cache[key] = e
    if isinstance(_cache[key], Exception):
        raise _cache[key]
    return _cache[key] if kind == "shape" else list(zip(*_cache[key]))  # train: per run, the ranks


# ----------------------------------------------------------------------------- the checks
def check_valid(impl):
    results = _launched("shape", impl)[0]["1f1b"]
    for r in results:
        if "error" in r:
            raise CheckFailed(f"p={r['p']}, m={r['m']}: {r['error']}")
    return f"complete, ordered and deadlock-free for p = 1..4 and m = 1..9 ({len(results)} pipelines)"


def check_shape(impl):
    """The simulated schedule (unit F, B = 2F) has 1F1B's bubble and holds min(p - rank, m)."""
    results = _launched("shape", impl)[0]["1f1b"]
    for r in results:
        if "error" in r:
            raise CheckFailed(f"p={r['p']}, m={r['m']}: not a valid schedule ({r['error']})")
        p, m = r["p"], r["m"]
        for rank, held in enumerate(r["in_flight"]):
            want = min(p - rank, m)
            if held != want:
                cause = "too many warm-up forwards" if held > want else "too few warm-up forwards"
                raise CheckFailed(f"p={p}, m={m}: rank {rank} holds up to {held} micro-batches' activations, 1F1B "
                                  f"holds min(p - rank, m) = {want}: {cause} (rank r warms up with p - r - 1)")
        formula = (p - 1) / (m + p - 1)
        if abs(r["bubble"] - formula) > 1e-9:
            raise CheckFailed(f"p={p}, m={m}: the simulated bubble is {r['bubble']:.3f}, 1F1B's is (p-1)/(m+p-1) = "
                              f"{formula:.3f}: the forwards and backwards do not alternate as soon as they can")
    return "bubble = (p-1)/(m+p-1) and rank r holds min(p - r, m) micro-batches, for every p <= 4, m <= 9"


def check_trains(impl):
    lines = []
    for (p, m, mesh), ranks in zip(RUNS, _launched("train", impl)):
        worst = max(ranks, key=lambda r: r["reference"]["atol_needed"])
        ref = worst["reference"]
        if not ref["atol_needed"] <= TOL:
            raise CheckFailed(f"{mesh}, m={m}: rank {worst['pp_rank']}'s `{ref['param']}` differs from one process "
                              f"trained on the whole batch by {ref['max_diff']:.3g} after 3 SGD steps")
        lines.append(f"{mesh}, m={m}: max difference from one process "
                     f"{max(r['reference']['max_diff'] for r in ranks):.1e}")
    return "\n".join(lines)


def check_memory(impl):
    lines = []
    for (p, m, mesh), ranks in zip(RUNS, _launched("train", impl)):
        for r in ranks:
            want = min(p - r["pp_rank"], m)
            one = max(r["activation_bytes"].values())
            held = max(r["peak_in_flight"])
            if held > want:
                raise CheckFailed(f"{mesh}, m={m}: stage {r['pp_rank']} held {held} micro-batches' activations at once "
                                  f"(ledger peak {max(r['transient_peak'])} B, {one} B each); 1F1B holds at most "
                                  f"min(p - rank, m) = {want}: start the backwards after p - rank - 1 warm-up forwards")
        held = [max(r['peak_in_flight']) for r in sorted(ranks, key=lambda r: r['pp_rank']) if not r['dp_rank']]
        lines.append(f"{mesh}, m={m}: peak micro-batches held per stage {held}")
    return "\n".join(lines)


def check_zb_h1(impl):
    """Stretch: ZB-H1's list is valid, has the paper's bubble for m >= p (F = B = W; below, no
    more than the reference schedule's) and holds at most min(p, m) micro-batches."""
    from minizero import pipeline
    results = _launched("shape", impl)[0]["zb_h1"]
    if "stub" in results:
        raise CheckFailed(results["stub"])
    for r in results:
        p, m = r["p"], r["m"]
        if "error" in r:
            raise CheckFailed(f"ZB-H1, p={p}, m={m}: {r['error']}")
        for rank, held in enumerate(r["in_flight"]):
            want = pipeline.in_flight_formula("zb_h1", p, m, rank)
            if held > want and r["warmup"][rank] > min(p - rank, m):
                raise CheckFailed(f"ZB-H1, p={p}, m={m}: rank {rank} runs {r['warmup'][rank]} forwards before its "
                                  f"first B, 1F1B runs min(p - rank, m) = {min(p - rank, m)} (p - rank - 1 warm-up "
                                  f"forwards, then F and B alternate): too many warm-up forwards, so it holds {held} "
                                  f"micro-batches' activations (ZB-H1: {want}); ZB-H1 runs F and B exactly as 1F1B "
                                  "does and only postpones W's")
            if held > want:
                raise CheckFailed(f"ZB-H1, p={p}, m={m}: rank {rank} holds up to {held} micro-batches' activations (an "
                                  f"activation lives until its W), ZB-H1 holds min(p, m) = {want}: rank r keeps only r "
                                  "W's pending; run the oldest W as soon as more are pending")
        want = (pipeline.bubble_formula("zb_h1", p, m) if m >= p else
                pipeline.simulate(pipeline.make_schedule("zb_h1", p, m))["bubble"])
        if r["bubble"] > want + 1e-9:
            reference = [_peak_pending(a) for a in pipeline.make_schedule("zb_h1", p, m).actions]
            early = [rank for rank, n in enumerate(r["pending"]) if n < reference[rank]]
            raise CheckFailed(f"ZB-H1, p={p}, m={m}: the simulated bubble (F = B = W) is {r['bubble']:.3f}, ZB-H1's is "
                              f"{want:.3f} (1F1B's {pipeline.bubble_formula('1f1b', p, m):.3f}): "
                              + (f"rank {early[-1]} keeps at most {r['pending'][early[-1]]} W's pending, ZB-H1 keeps "
                                 f"{reference[early[-1]]}: its W's run too early, on the critical path, where the next "
                                 "B should be; postpone them into the cool-down" if early else
                                 "B's are delayed: a B must run as soon as 1F1B would run it, W's fill the idle time"))
    return "valid, bubble = (p-1)(F+B-W) / (m(F+B+W) + (p-1)(F+B-W)) for m >= p, min(p, m) held, p <= 4, m <= 9"


CHECKS = [
    Check("action lists: complete, ordered, deadlock-free (p <= 4, m <= 9)", 3, check_valid),
    Check("1F1B's shape: bubble (p-1)/(m+p-1), min(p - rank, m) in flight (simulated)", 2, check_shape),
    Check("trains like one process (pp 4, m = 8 and 2; dp 2 x pp 2 with DDP)", 3, check_trains),
    Check("peak activations per stage <= min(p - rank, m) (ledger, 4 ranks)", 2, check_memory),
    Check("stretch: ZB-H1's action list (bubble formula, min(p, m) held; extra points)", 2, check_zb_h1, extra=True),
]


def demo(comm, impl):
    """What `mpirun -n 4 python labs/lab09_one_f_one_b.py` shows."""
    from minizero_course.experiments.pipeline import train
    from minizero.pipeline import bubble, format_events, format_schedule, make_schedule
    p, m = comm.size, 8
    schedule = make_schedule("1f1b", p, m, rank_actions=impl.one_f_one_b)
    if comm.rank == 0:
        print(format_schedule(schedule) + "\n")
    r = train(comm, "1f1b", p, m, steps=4, rank_actions=impl.one_f_one_b)
    everyone = comm.allgather_object(r)
    if comm.rank:
        return
    worst = max(everyone, key=lambda x: x["reference"]["max_diff"])["reference"]
    print(f"TinyGPT on {p} stages, {m} micro-batches, 4 SGD steps: largest difference from one process "
          f"{worst['max_diff']:.1e} (`{worst['param']}`)")
    for x in everyone:
        print(f"stage {x['pp_rank']}: at most {max(x['peak_in_flight'])} micro-batches held "
              f"(1F1B: min(p - rank, m) = {min(p - x['pp_rank'], m)}), ledger peak {max(x['transient_peak'])} B")
    print("\nthe last step as it ran (measured):\n" + format_events([x["events"][-1] for x in everyone]))
    steps = [bubble([x["events"][s] for x in everyone]) for s in range(1, 4)]
    print(f"measured bubble {min(s['bubble'] for s in steps):.2f} (best of 3 steps; (p-1)/(m+p-1) = "
          f"{(p - 1) / (m + p - 1):.2f} for equal stages on idle cores)")
