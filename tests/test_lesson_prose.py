"""The lessons' computed conclusions say what the run measured, whichever way it came out.

Each lesson's prose generator (minizero_course/experiments/*.py) is called with figures forced to each side of
every comparison it draws, and the sentence for that side must be there and the other side's must not:
a loaded machine must never print a conclusion its own figures contradict."""
import copy

import pytest

from minizero_course.experiments import activation_checkpointing, collectives, dp_ddp

KiB, MiB = 2**10, 2**20


def lesson01():
    """Figures as collectives.findings returns them: an idle run where every expectation holds."""
    return {
        "load": 0.5, "cores": 2, "pp_alpha": 15e-6, "pp_GBps": 5.0,
        "fit_alpha": {2: 20e-6, 4: 60e-6}, "fit_GBps": {2: 5.0, 4: 4.5}, "bus_GBps": {2: 5.0, 4: 4.8},
        "small": KiB, "small_times": {"all_reduce": 30e-6, "reduce_scatter": 25e-6, "all_gather": 20e-6},
        "half": {"reduce_scatter": 0.5, "all_gather": 0.5},
        "fit_error": {"all_reduce": 0.1, "reduce_scatter": 0.12, "all_gather": 0.1},
        "all_reduce_error": {KiB: 0.1, 64 * KiB: -0.05, MiB: 0.05, 8 * MiB: 0.02},
        "big": 8 * MiB, "n_ratio": 1.5, "n_pred": 1.5, "spread": {2: 1.2, 4: 1.5},
        "gloo_vs_mpi": {16 * KiB: (40e-6, 400e-6), MiB: (150e-6, 900e-6), 8 * MiB: (2e-3, 5e-3)},
        "gloo_rs_vs_ar": 1.8,
    }


def _set(f, path, value):
    *head, last = path
    for k in head:
        f = f[k]
    f[last] = value


# (what is forced, {path: value}, phrases that must appear, phrases that must not)
LESSON01 = [
    ("idle machine", {}, ["was quiet"], ["busy"]),
    ("loaded machine", {("load",): 19.0}, ["busy while measuring"], ["was quiet"]),
    ("collective 8x slower than ping-pong", {("bus_GBps", 2): 5.0 / 8},
     ["8.0× slower than the ping-pong: more than the reduction explains"], ["The two are close", "can explain"]),
    ("collective 1.6x slower", {("bus_GBps", 2): 5.0 / 1.6}, ["which the reduction can explain"],
     ["more than the reduction"]),
    ("collective as fast as ping-pong", {}, ["The two are close"], ["slower than the ping-pong"]),
    ("collective faster than ping-pong", {("bus_GBps", 2): 10.0}, ["beat the ping-pong"], ["The two are close"]),
    ("small ops differ 21x",
     {("small_times",): {"all_reduce": 285e-6, "reduce_scatter": 850e-6, "all_gather": 6166e-6}},
     ["differ by 21.6×", "no single α", "not one round"], ["one round of messages."]),
    ("small ops alike, one ping-pong message each", {}, ["within 1.5× of each other", "one round of messages"],
     ["no single α", "not one round"]),
    ("small ops below an inflated ping-pong alpha", {("pp_alpha",): 654e-6},
     ["less than one ping-pong message's α (654 µs)"],
     ["one round of messages"]),
    ("small ops many ping-pong messages", {("pp_alpha",): 5e-6}, ["4.0-6.0 ping-pong messages", "not one round"],
     ["about one ping-pong message"]),
    ("small ops 0.1-0.6 ping-pong messages",
     {("small_times",): {"all_reduce": 9e-6, "reduce_scatter": 3e-6, "all_gather": 1.5e-6}},
     ["0.1-0.6 ping-pong messages", "some less than one", "none more than two rounds"],
     ["not one round", "one round of messages", "several rounds"]),
    ("small ops 0.2-4 ping-pong messages",
     {("small_times",): {"all_reduce": 60e-6, "reduce_scatter": 3e-6, "all_gather": 15e-6}},
     ["0.2-4.0 ping-pong messages", "some less than one", "some several rounds' worth"],
     ["not one round", "none more than two"]),
    ("small ops 1-4 ping-pong messages",
     {("small_times",): {"all_reduce": 60e-6, "reduce_scatter": 15e-6, "all_gather": 20e-6}},
     ["1.0-4.0 ping-pong messages", "the cheapest about one round", "some several rounds' worth"],
     ["some less than one", "not one round"]),
    ("model misses by a median 69%", {("fit_error", "all_reduce"): 0.69, ("all_reduce_error", KiB): -0.8},
     ["are not the cost", "off by more at 1 KiB", "69% on the all-reduce"], ["fair first estimate"]),
    ("model fits", {}, ["fair first estimate", "off by more at none"], ["are not the cost", "do not predict"]),
    ("model fits its own op only", {("fit_error", "reduce_scatter"): 0.44}, ["do not predict the other two ops"],
     ["fair first estimate", "are not the cost"]),
    ("one size 387x the model", {("all_reduce_error", 2 * KiB): 1 / 387 - 1},
     ["off by more at 2 KiB (worst at 2 KiB, where the measurement was 387.0× the time of the model)"], []),
    ("reduce-scatter 0.95x of all-reduce", {("half", "reduce_scatter"): 0.95},
     ["0.95× for reduce-scatter (more than the model)", "adds what it receives"], []),
    ("all-gather 0.2x of all-reduce", {("half", "all_gather"): 0.2}, ["0.20× for all-gather (less than the model)"],
     []),
    ("halves as predicted", {}, ["0.50× for reduce-scatter (close to the model)"], ["adds what it receives"]),
    ("4 ranks 4.2x vs 1.55x predicted", {("n_ratio",): 4.2, ("n_pred",): 1.55}, ["more than the model"],
     ["within 25% of the model"]),
    ("4 ranks 1.1x vs 1.52x predicted", {("n_ratio",): 1.1, ("n_pred",): 1.52}, ["less than the model"],
     ["within 25% of the model"]),
    ("4 ranks as predicted", {}, ["within 25% of the model"], ["more than the model", "less than the model"]),
    ("4-rank busbw above 2-rank", {("bus_GBps", 4): 8.0}, ["higher, which the model does not allow"],
     ["about the same"]),
    ("4-rank busbw below 2-rank", {("bus_GBps", 4): 1.0}, ["lower, as two ranks sharing each core"],
     ["about the same"]),
    ("gloo wins 16 KiB-1 MiB, MPI 8 MiB", {("gloo_vs_mpi",): {16 * KiB: (400e-6, 40e-6), MiB: (900e-6, 150e-6),
                                                           8 * MiB: (2e-3, 5e-3)}},
     ["MPI was faster at 8 MiB; gloo at 16 KiB, 1 MiB", "depends on the message size",
      "MPI won at 1 of 3 sizes, gloo at 2"],
     ["supports", "did not hold", "This is why minizero uses MPI"]),
    ("MPI wins everywhere", {}, ["gloo at none", "supports minizero's choice"], ["depends on the message size"]),
    ("gloo wins everywhere", {("gloo_vs_mpi",): {16 * KiB: (400e-6, 40e-6), MiB: (900e-6, 150e-6)}},
     ["MPI was faster at none", "did not hold here"], ["supports"]),
    ("gloo's reduce-scatter no slower", {("gloo_rs_vs_ar",): 0.9}, ["no slower than the all-reduce"],
     ["so it is slower"]),
]


def _check(text, want, avoid, label):
    missing = [p for p in want if p not in text]
    wrong = [p for p in avoid if p in text]
    assert not missing and not wrong, f"{label}: missing {missing}, contradicted by {wrong}\n{text}"


@pytest.mark.parametrize("label,changes,want,avoid", LESSON01, ids=[c[0] for c in LESSON01])
def test_lesson01_conclusions_follow_the_figures(label, changes, want, avoid):
    f = lesson01()
    for path, value in changes.items():
        _set(f, path, value)
    _check(collectives.describe(f), want, avoid, label)


def test_lesson01_findings_reads_a_run():
    """findings() turns raw time_collectives results into the figures describe() reads."""
    def rows(N, scale):
        return [{"op": op, "size": s, "time": 2 * scale * collectives.ring_time(op, s, N, 20e-6, 1 / 5e9),
                 "best": scale * collectives.ring_time(op, s, N, 20e-6, 1 / 5e9),
                 "sent": collectives.STEPS[op] * (N - 1) / N * s}
                for op in collectives.STEPS for s in (KiB, 64 * KiB, MiB)]
    res = {2: {"rows": rows(2, 1.0)}, 4: {"rows": rows(4, 3.0)}}
    gloo = {"rows": [r for r in rows(2, 2.0) if r["op"] != "all_gather"]}
    f = collectives.findings(res, gloo, 15e-6, 1 / 5e9, [0.3, 0.4], 2)
    assert f["fit_error"]["all_reduce"] == pytest.approx(0, abs=1e-6)          # the model made the data
    assert f["fit_GBps"][2] == pytest.approx(5.0) and f["fit_alpha"][2] == pytest.approx(20e-6)
    def ring(N):
        return collectives.ring_time("all_reduce", MiB, N, 20e-6, 1 / 5e9)
    assert f["n_ratio"] == pytest.approx(3.0 * ring(4) / ring(2)) and f["n_pred"] == pytest.approx(ring(4) / ring(2))
    assert all(m < g for m, g in f["gloo_vs_mpi"].values())                    # gloo was made 2x slower
    assert "supports minizero's choice" in collectives.describe(f)


def lesson02_dp():
    return {"one": 0.015, "serial": {2: 2.0, 4: 4.0}, "step": {2: 2.0, 4: 4.0}, "ddp_compute": {2: 0.016, 4: 0.030},
            "ddp_step2": 0.020, "dp_step2": 0.040, "ddp_comm2": 0.004, "dp_copies2": 0.010,
            "bytes_into": {2: 1.85e6, 4: 5.6e6}, "ddp_sent4": 2.78e6, "psi": 462_912, "load": 0.5, "cores": 2}


LESSON02_DP = [
    ("compute grows at N=4", {}, ["grew to 30.0 ms"], ["did not grow"]),
    ("compute falls at N=4 (43.8 vs 83.6 ms)", {("ddp_compute",): {2: 0.0836, 4: 0.0438}},
     ["did not grow: 43.8 ms against 83.6 ms"], ["grew to", "compute also grows"]),
    ("serial as predicted", {}, ["about 2×, as one-after-another predicts"], []),
    ("serial slower than n", {("serial", 2): 3.1}, ["more than 2×"], ["about 2×"]),
    ("DDP faster", {}, ["DDP was faster"], ["not faster", "about the same"]),
    ("DDP 46.6 vs 47.0 ms", {("ddp_step2",): 0.0466, ("dp_step2",): 0.0470}, ["about the same (within 5%)"],
     ["DDP was faster", "not faster"]),
    ("DDP slower, compute and comm", {("ddp_step2",): 0.05, ("ddp_compute",): {2: 0.03, 4: 0.03}, ("ddp_comm2",): 0.02},
     ["DDP was not faster here: each DDP rank computed 2.0× slower", "more than DataParallel's reduce"],
     ["DDP was faster"]),
    ("DDP slower, no reason", {("ddp_step2",): 0.05}, ["DDP was not faster here, and neither"], ["DDP was faster"]),
    ("DDP rank computes as a lone replica", {},
     ["1.1× one replica alone", "as ranks running in parallel"],
     ["cannot explain", "compete for the cores. "]),
    ("DDP rank computes 0.5x a lone replica", {("ddp_compute",): {2: 0.0075, 4: 0.030}},
     ["0.5× one replica alone", "which running in parallel cannot explain", "noise"],
     ["its ranks in parallel.", "as ranks running in parallel"]),
    ("DDP rank computes 2x a lone replica", {("ddp_compute",): {2: 0.030, 4: 0.030}},
     ["2.0× one replica alone", "slower than a lone replica, since the two ranks compete"],
     ["cannot explain", "as ranks running in parallel"]),
]


@pytest.mark.parametrize("label,changes,want,avoid", LESSON02_DP, ids=[c[0] for c in LESSON02_DP])
def test_lesson02_data_parallel_conclusions(label, changes, want, avoid):
    f = lesson02_dp()
    for path, value in changes.items():
        _set(f, path, value)
    _check(dp_ddp.describe_data_parallel(f), want, avoid, label)


def _mode(messages, finish, step, compute=0.02):
    return {"messages": messages, "sent": 1.85e6, "compute": compute, "finish": finish, "step": step}


def lesson02_modes():
    m = {N: {"naive": _mode(53, 0.0030, 0.030), "bucketed": _mode(12, 0.0010, 0.028),
             "overlap": _mode(12, 0.0005, 0.025)}
         for N in (2, 4)}
    return {"m": m, "psi": 462_912, "alpha": 15e-6, "load": 0.5}


LESSON02_MODES = [
    ("per message near alpha",
     {("m", 2, "naive", "finish"): 0.0010 + 41 * 30e-6, ("m", 4, "naive", "finish"): 0.0010 + 41 * 40e-6},
     ["At N=2 each extra message cost 30 µs, the order of α", "At N=4 each extra message cost 40 µs"],
     ["rendezvous"]),
    ("per message 6 ms, 400x alpha", {("m", 2, "naive", "finish"): 0.0010 + 41 * 6e-3},
     ["α is 15 µs", "At N=2 each extra message cost 6000 µs, 400× α", "rendezvous"], []),
    ("naive not slower", {("m", 2, "naive", "finish"): 0.0005}, ["At N=2 naive was not slower"], ["At N=2 each extra"]),
    ("N=4 message 14x dearer",
     {("m", 2, "naive", "finish"): 0.0010 + 41 * 50e-6, ("m", 4, "naive", "finish"): 0.0010 + 41 * 700e-6},
     ["14× more at N=4 than at N=2"], []),
    ("overlap faster", {}, ["faster at N=2", "25.0 ms against 28.0 ms, faster."], ["no faster"]),
    ("overlap slower", {("m", 2, "overlap", "step"): 0.041, ("m", 4, "overlap", "step"): 0.041},
     ["no faster at N=2", "no faster."], []),
]


@pytest.mark.parametrize("label,changes,want,avoid", LESSON02_MODES, ids=[c[0] for c in LESSON02_MODES])
def test_lesson02_modes_conclusions(label, changes, want, avoid):
    f = lesson02_modes()
    for path, value in changes.items():
        _set(f, path, value)
    _check(dp_ddp.describe_modes(f), want, avoid, label)


def lesson02_progress():
    probe = {"os_threads": 2, "best_all_reduce": 0.013, "best_compute": 0.050, "best_overlapped": 0.063,
             "best_wait": 0.012}
    step = {"blocked": 0.002, "first": 0.0006, "buckets": 12, "launched": 12, "compute": 0.035, "step": 0.041}
    return {"pd": probe, "pa": dict(probe, os_threads=3, best_wait=0.001, best_overlapped=0.052), "nbytes": 4e6,
            "compute_s": 0.05, "cores": 2, "load": 0.5, "default": step, "threaded": dict(step, step=0.035)}


LESSON02_PROGRESS = [
    ("no background progress by default", {}, ["**no background progress**", "launches early but communicates late"],
     ["was done before the wait"]),
    ("default progressed", {("pd", "best_wait"): 0.002},
     ["was done before the wait", "more than MPICH's rule predicts"],
     ["**no background progress**"]),
    ("thread hid it and saved time", {}, ["and that saved time: launch + compute + wait took 52.00 ms with the thread "
                                          "against 63.00 ms without it"], ["saved no time"]),
    ("thread hid 68% but saved nothing", {("pa", "best_wait"): 0.013 * 0.32, ("pa", "best_overlapped"): 0.070},
     ["moved 68% of it in the background, yet saved no time"], ["and that saved time"]),
    ("thread hid 63% of a 6.4x slower all-reduce", {("pa", "best_all_reduce"): 0.128, ("pa", "best_wait"): 0.048,
                                                   ("pa", "best_overlapped"): 0.105},
     ["yet saved no time: launch + compute + wait took 105.00 ms with the thread against 63.00 ms", "9.8× as long"],
     ["and that saved time"]),
    ("thread did not hide it", {("pa", "best_wait"): 0.012},
     ["the thread did not get the all-reduce done", ", not more, because"],
     ["saved"]),
    ("thread slowed the DDP step", {("threaded", "step"): 0.080}, ["2.0× slower", "The progress threads cost more"],
     ["paid for the thread"]),
    ("thread sped up the DDP step", {}, ["faster.", "Here the overlap paid for the thread."], ["cost more"]),
    ("some buckets after backward", {("default", "launched"): 9}, ["9 of 12 buckets", "fewer than designed"],
     ["as designed,"]),
]


@pytest.mark.parametrize("label,changes,want,avoid", LESSON02_PROGRESS, ids=[c[0] for c in LESSON02_PROGRESS])
def test_lesson02_progress_conclusions(label, changes, want, avoid):
    f = copy.deepcopy(lesson02_progress())
    for path, value in changes.items():
        _set(f, path, value)
    _check(dp_ddp.describe_progress(f), want, avoid, label)


RECOMPUTE = [  # plain, checkpointed, forward, blocks_forward, recompute (ms)
    ("recompute about the blocks' forward, overhead small", (30, 42, 10, 9, 9),
     ["as it should be", "stayed within one forward",
                                                                             "The overhead was smaller"], ["negative"]),
    ("+241% with a 42% forward", (7.6, 26.0, 3.2, 2.5, 2.7),
     ["242% longer", "larger than the recompute", "stayed within one forward"],
     ["The overhead was smaller"]),
    ("recompute slower than a forward", (30, 60, 10, 9, 25), ["exceeded one forward (2.5×)", "run slower"],
     ["stayed within"]),
    ("step grew less than the recompute", (30, 35, 10, 9, 9), ["The rest is negative (-4.0 ms)"], ["The rest, "]),
    ("recompute cut short", (30, 40, 10, 9, 4), ["0.44× the blocks' forward", "stops each recompute"],
     ["as it should be"]),
]


@pytest.mark.parametrize("label,ms,want,avoid", RECOMPUTE, ids=[c[0] for c in RECOMPUTE])
def test_lesson11_recompute_conclusions(label, ms, want, avoid):
    args = dict(zip(("plain", "checkpointed", "forward", "blocks_forward", "recompute"), (x / 1e3 for x in ms)))
    _check(activation_checkpointing.describe_recompute(**args), want, avoid, label)


def test_recompute_is_timed_inside_backward():
    """step_times measures the recompute itself: nothing without checkpointing, something with it."""
    t = activation_checkpointing.step_times(None, repeats=1,
                                            gpt=dict(n_layer=2, n_embd=32, block_size=16, vocab_size=32),
                                            batch=2)
    assert len(t["recompute"]) == 1 and t["recompute"][0] > 0
    assert 0 < t["blocks_forward"][0] < t["forward"][0]


def _granularities(step_ms=(10, 15, 16), recompute_ms=(0, 2, 4), selective_extra=0):
    """Figures as activation_checkpointing.granularities returns them (bytes of the measured TinyGPT layer)."""
    formula = {"none": 3145728.0, "selective": 2097152.0, "full": 131072.0}
    extras = {"none": 24576.0, "selective": 8192.0, "full": 0}
    saved = {m: formula[m] + extras[m] for m in formula}
    saved["selective"] += selective_extra
    return {"shape": dict(n_head=4, block_size=128, n_embd=64, batch=4), "saved": saved, "formula": formula,
            "extras": extras, "step_cpu_s": dict(zip(formula, (t / 1e3 for t in step_ms))),
            "recompute_cpu_s": dict(zip(formula, (t / 1e3 for t in recompute_ms)))}


GRANULARITIES = [
    ("selective cheap per byte", dict(recompute_ms=(0, 1, 4)),
     ["to the byte", "25% of the full one's time and saved 35%", "the cheaper of the two here",
      "Selective made the step's CPU time 50% longer", "5as/h = 80 against 34",
      "drops 70%", "for 2.7% of its", "s/(6h + s) = 25%",
      "25% of the full one's, about in proportion"],
     ["per byte saved full", "differ from"]),
    ("selective dear per byte", dict(recompute_ms=(0, 3.6, 4)),
     ["90% of the full one's time", "per byte saved full was", "ran slower than the linear layers"],
     ["per byte saved it was", "about in proportion"]),
    ("bytes off the formula", dict(selective_extra=256), ["differ from formula + extras in selective (+256 B)"],
     ["to the byte"]),
    ("selective step shorter", dict(step_ms=(10, 9, 16)), ["Selective made the step's CPU time 10% shorter"],
     ["CPU time 10% longer"]),
]


@pytest.mark.parametrize("label,kw,want,avoid", GRANULARITIES, ids=[c[0] for c in GRANULARITIES])
def test_lesson11_selective_conclusions(label, kw, want, avoid):
    _check(activation_checkpointing.describe_granularities(_granularities(**kw)), want, avoid, label)


DPU = [  # tail: mean loss of the last steps (no DPU, warm-up 2, warm-up 40); same: equal through the warm-up
    ("long warm-up closes most of the gap", (1.0, 1.1, 1.02), (True, True),
     ["+0.1000 from no DPU", "left 0.20 of the short one's gap", "what the paper's argument predicts"],
     ["did not help", "do NOT equal", "not tested"]),
    ("long warm-up ends below no DPU", (1.0, 1.1, 0.98), (True, True), ["left -0.20", "it even ended below no DPU"],
     ["did not help"]),
    ("long warm-up no better", (1.0, 1.1, 1.15), (True, True), ["did not help here", "1.50× the short one's"],
     ["left 1.50"]),
    ("short warm-up not above", (1.0, 0.99, 1.01), (True, False),
     ["-0.0100 from no DPU", "not tested here", "do NOT equal"], ["predicts"]),
]


@pytest.mark.parametrize("label,tail,same,want,avoid", DPU, ids=[c[0] for c in DPU])
def test_lesson07_dpu_conclusions(label, tail, same, want, avoid):
    from minizero_course.experiments.offload import describe_dpu
    names = ("no DPU", "DPU, warm-up 2", "DPU, warm-up 40")
    _check(describe_dpu(dict(zip(names, tail)), dict(zip(names[1:], same)), dict(zip(names[1:], (2, 40)))),
           want, avoid, label)


def test_lesson07_ten_x_conclusions():
    from minizero_course.experiments.offload import describe_ten_x
    _check(describe_ten_x(1.41, 13.7, 1.9), ["9.7×", "off by 5%", "a consequence of the stated assumptions",
                                             "the ratio is 7.2×, closer to the 8×"],
           ["do not reproduce", "no closer"], "match")
    _check(describe_ten_x(2.5, 13.7, 3.0), ["off by 79%", "do not reproduce"], ["a consequence of"], "no match")
    _check(describe_ten_x(1.41, 13.7, 1.41), ["no closer to the 8×"], ["×, closer to the 8×"], "symmetric no closer")


def test_lesson04_saving_against_the_formula():
    from minizero_course.experiments.zero12 import describe_saving
    _check(describe_saving(2.2857, 2.2851), ["2.29×, the same to two decimals"], ["below", "above"], "equal")
    _check(describe_saving(2.2857, 2.2512), ["2.25×, below the formula by 0.03"], ["the same to two decimals"], "below")
    _check(describe_saving(2.2857, 2.3012), ["above the formula by 0.02"], ["the same to two decimals"], "above")


def _scaling(**kw):
    f = dict(states=[3.4, 1.7, 1.13, 0.85], gathered=[0.64] * 4, acts=[2.48] * 4, Ns=[1, 2, 3, 4],
             projected64=3.17)
    f.update(kw)
    f.setdefault("z3_total", [s + g + a for s, g, a in zip(f["states"], f["gathered"], f["acts"])])
    f.setdefault("ddp_total", [5.9, 5.9, 5.9, 5.9])
    return f


@pytest.mark.parametrize("label,kw,want,avoid", [
    ("flat parts, projection far above the claim", {},
     ["do not shrink with N", "5.900 MB ÷ 64", "saving is ∝ N for model states only",
                                                        "ZeRO-3 holds *more* than DDP"],
                                                        ["changed with N", "comes close"]),
    ("parts grew with N", {"acts": [2.48, 2.6, 2.9, 3.2]}, ["changed with N (from 3.120 MB at N=1)"],
     ["do not shrink"]),
    ("projection near the claim", {"projected64": 0.1}, ["comes close to the claim"],
     ["saving is ∝ N for model states only"]),
    ("ZeRO-3 no bigger at N=1", {"ddp_total": [9.0] * 4}, ["holds no more than DDP"], ["holds *more*"]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_lesson06_scaling_conclusions(label, kw, want, avoid):
    from minizero_course.experiments.zero3 import describe_scaling
    _check(describe_scaling(**_scaling(**kw)), want, avoid, label)


def test_lesson06_seed_table_sentence_agrees_with_lesson00():
    """Lesson 00 reads the seed's 5 GB ZeRO-3 row as plausible with offload: lesson 06 must
    not call it impossible."""
    from minizero_course.experiments.zero3 import describe_scaling
    _check(describe_scaling(**_scaling()),
           ["at most 4", "offload its config turns on", "lesson 00"], ["cannot be right"],
           "seed table")


def test_lesson06_persistence_conclusions():
    from minizero_course.experiments.zero3 import describe_persistence
    p0 = {"whole": 0, "calls": 15, "sent": {"all_gather": 1261824, "reduce_scatter": 630912}, "ledger": {"a": 0.8e6}}
    p65 = {"whole": 1664, "calls": 20, "sent": {"all_gather": 1251840, "reduce_scatter": 625920, "all_reduce": 9984},
           "ledger": {"a": 0.9e6}}
    pall = {"whole": 210304, "calls": 5, "sent": {"all_reduce": 1261824}, "ledger": {"a": 3.4e6}}
    _check(describe_persistence(p0, p65, pall, 1e6), ["saves 4992 bytes", "raises the collective count from 15 to 20",
                                                      "all-reduce only", "fetch_sub_module"], ["saves nothing"],
                                                      "as measured")
    worse = dict(p65, calls=12, sent=dict(p65["sent"], all_reduce=20000))
    _check(describe_persistence(p0, worse, pall, 1e6), ["saves nothing here (5024 bytes more per step)",
                                                        "went from 15 to 12"], ["raises the collective count"], "worse")


def test_lesson10_tp_against_dp():
    from minizero_course.experiments.tensor import describe_tp_vs_dp
    _check(describe_tp_vs_dp(124_032, 180_480, 12, 3, 7),
           ["0.69× DP's bytes here (fewer", "12 collectives against DP's 3",
                                                          "9 more latencies", "tp_comm_overlap", "Domino"],
           ["in any implementation", "more:"], "fewer bytes")
    _check(describe_tp_vs_dp(400_000, 180_480, 12, 12, 7), ["2.22× DP's bytes here (more"], ["more latencies"],
           "more bytes")


BREAK_EVEN = [  # step_ratio, extra (s), saved (B), ZeRO-3 step (s)
    ("3 ms slower, inside the 5% noise", (1.03, 0.003, 40e3, 0.1),
     ["differ by less than 5% (+3.0 ms)", "gives no break-even", "8.00 MB/s or above"],
     ["any bandwidth", "**"]),
    ("3 ms faster, inside the noise", (0.97, -0.003, 40e3, 0.1), ["gives no break-even"],
     ["any bandwidth"]),
    ("20% faster", (0.8, -0.02, 40e3, 0.1), ["pay at any bandwidth"], ["gives no break-even"]),
    ("20% slower", (1.2, 0.02, 40e3, 0.1), ["40.0 KB / 20.0 ms = **2.00 MB/s**"],
     ["any bandwidth", "gives no break-even"]),
]


@pytest.mark.parametrize("label,figures,want,avoid", BREAK_EVEN, ids=[c[0] for c in BREAK_EVEN])
def test_lesson08_break_even_conclusions(label, figures, want, avoid):
    from minizero_course.experiments.zeropp import describe_break_even
    ratio, extra, saved, step = figures
    _check(describe_break_even(ratio, extra, saved, step, 40, 30), want, avoid, label)


def _sparse_rows(sdpa_saved=4.0, n=2048):
    MiB = 2**20
    row = lambda kind, score, saved, density=1.0: {  # noqa: E731
        "kind": kind, "n": n, "score_bytes": score * MiB, "saved_bytes": saved * MiB,
        "density": density}
    return [row("dense", 64, 71), row("causal", 32.25, 37), row("sdpa", 0, sdpa_saved),
            row("fixed", 9, 13.2, 0.279), row("bigbird", 1.93, 6.0, 0.06)]


@pytest.mark.parametrize("label,sdpa_saved,want,avoid", [
    ("SDPA leaner than every layout", 4.0,
     ["1.98× less", "**causality**",
      "33.2× fewer score bytes than the naive dense, but 16.7× fewer",
      "1/density = 16.7", "no more than the leanest layout (bigbird, 6.00 MiB)", "it saves FLOPs"],
     ["still saves memory"]),
    ("a layout leaner than SDPA", 8.0,
     ["more than the leanest layout (bigbird", "still saves memory"],
     ["no more than the leanest"]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_lesson15_memory_conclusions(label, sdpa_saved, want, avoid):
    from minizero_course.experiments.sparse import describe_memory
    _check(describe_memory(_sparse_rows(sdpa_saved), 2048), want, avoid, label)


@pytest.mark.parametrize("label,longest,want,avoid", [
    ("SDPA longest, bigbird 7x naive",
     dict(dense=768, causal=1280, sdpa=7936, fixed=2048, bigbird=5376),
     ["7.0× the naive dense", "4.2× the causal blocks", "1.7× of the first ratio is causality",
      "0.68× SDPA", "fits no longer a sequence", "stays below 10× here", "batch 1",
      "activation checkpointing", "mechanism, not the figure"],
     ["Even against", "reaches 10× here"]),
    ("bigbird past SDPA and 10x",
     dict(dense=768, causal=1280, sdpa=7936, fixed=2048, bigbird=9000),
     ["Even against a dense attention that keeps no scores", "reaches 10× here"],
     ["fits no longer", "stays below 10×"]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_lesson15_longest_conclusions(label, longest, want, avoid):
    from minizero_course.experiments.sparse import describe_longest
    _check(describe_longest(longest, 16 * 2**20), want, avoid, label)


def _times(fixed2048=0.434, bigbird1024=0.043, sdpa2048=0.302):
    return {1024: {"dense": 0.381, "sdpa": 0.108, "causal": 0.520, "fixed": 0.111,
                   "bigbird": bigbird1024},
            2048: {"dense": 1.733, "sdpa": sdpa2048, "fixed": fixed2048, "bigbird": 0.070}}


@pytest.mark.parametrize("label,times,want,avoid", [
    ("as measured", _times(),
     ["whole model's training iteration", "Fixed layout",
      "fixed 4.0× faster than the naive dense, 0.7× the speed of SDPA",
      "bigbird 24.8× faster than the naive dense, 4.3× faster than SDPA",
      "bigbird is 12.1× faster, for 1/density = 8.7: more than 1/density", "gave 3.4-4.0×",
      "(below 6×;", "bounds a model's from above"],
     ["(6× or more"]),
    ("fixed reaches 6x against the naive dense", _times(fixed2048=0.2), ["(6× or more, but"],
     ["below 6×"]),
    ("bigbird as its density allows", _times(bigbird1024=0.06),
     ["= 8.7: about what sparsity allows"],
     ["= 8.7: more than", "= 8.7: less than"]),
    ("bigbird below its density", _times(bigbird1024=0.3), ["= 8.7: less than 1/density"],
     ["= 8.7: about", "= 8.7: more"]),
    ("fixed faster than SDPA", _times(sdpa2048=0.9),
     ["fixed 4.0× faster than the naive dense, 2.1× faster than SDPA"], ["the speed of SDPA"]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_lesson15_speed_conclusions(label, times, want, avoid):
    from minizero_course.experiments.sparse import describe_speed
    _check(describe_speed(times, {"fixed": 0.308, "bigbird": 0.115}), want, avoid, label)


def _curve(start=4.0, end=1.1, steps=150, lag=0.0, freeze=30):
    """A falling loss; lag is added after the freeze and decays over 60 steps."""
    out = []
    for k in range(steps):
        x = end + (start - end) * 0.97 ** k
        if k >= freeze:
            x += lag * max(0.0, 1 - (k - freeze) / 60)
        out.append(x)
    return out


@pytest.mark.parametrize("label,lag,tail_shift,want,avoid", [
    ("trails then catches up", 0.6, 0.0,
     ["+0.40 at 20 steps after the freeze", "+0.10 at 50 steps", "catches up by the end",
      "judged on the last steps only"], ["still trails", "throughout"]),
    ("never trails", 0.0, 0.0, ["within the spread of Adam throughout"],
     ["catches up", "still trails"]),
    ("still behind at the end", 0.6, 0.2, ["still trails Adam at the end"],
     ["catches up", "throughout"]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_lesson14_gap_conclusions(label, lag, tail_shift, want, avoid):
    from minizero_course.experiments.onebit import describe_gap
    adam = _curve()
    onebit = [x + (tail_shift if k >= 140 else 0) for k, x in enumerate(_curve(lag=lag))]
    _check(describe_gap(adam, onebit, 30, 0.06), want, avoid, label)


def _v(after20, before20=0.2):
    d = lambda m: {"median": m, "p90": 3 * m}  # noqa: E731
    # keys as str: what the launch's JSON hands back
    return {"freeze_step": 30, "l1": [1.0] * 150, "after": {"20": d(after20), "50": d(2 * after20)},
            "before": {"20": d(before20), "50": d(before20)}, "to_end": d(3 * after20)}


@pytest.mark.parametrize("label,after,before,want,avoid", [
    ("v still moving", 0.126, 0.202,
     ["by a median 12.6% (90th percentile 38%) after 20 steps", "it had moved 20.2%",
      "**not** stable", "moving more before the freeze than after"],
     ["stable enough", "no less after"]),
    ("v stable", 0.03, 0.2, ["stable enough to freeze here", "within 3%"], ["**not** stable"]),
    ("v moves more after", 0.3, 0.1, ["**not** stable", "no less after the freeze than before"],
     ["moving more before"]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_lesson14_v_conclusions(label, after, before, want, avoid):
    from minizero_course.experiments.onebit import describe_v
    _check(describe_v(_v(after, before)), want, avoid, label)


def test_lesson14_ablation_conclusions():
    from minizero_course.experiments.onebit import COMPRESSED_ADAM, describe_ablations
    adam = _curve()
    nan = float("nan")
    conv = {"Adam": {"loss": adam},
            "no error feedback": {"loss": adam[:100] + [3.3e9] + [nan] * 49},
            "no warm-up": {"loss": [x + 0.02 for x in adam]},
            COMPRESSED_ADAM: {"loss": [x + 0.7 for x in adam]}}
    text = describe_ablations(conv, 0.06)
    _check(text, ["**no error feedback**", "It diverged: the loss reached 3.3e+09 at step 101",
                  "ended as nan", "within Adam's spread: here it did no harm",
                  "not the paper's failure", "the paper's failure case", "v sums g²",
                  "It ended +0.700 from Adam", "it learned less"], ["stops learning"], "mixed")
    assert text.count("It diverged") == 1


def test_lesson14_time_conclusions():
    from minizero_course.experiments.onebit import describe_time, step_model
    adam, one = step_model(340_000_000, 64, 50e-6, 5e9, 0.145, elem_bytes=2)
    assert 2.4 < adam / one < 2.6                              # 0.42 s against 0.17 s
    models = {"BERT-Large": (adam, one)}
    _check(describe_time(0.0189, 0.0248, 30_080, 2, models),
           ["a compressed one 24.80 ms", "cost 5.90 ms more", "slower than 19.75 MB/s", "2.5×"],
           ["paid even"], "slower")
    _check(describe_time(0.0248, 0.0189, 30_080, 2, models),
           ["compression paid even on shared memory"], ["cost", "slower than"], "faster")
