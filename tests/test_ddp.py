"""DDP (three modes) and the single-process DataParallel against the single-process
full-batch baseline and torch's DistributedDataParallel, at N = 1, 2, 3, 4 ranks.

Tolerances, and why they differ by optimizer:
  * SGD (momentum 0.9): rtol 1e-6, atol 2e-7. The only difference from one process is
    the order of float32 additions (mean of shard means vs one mean). Five momentum steps
    at lr 0.1 carry that to a few ulps of the edge model's O(1) weights: at N=3 we need
    atol 1.05e-7, and torch's own DDP needs 1.3e-7.
  * Adam: atol 1e-3 (a tenth of lr). Adam divides each element by its own gradient
    scale, so an element whose gradient nearly cancels turns a rounding-sized difference
    into an O(lr) relative one: torch DDP itself is 3.6e-5..2.2e-4 from one process on
    the GPT. A parameter that is not reduced at all still fails: its local gradient
    moves it by ~lr per step. (Adam cannot see a missing /N at all; SGD catches that.)
  * Bitwise: bucketed == overlap at every N (same buckets, same collectives, only the
    launch time differs). At N <= 2 every mode and torch DDP agree bitwise: a sum of two
    numbers has one rounding whatever the order, and halving is exact.
"""
import math

import pytest
import torch

from minizero import launch
from minizero_course.experiments.references import train_single
from minizero.dp.data_parallel import DataParallel
from minizero.models import build_model
from minizero_course.experiments.references import flat_params, global_batches, make_optimizer

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

W = "tests/ddp_workers.py:"
GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)
MODELS = {"tiny-gpt": GPT, "edge": {}}  # the same as ddp_workers.MODELS
LABELS = ("naive", "bucketed", "overlap", "overlap-1bucket")
TOL = {"sgd": 2e-7, "adam": 1e-3}  # atol at rtol 1e-6, see the module docstring

_results = {}


def results(n):
    """One job per N runs everything (a launch costs seconds); tests read from it."""
    if n not in _results:
        _results[n] = launch.run(W + "train_all", nprocs=n, timeout=240)
    return _results[n]


def unique_trainable(model):
    """Psi: trainable elements, a tied weight once (found by identity, not by name)."""
    seen = {id(p): p.numel() for _, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return sum(seen.values())


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ddp_matches_single_process_and_torch_ddp(n):
    res = results(n)
    r0 = res[0]
    assert r0["warnings"] == [] and r0["api_warnings"] == []
    for name in MODELS:
        for opt in ("sgd", "adam"):
            key = f"{name}/{opt}"
            for label in LABELS:
                for ref in ("single", "torch"):
                    got = r0[f"{key}/{label}/vs_{ref}"]["atol_needed"]
                    assert got <= TOL[opt], f"{key} {label} vs {ref} at N={n}: needs atol {got:.3g}"
                # every rank ends with the same bits
                assert len({out[f"{key}/{label}/digest"] for out in res}) == 1, f"{key} {label}: ranks differ"
            digests = {label: r0[f"{key}/{label}/digest"] for label in LABELS}
            assert digests["bucketed"] == digests["overlap"], f"{key} at N={n}"
            if n <= 2:
                assert set(digests.values()) == {r0[f"{key}/torch/digest"]}, f"{key} at N={n}: {digests}"
    # Sanity of the references themselves: torch DDP is as close to one process as we are.
    assert r0["tiny-gpt/sgd/torch/vs_single"]["atol_needed"] <= TOL["sgd"]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_bytes_per_step_match_ring_allreduce(n):
    r0 = results(n)[0]
    for name, cfg in MODELS.items():
        model = build_model(name, seed=0, **cfg)
        psi = unique_trainable(model)
        assert r0[f"{name}/psi"] == psi
        want = 2 * (n - 1) / n * psi * 4  # fp32 gradients, all-reduced once per step
        # + rank 0's buffers broadcast before each forward (torch DDP's broadcast_buffers=True)
        want += (n - 1) / n * sum(b.numel() * b.element_size() for b in model.buffers())
        for opt in ("sgd", "adam"):
            for label in LABELS:
                sent = r0[f"{name}/{opt}/{label}/sent"]
                assert sent == pytest.approx([want] * len(sent), rel=1e-12, abs=1e-9), f"{name} {label}"


def test_overlap_launches_during_backward_and_buckets_are_the_gradients():
    r0 = results(2)[0]
    key = "tiny-gpt/sgd"
    nb = r0[f"{key}/overlap/buckets"]
    assert nb > 3 and r0[f"{key}/bucketed/buckets"] == nb and r0[f"{key}/overlap-1bucket/buckets"] == 1
    # Every parameter of the GPT is used, so every bucket is launched before finish ...
    assert r0[f"{key}/overlap/launched_in_backward"] == [nb] * 5
    assert r0[f"{key}/bucketed/launched_in_backward"] == [0] * 5
    # ... but the bucket holding the edge model's unused parameter never fills: it goes
    # out at finish (with zeros in that slot). It is the last bucket because parameters()
    # yields the root module's own `unused` first; had it come first, launching in bucket
    # order would have held every bucket back until finish.
    nb = r0["edge/sgd/overlap/buckets"]
    assert nb > 3 and r0["edge/sgd/overlap/launched_in_backward"] == [nb - 1] * 5
    for name in MODELS:
        psi = r0[f"{name}/psi"]
        # After finish each p.grad is a view into a bucket: gradients are 4*Psi, not 8*Psi,
        # and the buckets stay allocated between steps. Naive keeps no buckets.
        unused = 6 if name == "edge" else 0  # the unused parameter keeps grad None
        assert r0[f"{name}/sgd/naive/grad_bytes"] == 4 * (psi - unused)
        assert r0[f"{name}/sgd/naive/grad_bytes_between_steps"] == 0
        for label in ("bucketed", "overlap", "overlap-1bucket"):
            assert r0[f"{name}/sgd/{label}/grad_bytes"] == 4 * psi
            assert r0[f"{name}/sgd/{label}/grad_bytes_between_steps"] == 4 * psi
        assert r0["edge/sgd/naive/unused_grad_none"] and r0["edge/adam/overlap/unused_grad_none"]


@pytest.mark.parametrize("n", [2, 3])
def test_no_sync_unused_params_broadcast_and_errors(n):
    res = results(n)
    for r, out in enumerate(res):
        assert out["broadcast_ok"], f"rank {r} did not take rank 0's weights and buffers"
        assert out["state_dict_keys_ok"]
        for mode in ("naive", "bucketed", "overlap"):
            assert out[f"no_sync/{mode}/sent_inside"] == 0  # no_sync really sends nothing
            # a parameter only rank 0 used: everyone gets (1 + 0 * (n-1)) / n
            assert out[f"used_by_rank0/{mode}"] == [pytest.approx(1 / n, rel=1e-7)]
        psi = unique_trainable(build_model("tiny-gpt", seed=0, **GPT))
        assert out["rewrap_sent"] == pytest.approx(2 * (n - 1) / n * psi * 4, rel=1e-12)
        assert "already called for this backward" in out["finish_twice"]
        assert "second gradient before finish_gradient_synchronization" in out["backward_twice"]
    for mode in ("naive", "bucketed", "overlap"):
        # two micro-batches under no_sync == one step on both concatenated
        assert res[0][f"no_sync/{mode}"]["atol_needed"] <= 1e-7


@pytest.mark.parametrize("name,opt", [("tiny-gpt", "sgd"), ("edge", "sgd"), ("edge", "adam")])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_data_parallel_equals_single_process(name, opt, n):
    """In this process: DataParallel needs no communicator, only n replicas."""
    torch.set_num_threads(1)
    lr = {"sgd": 0.1, "adam": 1e-2}[opt]
    ref = build_model(name, seed=0, **MODELS[name])
    batches = global_batches(ref, 4, 12)
    ref_losses = train_single(ref, make_optimizer(opt, ref.parameters(), lr), batches)

    dp = DataParallel(build_model(name, seed=0, **MODELS[name]), n)
    optim = make_optimizer(opt, dp.parameters(), lr)
    losses = []
    for x, y in batches:
        logits, loss = dp(x, y)
        assert logits.shape[0] == x.shape[0]  # gathered back to the full batch
        loss.backward()
        dp.reduce_gradients()
        optim.step()
        optim.zero_grad(set_to_none=True)
        dp.sync_replicas()
        losses.append(loss.item())
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    got, want = flat_params(dp.module), flat_params(ref)
    assert torch.allclose(got, want, rtol=1e-6, atol=TOL[opt]), (got - want).abs().max()
    for replica in dp.replicas[1:]:
        assert torch.equal(flat_params(replica), got)  # replicas really were synced
    assert list(dp.state_dict()) == list(ref.state_dict())
    if name == "edge":
        assert dp.module.unused.grad is None and dp.module.head.weight is dp.module.emb.weight
        assert all(r.head.weight is r.emb.weight for r in dp.replicas)


def test_data_parallel_rejects_uneven_batch():
    dp = DataParallel(build_model("edge", seed=0), 3)
    with pytest.raises(ValueError, match="does not split evenly"):
        dp(*global_batches(dp.module, 1, 4)[0])


def test_ring_formula_example_tiny_gpt_at_4_ranks():
    """The number quoted in lesson 02: 2(N-1)/N * Psi * 4 bytes at N=4."""
    psi = unique_trainable(build_model("tiny-gpt", seed=0, **GPT))
    assert psi == 28032 and math.isclose(2 * 3 / 4 * psi * 4, 168192)


def test_torch_backend():
    """Everything above ran on the mpi backend; gloo's async handles work the same way."""
    res = launch.run(W + "torch_backend_smoke", nprocs=2, backend="torch", timeout=120)
    psi = unique_trainable(build_model("edge", seed=0))
    buffers = sum(b.numel() * 4 for b in build_model("edge", seed=0).buffers())  # broadcast before each forward
    for out in res:
        assert out["backend"] == "torch"
        for mode in ("naive", "overlap"):
            assert out[mode]["atol_needed"] <= TOL["sgd"]
            assert out[f"{mode}/sent"] == pytest.approx([2 * 1 / 2 * psi * 4 + buffers / 2] * 5, rel=1e-12)
