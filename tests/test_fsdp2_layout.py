"""FSDP's shard_layout="per_param" (FSDP2's layout) at 2 ranks (every dim 0 divides: equal pieces) and 3
ranks (64, 32, 96 and 16 rows do not divide by 3: padding on the last ranks), against the single process
and torch's own fully_shard in the same launch (tests/fsdp2_workers.py, torch backend, gloo).

Tolerances, and why:
  * losses 2e-6 absolute (the fp32 spacing near a loss of 4 is 4.8e-7: a few roundings of a sum of shard
    means in another order; measured 4.8e-7 at 3 ranks, for torch's FSDP2 too),
  * parameters after 4 SGD steps and gradients 2e-7 (test_zero3's SGD tolerance; measured 1.5e-8 and 3.5e-8),
  * the clip line's norm rtol 1e-5 (one norm of ~30k squares summed in another order; measured 8e-7),
  * bf16 compute: 0.05 from fp32 (test_zero3's: bf16's spacing near a loss of 4 is 0.031).
The expected shapes, bytes and memory are computed here from the plain model's shapes by FSDP2's rule
(ceil(dim0 / N) rows a rank), never read back from the wrapper under test.
"""
import math
import tempfile

import pytest

from minizero import launch
from minizero.models import build_model

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

W = "tests/fsdp2_workers.py:"
GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)
F32 = 4  # bytes per element
_results = {}

pytest.importorskip("torch.distributed.fsdp", reason="torch's fully_shard (pip install torch>=2.6)")


def results(n):
    if n not in _results:
        with tempfile.TemporaryDirectory(prefix="minizero-fsdp2-") as ckpt:
            _results[n] = launch.run(W + "run_all", nprocs=n, backend="torch", timeout=300, args={"ckpt": ckpt})
    return _results[n]


def expected_shapes(n, rank):
    """FSDP2's piece of each parameter on `rank`: rows [r·c, min((r+1)·c, dim0)), c = ceil(dim0 / n)."""
    out = {}
    for name, p in build_model("tiny-gpt", seed=0, **GPT).named_parameters():
        c = -(-p.shape[0] // n)
        out[name] = [max(0, min((rank + 1) * c, p.shape[0]) - rank * c), *p.shape[1:]]
    return out


def shard_numel(n):
    """Elements of one rank's shards, padding included: Σ over parameters of ceil(dim0 / n) · row elements."""
    return sum(-(-p.shape[0] // n) * (p.numel() // p.shape[0])
               for p in build_model("tiny-gpt", seed=0, **GPT).parameters())


@pytest.mark.parametrize("n", [2, 3])
def test_trains_like_one_process_and_torch_fsdp2(n):
    for out in results(n):
        single, mz, peer = out["single_losses"], out["minizero"], out["torch"]
        assert mz["losses"] == pytest.approx(single, rel=0, abs=2e-6)
        assert peer["losses"] == pytest.approx(single, rel=0, abs=2e-6)
        assert mz["losses"] == pytest.approx(peer["losses"], rel=0, abs=2e-6)
        assert mz["param_diff"] <= 2e-7 and peer["param_diff"] <= 2e-7
        assert out["persistent"]["losses"] == pytest.approx(single, rel=0, abs=2e-6)  # persistence_threshold=129
        assert out["bf16"] == pytest.approx(single, rel=0, abs=0.05)  # test_zero3's bf16 tolerance (8 bits)
        assert out["bf16"] != mz["losses"]  # it did compute in bf16
        assert out["engine"]["losses"] == pytest.approx(single, rel=0, abs=2e-6)  # zero_optimization.shard_layout
        # its checkpoint, resumed: by the same layout the same numbers; by flat units within the tolerance
        assert out["resumed"]["per_param"] == out["engine"]["losses"][2:]
        assert out["resumed"]["flat"] == pytest.approx(out["engine"]["losses"][2:], rel=0, abs=2e-6)


@pytest.mark.parametrize("n", [2, 3])
def test_shard_shapes_are_fsdp2s(n):
    for rank, out in enumerate(results(n)):
        want = expected_shapes(n, rank)
        assert out["minizero"]["shapes"] == want == out["torch"]["shapes"]
        assert out["minizero"]["grad_shapes"] == want == out["torch"]["grad_shapes"]
        assert out["engine"]["shapes"] == want
        full = {name: list(p.shape) for name, p in build_model("tiny-gpt", seed=0, **GPT).named_parameters()}
        assert out["persistent"]["shapes"] == {name: full[name] if math.prod(full[name]) < 129 else want[name]
                                               for name in want}  # under the threshold: whole on every rank
    if n == 3:  # the padding is on the last rank: 64 rows -> 22, 22, 20; a 32-element norm weight -> 11, 11, 10
        assert [results(3)[r]["minizero"]["shapes"]["wte.weight"] for r in range(3)] == [[22, 32], [22, 32], [20, 32]]
        assert [results(3)[r]["minizero"]["shapes"]["ln_f.weight"] for r in range(3)] == [[11], [11], [10]]
    # the flat layout's pieces of the same model are cut where the flat shard ends: not FSDP2's
    assert any(out["flat_shapes"] != expected_shapes(n, rank) for rank, out in enumerate(results(n)))


@pytest.mark.parametrize("n", [2, 3])
def test_fsdp2_style_gradient_gather(n):
    """Each p.grad piece all-gathered with dist.all_gather_into_tensor completes and is the full gradient."""
    for out in results(n):
        mz = out["minizero"]
        assert mz["gathered_grad_diff"] <= 2e-7 and out["torch"]["gathered_grad_diff"] <= 2e-7
        assert mz["full_tensor_diff"] <= 2e-7
        assert mz["torch_clip_norm"] == pytest.approx(out["single_norm"], rel=1e-5)
    if n == 2:  # every dim 0 here is even: every rank's piece of every parameter has the same shape
        assert all(all(out["minizero"]["equal_pieces"].values()) for out in results(2))


@pytest.mark.parametrize("n", [2, 3])
def test_bytes_and_ledger_count_the_padding(n):
    """One rank's shards hold S = Σ ceil(dim0/N)·row elements; an all-gather or reduce-scatter of a unit
    sends (N-1)·S_unit·4 bytes (the ring model of comm/stats.py on the padded N·S_unit payload)."""
    s = shard_numel(n)
    padding = s * n - sum(p.numel() for p in build_model("tiny-gpt", seed=0, **GPT).parameters())
    assert padding == 0 if n == 2 else padding > 0  # 3 ranks: 64, 32, 16 and 128 rows do not divide
    for out in results(n):
        mz = out["minizero"]
        assert sum(u["shard_numel"] for u in mz["units"]) == s
        assert mz["forward_sent"] == {"all_gather": (n - 1) * s * F32}
        assert mz["backward_sent"] == {"all_gather": (n - 1) * s * F32, "reduce_scatter": (n - 1) * s * F32}
        assert mz["ledger"]["parameters"] == s * F32 and mz["ledger"]["gradients"] == s * F32


@pytest.mark.parametrize("zero, message", [
    ({"stage": 3, "shard_layout": "per-param"}, "zero_optimization.shard_layout must be 'flat' or 'per_param'"),
    ({"stage": 2, "shard_layout": "per_param"}, "not with stage 2"),
    ({"stage": 3, "shard_layout": "per_param", "zero_quantized_weights": True}, "zero_optimization.zero_quantized_w"),
    ({"stage": 3, "shard_layout": "per_param", "offload_optimizer": {"device": "cpu"}}, "offload_optimizer"),
])
def test_config_refuses_what_is_not_implemented(zero, message):
    from minizero.runtime.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=message):
        load_config({"train_batch_size": 4, "zero_optimization": zero}, 1)
