"""Models, synthetic data and the single-process baseline: the ground everything else stands on."""
import math

import pytest
import torch

from minizero_course.experiments.references import train_single
from minizero.data import SyntheticTokens, regression_batch, shard
from minizero.models import MLP, EdgeCaseModel, GPTConfig, TinyGPT, build_model

torch.set_num_threads(1)


def edge_batch(step, batch_size=8):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(EdgeCaseModel.vocab_size, (batch_size, EdgeCaseModel.block_size), generator=g)
    return x, x.roll(-1, dims=1)


def state_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---------------------------------------------------------------- models

@pytest.mark.parametrize("name", ["tiny-gpt", "mlp", "edge"])
def test_same_seed_same_bits_other_seed_other_bits(name):
    assert state_equal(build_model(name, seed=0), build_model(name, seed=0))
    a, b = build_model(name, seed=0), build_model(name, seed=1)
    trained = [k for k, p in a.named_parameters() if p.std() > 0]  # LayerNorm starts at exactly 1/0
    assert trained and all(not torch.equal(a.get_parameter(k), b.get_parameter(k)) for k in trained)


def test_building_leaves_global_rng_alone():
    state = torch.get_rng_state()
    for name in ("tiny-gpt", "mlp", "edge"):
        build_model(name, seed=3)
    assert torch.equal(state, torch.get_rng_state())


def test_tied_weights_are_one_parameter():
    untied, tied = TinyGPT(GPTConfig()), TinyGPT(GPTConfig(tie_weights=True))
    assert tied.lm_head.weight is tied.wte.weight
    assert untied.lm_head.weight.data_ptr() != untied.wte.weight.data_ptr()
    assert untied.num_params() - tied.num_params() == 64 * 64
    assert untied.num_params() == 110_336
    edge = EdgeCaseModel()
    assert edge.head.weight is edge.emb.weight

    # The tied gradient is the sum of both uses: build an untied twin with equal
    # values and compare. A wrapper that keeps only one use's gradient fails this.
    twin = TinyGPT(GPTConfig())
    with torch.no_grad():
        twin.lm_head.weight.copy_(twin.wte.weight)
    tied.load_state_dict(twin.state_dict())
    x, y = SyntheticTokens().batch(0, 4)
    tied(x, y)[1].backward()
    twin(x, y)[1].backward()
    assert torch.allclose(tied.wte.weight.grad, twin.wte.weight.grad + twin.lm_head.weight.grad, rtol=1e-6, atol=1e-9)


def test_edge_case_model_has_every_edge_case():
    m = EdgeCaseModel()
    x, y = edge_batch(1)
    sizes = {n: p.numel() for n, p in m.named_parameters()}
    assert sum(sizes.values()) == 239 and sum(p.numel() for p in m.parameters() if p.requires_grad) == 209
    assert any(all(n % k for k in (2, 3, 4)) for n in sizes.values())
    assert not m.frozen.weight.requires_grad and not m.frozen.bias.requires_grad
    assert "scale" in dict(m.named_buffers()) and "scale" in m.state_dict()

    logits, loss = m(x, y)
    loss.backward()
    assert m.frozen.weight.grad is None and m.unused.grad is None
    assert all(p.grad is not None for n, p in m.named_parameters() if p.requires_grad and n != "unused")

    # Used vs unused, checked by perturbing: frozen and the buffer change the output, unused does not.
    with torch.no_grad():
        for t, should_matter in ((m.frozen.weight, True), (m.scale, True), (m.unused, False)):
            saved = t.clone()
            t.add_(1.0)
            assert torch.equal(m(x)[0], logits) != should_matter
            t.copy_(saved)  # not sub_(1.0): x + 1 - 1 need not be x in floating point


def test_gpt_forward_is_deterministic_and_causal():
    m = TinyGPT()
    x, y = SyntheticTokens().batch(0, 4)
    logits, loss = m(x, y)
    assert logits.shape == (4, 32, 64) and loss.shape == ()
    assert torch.equal(m(x, y)[0], logits) and m(x)[1] is None
    # Changing token 20 may only change predictions at positions >= 20.
    x2 = x.clone()
    x2[:, 20] = (x2[:, 20] + 1) % 64
    changed = (m(x2)[0] != logits).any(dim=-1).any(dim=0)
    assert not changed[:20].any() and changed[20:].all()
    with pytest.raises(ValueError, match="block_size"):
        m(torch.zeros(1, 33, dtype=torch.long))


def test_build_model_names_and_overrides():
    with pytest.raises(ValueError, match="unknown model 'gpt5'.*edge, mlp, tiny-gpt"):
        build_model("gpt5")
    m = build_model("tiny-gpt", n_layer=3, tie_weights=True, seed=2)
    assert len(m.h) == 3 and m.lm_head.weight is m.wte.weight
    assert state_equal(m, TinyGPT(GPTConfig(n_layer=3, tie_weights=True), seed=2))
    assert build_model("mlp", sizes=(3, 5, 2)).layers[-1].out_features == 2


# ---------------------------------------------------------------- data

def test_batches_are_a_pure_function_of_seed_step_and_size():
    d = SyntheticTokens()
    x, y = d.batch(5, 8)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    assert torch.equal(SyntheticTokens().batch(5, 8)[0], x)  # a fresh object, same bits
    assert not torch.equal(d.batch(6, 8)[0], x)
    assert not torch.equal(SyntheticTokens(seed=1).batch(5, 8)[0], x)
    assert torch.equal(d.batch(5, 16)[0][:8], x)  # a smaller batch is a prefix of a larger one


def test_sampled_tokens_follow_the_chain_and_entropy_is_the_floor():
    d = SyntheticTokens()
    H = d.entropy()
    assert 0.80 < H < 0.95  # 2-3 successors per token: far below ln 64 = 4.16
    x, y = d.batch(0, 1024)
    assert (d.P[x, y] > 0).all()  # never a transition the chain does not have
    # The true chain's loss on samples is the entropy rate, up to sampling noise
    # (measured 0.8868 vs 0.8880 on these 32k tokens).
    assert abs(float(-d.P[x, y].log().mean()) - H) < 0.01


def test_tiny_gpt_learns_the_chain():
    # Measured on this config (2-core CPU, ~1 s): step 0 = 4.159 (ln 64 = 4.159),
    # step 50 = 1.06, held-out loss after 100 steps = 1.016, floor 0.888.
    d = SyntheticTokens()
    m = TinyGPT()
    losses = train_single(m, torch.optim.Adam(m.parameters(), lr=3e-3), (d.batch(s, 16) for s in range(100)))
    assert len(losses) == 100 and all(isinstance(v, float) for v in losses)
    assert abs(losses[0] - math.log(64)) < 0.05
    with torch.no_grad():
        held_out = m(*d.batch(10**6, 256))[1].item()
    assert held_out < 1.06  # within 0.17 nats of the floor, from 3.3 above it
    assert held_out > d.entropy() - 0.03  # nothing beats the floor: no leak from y into x


def test_shard_reconstructs_the_global_batch():
    x, y = SyntheticTokens().batch(0, 12)
    for n in (1, 2, 3, 4):
        parts = [shard((x, y), r, n) for r in range(n)]
        assert all(isinstance(p, tuple) and p[0].shape[0] == 12 // n for p in parts)
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
    assert shard(x, 1, 4).data_ptr() == x[3].data_ptr()  # a view, not a copy
    with pytest.raises(ValueError, match="global batch 10 does not divide over 4 ranks; use a multiple of 4"):
        shard(torch.zeros(10, 3), 0, 4)
    with pytest.raises(ValueError, match="rank 4"):
        shard(x, 4, 4)


def test_regression_batch_and_mlp():
    x, y = regression_batch(3, 8, 16, 4)
    assert x.shape == (8, 16) and y.shape == (8, 4) and x.dtype == torch.float32
    assert torch.equal(regression_batch(3, 8, 16, 4)[1], y)
    assert not torch.equal(regression_batch(4, 8, 16, 4)[0], x)
    m = MLP()
    losses = train_single(m, torch.optim.Adam(m.parameters(), lr=1e-2),
                          (regression_batch(s, 32, 16, 4) for s in range(100)))
    assert losses[-1] < 0.25 * losses[0]


# ---------------------------------------------------------------- baseline

@pytest.mark.parametrize("name", ["tiny-gpt", "edge"])
def test_mean_of_equal_shard_grads_is_the_full_batch_grad(name):
    """The claim that makes train_single the reference for DDP (baselines.py docstring)."""
    m = build_model(name)
    x, y = SyntheticTokens().batch(0, 8) if name == "tiny-gpt" else edge_batch(0)
    m(x, y)[1].backward()
    full = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    for r in range(4):
        (m(*shard((x, y), r, 4))[1] / 4).backward()
    assert full.keys() == {n for n, p in m.named_parameters() if p.grad is not None}
    # torch.allclose, not torch.testing.assert_close: the latter's first call costs ~2 s of imports.
    # Measured max abs difference: 3e-8 (tiny-gpt, grads up to 0.2), 5e-7 (edge, grads up to 2.6).
    bad = [n for n, p in m.named_parameters() if n in full
           and not torch.allclose(p.grad, full[n], rtol=1e-6, atol=1e-7)]
    assert not bad, f"shard-averaged gradients differ from the full-batch ones in {bad}"
