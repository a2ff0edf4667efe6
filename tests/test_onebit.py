"""1-bit Adam (minizero/compression/): the 1-bit compression, its all-reduce, OneBitAdam.

One 3-rank job (tests/onebit_workers.py:main) measures everything the multi-rank tests assert: 3 ranks,
so every padding path runs (a chunk is a multiple of 8 elements, 8N = 24). Expected bytes come from the
ring model written out here from the tensor sizes, never from comm.stats. Tolerances: the warm-up moves
the same values as torch Adam, so it must be bitwise equal; the TinyGPT loss of 1-bit Adam after its
compressed phase must be within 0.05 of Adam's (the mean of the last 10 steps; one step's loss varies
by about 0.04 there, so this is "the same loss within noise"), and without error feedback at least
0.5 above it."""
import math

import pytest
import torch

from minizero import launch
from minizero.compression import (OneBitAdam, bytes_compressed, compress, end_to_end_reduction, pack_signs,
                                  padded_numel, unpack_signs)
from minizero_course.experiments.onebit import tail_loss

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

N = 3
_cache = {}


@pytest.fixture(scope="module")
def res():
    if "main" not in _cache:
        _cache["main"] = launch.run("tests/onebit_workers.py:main", nprocs=N, timeout=900)
    return _cache["main"]


# ---------------------------------------------------------------------------- one process
def test_signs_pack_8_to_a_byte_and_back():
    x = torch.tensor([1.0, -2.0, 0.0, -0.0, 3.0, -1e-9, 5.0, -5.0, -1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 2.0])
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 2
    # element i is bit i % 8 of byte i // 8; 0.0 and -0.0 count as +1
    assert packed.tolist() == [0b01011101, 0b10001110]
    assert unpack_signs(packed).tolist() == [1, -1, 1, 1, 1, -1, 1, -1, -1, 1, 1, 1, -1, -1, -1, 1]


def test_compress_keeps_the_norm_and_feeds_the_error_back():
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    error = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 0.1
    c = x + error
    packed, scale = compress(x, error)
    decoded = scale * unpack_signs(packed)
    assert scale.item() == pytest.approx(c.norm().item() / 8, rel=1e-6)       # RMS: ||c|| / sqrt(64)
    assert decoded.norm().item() == pytest.approx(c.norm().item(), rel=1e-6)
    assert torch.allclose(error, c - decoded, atol=1e-6)                       # what was lost, kept
    assert torch.equal(unpack_signs(packed), torch.where(c >= 0, 1.0, -1.0))
    again, scale2 = compress(x, None)                                          # no feedback: x alone
    assert scale2.item() == pytest.approx(x.norm().item() / 8, rel=1e-6)


def test_byte_formula_and_end_to_end_reduction():
    assert padded_numel(1001, 3) == 1008 and padded_numel(24, 3) == 24 and padded_numel(1, 4) == 32
    # 2 (N-1)/N (n/8 + 4N): 1008 elements on 3 ranks, 126 sign bytes + 3 scales
    assert bytes_compressed(1001, 3) == pytest.approx(2 * 2 / 3 * (126 + 12))
    assert bytes_compressed(1001, 1) == 0.0
    # the paper's "up to 5x": 32 bits -> 1 bit after a warm-up of 15% of the run
    assert end_to_end_reduction(100, 15, 32.0, 1.0) == pytest.approx(3200 / (15 * 32 + 85))
    assert end_to_end_reduction(100, 0, 32.0, 1.0) == pytest.approx(32.0)
    assert end_to_end_reduction(100, 200, 32.0, 1.0) == pytest.approx(1.0)


class _Solo:
    size, rank = 1, 0


@pytest.mark.parametrize("kwargs, key", [({"freeze_step": -1}, "freeze_step"), ({"freeze_step": 2.5}, "freeze_step"),
                                         ({"comm_backend_name": "gloo"}, "comm_backend_name"),
                                         ({"amsgrad": True}, "amsgrad"), ({"betas": (0.9, 1.0)}, "betas")])
def test_bad_arguments_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        OneBitAdam([torch.nn.Parameter(torch.zeros(2))], _Solo(), **kwargs)


# ---------------------------------------------------------------------------- 3 ranks
def test_warmup_is_torch_adam_bitwise(res):
    for r in res:
        assert r["warmup"] == {"max_diff": 0.0, "compressing": False}
        assert r["warmup_wd"] == {"max_diff": 0.0, "compressing": False}   # against AdamW


def _by_hand(tensors, per_tensor):
    warm = 2 * (N - 1) / N * 4 * sum(tensors)
    groups = [[n] for n in tensors] if per_tensor else [tensors]
    # each group: signs of its padded size (a multiple of 8N) and one fp32 scale per rank, twice
    one_bit = sum(2 * (N - 1) / N * (math.ceil(sum(g) / (8 * N)) * N + 4 * N) for g in groups)
    return warm, one_bit


@pytest.mark.parametrize("kind", ["per_tensor", "flat"])
def test_bytes_per_phase_measured_equal_formula(res, kind):
    for r in res:
        b = r["bytes"][kind]
        warm, one_bit = _by_hand(b["tensors"], kind == "per_tensor")
        assert [row["compressed"] for row in b["rows"]] == [False, False, True, True]   # freeze_step 2
        for row in b["rows"]:
            assert row["replicated"], "the parameters differ between ranks after a step"
            if row["compressed"]:
                assert row["sent"] == {"all_to_all": pytest.approx(one_bit / 2),
                                       "all_gather": pytest.approx(one_bit / 2)}
                assert row["formula"] == pytest.approx(one_bit)
            else:
                assert row["sent"] == {"all_reduce": pytest.approx(warm)}
                assert row["formula"] == pytest.approx(warm)
        assert warm / one_bit > 25  # 32 bits -> 1 bit, less the padding and the scales of small tensors


def test_error_feedback_makes_the_running_average_converge(res):
    for r in res:
        f = r["feedback"]
        assert f["sent"] == pytest.approx(f["formula"]) and f["formula"] == pytest.approx(2 * 2 / 3 * (126 + 12))
        fb, none = f["feedback"], f["none"]
        assert fb["1"] == none["1"] > 0.3             # one call: the same sizeable error either way
        assert fb["1"] > fb["10"] > fb["100"] > fb["400"]
        assert fb["400"] < 0.02 and fb["400"] < fb["10"] / 10   # about 1/k: the error is carried, not lost
        assert none["400"] > 0.9 * none["1"]         # without feedback every call rounds alike: a bias


def test_convergence_against_adam(res):
    runs = res[0]["convergence"]
    adam, onebit = runs["Adam"]["loss"], runs["1-bit Adam"]["loss"]
    freeze = runs["1-bit Adam"]["freeze_step"]
    assert 0 < freeze < len(adam) / 2   # most of the run is compressed
    assert onebit[:freeze + 1] == adam[:freeze + 1]          # the warm-up is Adam: equal losses
    assert onebit[freeze + 1] != adam[freeze + 1]            # then the first compressed step's update differs
    assert tail_loss(adam) < 0.5 * adam[0]                   # it learned
    assert abs(tail_loss(onebit) - tail_loss(adam)) < 0.05
    assert tail_loss(runs["no error feedback"]["loss"]) > tail_loss(adam) + 0.5
    no_warmup = tail_loss(runs["no warm-up"]["loss"])
    assert not math.isfinite(no_warmup) or no_warmup > tail_loss(adam) + 0.5   # v = 0 frozen: m / eps
    assert runs["1-bit Adam"]["bytes_warmup"] / runs["1-bit Adam"]["bytes_compressed"] > 25


class _Pair:
    """Rank 0 of 2 whose peer holds the same gradients: the average is the input, and every
    all-reduce is recorded (the tensor it was given)."""
    size, rank = 2, 0

    def __init__(self):
        self.reduced = []

    def broadcast_tensors(self, tensors):
        pass

    def all_reduce(self, tensor, op="sum"):
        self.reduced.append(tensor)
        if op == "sum":
            tensor.mul_(2)


def test_the_engines_warm_up_reduces_the_gradients_in_place():
    """OneBitAdamStrategy's warm-up: .grad is a view of one flat buffer, all-reduced as it is (no
    concatenation, no copy back); the buffer is freed when compression starts."""
    from minizero.runtime.strategies import OneBitAdamStrategy, StrategySpec
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    spec = StrategySpec(optimizer_cls=OneBitAdam, optimizer_kwargs={"lr": 1e-2, "freeze_step": 2},
                        groups=None, dtype=torch.float32, bucket_numel=0, overlap=False, prefetch=False,
                        persistence_threshold=0, zeropp=None, node_mesh=None, zero_init=None,
                        offload=None, runtime_syncs=False, shard_layout=None, master_dtype=None)
    comm = _Pair()
    strategy = OneBitAdamStrategy(model, comm, spec)
    x = torch.randn(5, 4)
    for step in range(2):
        model(x).square().sum().backward()
        expected = [p.grad.clone() for p in model.parameters()]
        grads = strategy.reduced_grads().replicated
        (flat,) = comm.reduced[step:]
        assert flat.numel() == sum(p.numel() for p in model.parameters())
        for p, g, e in zip(model.parameters(), grads, expected):
            assert g is p.grad and g.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            torch.testing.assert_close(g, e, rtol=0, atol=0)  # the average of equal gradients
        assert strategy.memory_objects()[-1].tensor is flat  # the ledger sees the buffer
        strategy.apply()
        strategy.zero_grad()
    assert strategy.optimizer.compressing
    model(x).square().sum().backward()
    strategy.reduced_grads()
    assert strategy._flat_grad is None and len(strategy.memory_objects()) == 2
