"""Mixed precision: DeepSpeed's loss-scaler rule, skipped steps, master weights, 16 bytes per
parameter from the ledger, 16-bit training against fp32, resume. Single process except one launch
(the overflow vote across ranks)."""
import io
import random

import pytest
import torch

from minizero import launch, memory, precision
from minizero_course.experiments import mixed_precision
from minizero_course.experiments.mixed_precision import loss_tolerance
from minizero.comm import ring_bytes_sent
from minizero.data import SyntheticTokens
from minizero.models import TinyGPT
from minizero.precision import LossScaler, MinLossScaleError, MixedPrecisionOptimizer

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`


def trace(scaler, pattern):
    out = []
    for overflow in pattern:
        scaler.update(bool(overflow))
        out.append(scaler.loss_scale)
    return out


# ------------------------------------------------------------------ the rule, by hand-worked examples

def test_hysteresis_is_spent_not_refilled_by_halving_and_first_doubling_after_window_plus_one():
    # hysteresis=2, window=3, 2^4 = 16. Worked by hand from DeepSpeed's update_scale:
    #   O: budget 2 -> 1, scale kept      O: budget is 1 -> halve (16 -> 8)
    #   O: budget still 1 (halving does not refill it) -> halve again (8 -> 4)
    #   G G G: stable interval 0, 1, 2: nothing     G: stable 3 = window -> double (8), budget back to 2
    #   G G: 4, 5      G: 6 -> double (16)          O: the refilled budget tolerates one overflow again
    s = LossScaler(initial_scale_power=4, loss_scale_window=3, hysteresis=2)
    got = trace(s, [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1])
    assert got == [16, 8, 4, 4, 4, 4, 8, 8, 8, 16, 16]
    assert s.cur_hysteresis == 1


def test_first_doubling_from_the_start_also_needs_window_plus_one_good_steps():
    s = LossScaler(initial_scale_power=8, loss_scale_window=4)
    got = trace(s, [0] * 13)
    first = got.index(512)
    assert first == 4, f"first doubling after update {first}: DeepSpeed doubles on the 5th good step for window 4"
    assert got[4:9] == [512] * 4 + [1024] and got[12] == 2048  # then every 4 good steps


def test_consecutive_hysteresis_refills_on_any_good_step():
    pattern = [1, 0, 1, 0, 1, 0]
    plain = trace(LossScaler(initial_scale_power=6, loss_scale_window=100, hysteresis=2), pattern)
    refilled = trace(LossScaler(initial_scale_power=6, loss_scale_window=100, hysteresis=2,
                                consecutive_hysteresis=True), pattern)
    assert refilled == [64] * 6                      # each overflow is forgiven by the good step after it
    assert plain == [64, 64, 32, 32, 16, 16]         # without: the budget stays spent


def test_min_loss_scale_floor_then_clear_error():
    s = LossScaler(initial_scale_power=5, hysteresis=1, min_loss_scale=3)
    assert trace(s, [1, 1, 1]) == [16, 8, 4]
    s.update(True)
    assert s.loss_scale == 3  # max(4 / 2, 3): the floor, not a power of two
    with pytest.raises(MinLossScaleError, match="min_loss_scale=3"):
        s.update(True)
    quiet = LossScaler(initial_scale_power=1, hysteresis=1, raise_error_at_min_scale=False)
    assert trace(quiet, [1] * 5) == [1] * 5
    with pytest.raises(ValueError, match="below min_loss_scale"):
        LossScaler(initial_scale_power=1, min_loss_scale=4)


def test_random_patterns_keep_the_invariants():
    rng = random.Random(0)
    for _ in range(200):
        cfg = dict(initial_scale_power=rng.randint(2, 20), loss_scale_window=rng.randint(1, 6),
                   hysteresis=rng.randint(1, 4), consecutive_hysteresis=rng.random() < 0.5,
                   min_loss_scale=2.0 ** rng.randint(-3, 2), raise_error_at_min_scale=False)
        s, prev = LossScaler(**cfg), None
        for _ in range(40):
            prev = s.loss_scale
            overflow = rng.random() < 0.3
            s.update(overflow)
            assert 1 <= s.cur_hysteresis <= cfg["hysteresis"]
            assert s.loss_scale >= cfg["min_loss_scale"]
            if overflow:  # never up on an overflow, at most halved
                assert s.loss_scale in (prev, max(prev / 2, cfg["min_loss_scale"]))
            else:         # never down on a good step, at most doubled
                assert s.loss_scale in (prev, 2 * prev)


def test_static_scale_never_moves_but_still_detects_overflow():
    s = LossScaler(loss_scale=128.0)
    assert trace(s, [1, 0, 1, 1, 0] * 3) == [128.0] * 15
    g = torch.ones(4, dtype=torch.float16) * 256
    assert not s.unscale_and_check([g.clone()])
    bad = g.clone()
    bad[2] = float("inf")
    assert s.unscale_and_check([bad]) and bad[0] == 256  # overflow: nothing unscaled
    nan = torch.full((3,), float("nan"))
    assert s.unscale_and_check([torch.ones(2), nan])


def test_unscale_is_exact_and_large_finite_fp16_is_not_an_overflow():
    s = LossScaler(initial_scale_power=10)
    g = torch.full((4096,), 60000.0, dtype=torch.float16)  # finite, but its sum overflows fp16
    g32 = g.float()
    assert not s.unscale_and_check([g32])
    assert torch.equal(g32, g.float() / 1024)


def test_scaler_state_dict_round_trip_resumes_bitwise():
    rng = random.Random(1)
    pattern = [int(rng.random() < 0.25) for _ in range(60)]
    cfg = dict(initial_scale_power=12, loss_scale_window=3, hysteresis=2, raise_error_at_min_scale=False)
    straight = trace(LossScaler(**cfg), pattern)
    a = LossScaler(**cfg)
    first = trace(a, pattern[:27])
    b = LossScaler()  # defaults differ: everything must come from the state dict
    b.load_state_dict(a.state_dict())
    assert first + trace(b, pattern[27:]) == straight
    assert all(isinstance(v, (int, float, bool)) for v in b.state_dict().values())


# ------------------------------------------------------------------ the optimizer: skipped steps, master weights

def _snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()], [m.clone() for m in opt.masters],
            [{k: v.clone() for k, v in s.items()} for s in opt.optimizer.state.values()])


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1])) and len(a[2]) == len(b[2]) and all(
        torch.equal(s[k], t[k]) for s, t in zip(a[2], b[2]) for k in s)


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_injected_overflow_skips_exactly_that_step(hysteresis):
    model = TinyGPT(seed=0).to(torch.float16)
    scaler = LossScaler(initial_scale_power=10, hysteresis=hysteresis)
    opt = MixedPrecisionOptimizer(model.parameters(), torch.optim.Adam, scaler, lr=3e-3)
    data = SyntheticTokens(seed=0)
    for step in range(5):
        x, y = data.batch(step, 4)
        opt.backward(precision.fp32_loss(model, x, y))
        if step == 2:
            model.lm_head.weight.grad[3, 5] = float("-inf")
        before, scale = _snapshot(model, opt), scaler.loss_scale
        opt.step()
        opt.zero_grad()
        after = _snapshot(model, opt)
        assert opt.overflow == (step == 2)
        assert _same(before, after) == (step == 2), f"step {step}: a skipped step must change nothing, a good one must"
        if step == 2:
            assert scaler.loss_scale == (scale / 2 if hysteresis == 1 else scale)
            assert all(p.grad is None for p in model.parameters())
    assert opt.skipped_steps == 1
    # Adam counted only the 4 steps it took
    assert {float(s["step"]) for s in opt.optimizer.state.values()} == {4.0}


def test_master_weights_are_the_optimizer_params_and_round_into_the_model():
    model = TinyGPT(seed=0).to(torch.bfloat16)
    opt = MixedPrecisionOptimizer(model.parameters(), torch.optim.SGD, None, lr=0.1)
    x, y = SyntheticTokens(seed=0).batch(0, 4)
    opt.backward(precision.fp32_loss(model, x, y))
    g = [p.grad.float() for p in model.parameters()]
    m0 = [m.clone() for m in opt.masters]
    opt.step()
    for p, m, old, gi in zip(model.parameters(), opt.masters, m0, g):
        assert m.dtype == torch.float32 and torch.equal(m, old.add(gi, alpha=-0.1))  # SGD on the fp32 master
        assert torch.equal(p, m.to(torch.bfloat16))                         # rounded into the bf16 weight
    with pytest.raises(TypeError, match="16-bit"):
        MixedPrecisionOptimizer(TinyGPT().parameters(), torch.optim.Adam)


def test_clipping_sees_unscaled_gradients():
    x, y = SyntheticTokens(seed=0).batch(0, 4)
    ref = TinyGPT(seed=0).half().float()
    precision.fp32_loss(ref, x, y).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)  # fp32 grads of the same rounded weights
    model = TinyGPT(seed=0).half()
    opt = MixedPrecisionOptimizer(model.parameters(), torch.optim.SGD, LossScaler(initial_scale_power=12),
                                  clip_grad=1e-3, lr=0.0)
    opt.backward(precision.fp32_loss(model, x, y))
    opt.step()
    # the norm of the unscaled fp16 grads, not 4096 times it: equal to fp32's up to fp16 rounding in the
    # forward and backward (measured <= 6e-5 relative over seeds 0-2; tolerance u_fp16 = 4.9e-4)
    assert float(opt.grad_norm) == pytest.approx(float(want), rel=torch.finfo(torch.float16).eps / 2)
    g = [torch.randn(50, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    g2 = [t.clone() for t in g]
    n = precision.clip_grad_norm_(g, 0.5)
    total = torch.cat(g2).norm()
    assert float(n) == pytest.approx(float(total), rel=1e-6)
    assert float(torch.cat(g).norm()) == pytest.approx(0.5, rel=1e-5)


def test_overflow_streak_lowers_to_min_then_errors_without_training_on_garbage():
    model = TinyGPT(seed=0).to(torch.float16)
    init = [p.detach().clone() for p in model.parameters()]
    scaler = LossScaler(initial_scale_power=3, hysteresis=1, min_loss_scale=1)
    opt = MixedPrecisionOptimizer(model.parameters(), torch.optim.Adam, scaler, lr=3e-3)
    x, y = SyntheticTokens(seed=0).batch(0, 4)
    scales = []
    with pytest.raises(MinLossScaleError, match="min_loss_scale=1"):
        for _ in range(10):
            opt.backward(precision.fp32_loss(model, x, y) * float("nan"))  # every gradient nan
            opt.step()
            scales.append(scaler.loss_scale)
    assert scales == [4, 2, 1], "8 -> 4 -> 2 -> 1, then the next overflow at the floor raises"
    assert all(torch.equal(a, p) for a, p in zip(init, model.parameters()))


# ------------------------------------------------------------------ training and memory

@pytest.fixture(scope="module")
def runs():
    # 20 Adam steps of TinyGPT; fp16 at DeepSpeed's default scale 2^16 (no overflow occurs: asserted).
    return {dt: mixed_precision.train(None, dt, steps=20, seed=0) for dt in ("fp32", "fp16", "bf16")}


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_16bit_training_tracks_fp32(runs, dtype):
    # Tolerance: one unit roundoff of the 16-bit format, relative to the loss (loss_tolerance).
    # Measured max over seeds 0-3: 0.30 u (fp16), 0.35 u (bf16): the curves differ by rounding, not by
    # a different trajectory. Step-aligned because no step is skipped.
    r32, r = runs["fp32"], runs[dtype]
    assert not any(r["skipped"])
    assert r["loss"][-1] < r["loss"][0] - 1.0, "it must actually train"
    for step, (a, b) in enumerate(zip(r32["loss"], r["loss"])):
        assert abs(a - b) <= loss_tolerance(dtype, a), f"{dtype} step {step}: {b} vs fp32 {a}"
    # ...and rounding does show: a 16-bit run that equals fp32 bitwise would mean no 16-bit math happened
    assert r["loss"] != r32["loss"]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_ledger_is_2_2_12_bytes_per_parameter(runs, dtype):
    r = runs[dtype]
    psi = r["num_params"]                                  # counted from the model, not the ledger
    n_tensors = len(list(TinyGPT().parameters()))
    led = r["ledger"]                                      # measured after backward of the last step
    assert led["parameters"] == 2 * psi                    # 16-bit weights
    assert led["gradients"] == 2 * psi                     # 16-bit gradients
    assert led["master_params"] == 4 * psi                 # fp32 master copy
    # Adam m and v (4 + 4 bytes), plus torch's per-tensor `step` counter: a 0-dim fp32 tensor each
    assert led["optimizer_state"] == 8 * psi + 4 * n_tensors
    assert led["buffers"] == 0
    # the fp32 copy of the gradients lives only inside step(): transient, 4 bytes per parameter
    assert r["transient_peak"] == 4 * psi
    fp32 = runs["fp32"]["ledger"]                          # for contrast: plain fp32 Adam is 4 + 4 + 8
    assert (fp32["parameters"], fp32["gradients"], fp32["master_params"]) == (4 * psi, 4 * psi, 0)


def test_scale_doubles_in_training_after_window_plus_one_good_steps():
    r = mixed_precision.train(None, "fp16", steps=12, fp16={"initial_scale_power": 8, "loss_scale_window": 4})
    assert not any(r["skipped"])
    assert r["scale"] == [256.0] * 5 + [512.0] * 4 + [1024.0] * 3


def test_static_loss_scale_in_training():
    r = mixed_precision.train(None, "fp16", steps=6, fp16={"loss_scale": 300.0}, inject=[[0, 2]])
    assert r["scale"] == [300.0] * 6 and r["skipped"] == [s == 2 for s in range(6)]


def test_optimizer_state_dict_resume_is_bitwise():
    def make():
        model = TinyGPT(seed=0).to(torch.float16)
        scaler = LossScaler(initial_scale_power=10, loss_scale_window=2, hysteresis=2)
        return model, MixedPrecisionOptimizer(model.parameters(), torch.optim.AdamW, scaler, lr=3e-3, clip_grad=1.0)

    def run(model, opt, steps):
        data = SyntheticTokens(seed=0)
        for step in steps:
            x, y = data.batch(step, 4)
            opt.backward(precision.fp32_loss(model, x, y))
            if step in (2, 3):
                model.wte.weight.grad[0, 0] = float("nan")
            opt.step()
            opt.zero_grad()

    model, opt = make()
    run(model, opt, range(10))
    m1, o1 = make()
    run(m1, o1, range(5))
    buf = io.BytesIO()
    torch.save({"model": m1.state_dict(), "opt": o1.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    m2, o2 = make()
    m2.load_state_dict(saved["model"])
    o2.load_state_dict(saved["opt"])
    run(m2, o2, range(5, 10))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), m2.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(opt.masters, o2.masters))
    assert opt.loss_scaler.state_dict() == o2.loss_scaler.state_dict() and opt.skipped_steps == o2.skipped_steps == 2


def test_memory_tensors_with_grads_in_flight():
    model = TinyGPT(seed=0).to(torch.bfloat16)
    opt = MixedPrecisionOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    led = memory.measure(model, opt).by_category
    psi = model.num_params()
    assert (led["parameters"], led["master_params"], led["optimizer_state"], led["gradients"]) == (2 * psi, 4 * psi, 0,
                                                                                                   0)


# ------------------------------------------------------------------ several ranks: the overflow vote

def test_one_ranks_overflow_skips_the_step_on_every_rank():
    res = launch.run("tests/precision_workers.py:overflow_vote", nprocs=2, args={"steps": 5, "bad_step": 2},
                     timeout=120)
    world = [r["world"] for r in res]
    for r in world:
        assert r["skipped"] == [s == 2 for s in range(5)]
        assert r["scales"] == world[0]["scales"]
        # the vote costs one 4-byte all-reduce per step and nothing else moves (replicas)
        assert r["all_reduce_calls"] == 5
        assert r["sent"] == pytest.approx(5 * ring_bytes_sent("all_reduce", 4, 2))
    assert world[0]["params"] == world[1]["params"]
    # control: without the vote only the rank with the inf skips, and the replicas drift apart
    alone = [r["alone"] for r in res]
    bad = res[0]["bad_rank"]
    assert alone[bad]["skipped"][2] and not alone[1 - bad]["skipped"][2]
    assert alone[0]["params"] != alone[1]["params"]
    # mixed_precision.train's data parallelism: per step one all-reduce of the fp16 gradients (2 bytes each)
    # plus the vote; the same skipped step and scales on both ranks
    dp = [r["dp"] for r in res]
    psi = dp[0]["num_params"]
    for r in dp:
        assert r["skipped"] == [s == 2 for s in range(5)] and r["scale"] == dp[0]["scale"]
        assert r["sent"] == pytest.approx(5 * (ring_bytes_sent("all_reduce", 2 * psi, 2)
                                               + ring_bytes_sent("all_reduce", 4, 2)))
    # clipping over shards: every rank sees the norm of the whole vector, and the pieces together
    # have norm max_norm afterwards
    clip = [r["clip"] for r in res]
    assert all(c["norm"] == pytest.approx(c["full_norm"], rel=1e-6) for c in clip)
    assert sum(c["shard_sq_after"] for c in clip) == pytest.approx(0.5 ** 2, rel=1e-5)
